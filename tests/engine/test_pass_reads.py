"""What a reconcile pass reads: a pass that changes nothing reads the host once; a pass that changes
one GPU's MIG layout reads that GPU again and not the others until the pass's last read. Counted by
the simulator's own NVML call counters and by which GPUs the NVML adapter was asked for."""

from __future__ import annotations

import asyncio
from collections import Counter

from tests.scenarios.definitions import layout, mig
from tests.support.simrig import SimRig

GPU0 = "0000:18:00.0"




def test_a_pass_that_changes_nothing_reads_the_host_once(tmp_path):
    rig = SimRig(tmp_path, ("h100-80gb:4",))
    try:
        assert asyncio.run(rig.apply(layout(mig([0, 1, 2, 3], {"1g.10gb": 7}))))
        before = rig.calls()
        asyncio.run(rig.rec.converge())
        made = rig.calls() - before
        assert set(rig.rec.gpu_states[p].state for p in rig.rec.gpu_states) == {"converged"}
        assert made["nvmlDeviceGetMigMode"] == 4  # one read of each GPU
        assert sum(made.values()) <= 4 * 60  # 7 MIG devices each: what changes, not the tables
        assert not any(f.startswith(("nvmlDeviceGetGpuInstanceProfileInfo", "nvmlGpuInstanceGetComputeInstanceProfile",
                                     "nvmlDeviceGetGpuInstancePossiblePlacements")) for f in made)
    finally:
        rig.close()


def test_a_pass_that_changes_one_gpu_reads_that_gpu_alone_until_its_end(tmp_path):
    rig = SimRig(tmp_path, ("h100-80gb:4",))
    try:
        assert asyncio.run(rig.apply(layout(mig([0, 1, 2, 3], {"1g.10gb": 7}))))
        seen = rig.read_spy()
        rig.config.write_text(layout(mig([0], {"3g.40gb": 2}), mig([1, 2, 3], {"1g.10gb": 7})))
        assert rig.rec.load_config()
        seen.clear()
        asyncio.run(rig.rec.converge())
        assert rig.rec.gpu_states[GPU0].state == "converged"
        assert seen[0] == seen[-1] == "*"  # the pass begins and ends with the whole host
        assert seen.count("*") == 2 and set(seen[1:-1]) == {GPU0}
        assert sorted(n for n, _, _ in rig.mig_devices()[0].values()) == ["3g.40gb", "3g.40gb"]
    finally:
        rig.close()


def test_an_apply_on_a_converged_host_reads_it_once(tmp_path):
    """`gpudctl apply`: the file is re-read against a fresh read of the host, and the pass it starts
    begins from that read (it began after the request), not from another."""
    from gpud.engine.queries import start_apply

    rig = SimRig(tmp_path, ("h100-80gb:2",))

    async def go() -> Counter[str]:
        assert await rig.apply(layout(mig([0, 1], {"1g.10gb": 7})))
        runner = asyncio.create_task(rig.rec.run(debounce=0))
        try:
            before = rig.calls()
            assert await rig.rec.wait_for(await start_apply(rig.rec), 60)
            return rig.calls() - before
        finally:
            runner.cancel()

    try:
        made = asyncio.run(go())
        assert {s.state for s in rig.rec.gpu_states.values()} == {"converged"}
        assert made["nvmlDeviceGetMigMode"] == 2  # one read of each GPU, for the file and the pass
    finally:
        rig.close()


def test_the_kernels_drivers_are_listed_once_per_observation_not_per_gpu(tmp_path):
    """What each GPU needs next is judged on the loop for every GPU; the drivers list it uses is read
    once per host read, not once per GPU (each listing is a system call on the loop)."""
    rig = SimRig(tmp_path, ("h100-80gb:4",))
    try:
        assert asyncio.run(rig.apply(layout(mig([0, 1, 2, 3], {"1g.10gb": 7}))))
        sysfs = rig.hw.sysfs
        listed = []
        drivers = sysfs.drivers

        def counted():
            listed.append(rig.rec.observation)
            return drivers()

        sysfs.drivers = counted  # type: ignore[method-assign]
        asyncio.run(rig.rec.converge())
        assert listed and len(listed) == len({id(o) for o in listed})  # never twice for one observation
    finally:
        rig.close()


def test_a_no_op_pass_plans_no_gpu_again(tmp_path, monkeypatch):
    """A pass whose host read found every GPU as it was plans none of them: the read keeps the GPU
    views in force, whose plans were made before (not once more for the discarded copies, nor once
    to see which GPUs change and again in each GPU's rounds)."""
    from gpud.engine import action_inputs
    from gpud.plan.mig import plan_gpu

    rig = SimRig(tmp_path, ("h100-80gb:4",))
    try:
        assert asyncio.run(rig.apply(layout(mig([0, 1, 2, 3], {"1g.10gb": 7}))))
        planned: list[str] = []

        def counted(gpu, desired):
            planned.append(gpu.pci)
            return plan_gpu(gpu, desired)

        monkeypatch.setattr(action_inputs, "plan_gpu", counted)
        reads = rig.rec.observer.reads
        asyncio.run(rig.rec.converge())
        assert rig.rec.observer.reads > reads  # the pass did read the host again
        assert planned == []
    finally:
        rig.close()


def test_an_apply_on_a_converged_host_plans_off_the_loop(tmp_path, monkeypatch):
    """The GPUs' MIG plans are made in the worker thread that resolved the file for `gpudctl apply`;
    its judge and the pass that follows on the loop find them made (planning 64 GPUs on the loop
    held every client up)."""
    import threading

    from gpud.engine import action_inputs
    from gpud.engine.queries import start_apply
    from gpud.plan.mig import plan_gpu

    rig = SimRig(tmp_path, ("h100-80gb:4",))
    on_loop: list[str] = []
    off_loop: list[str] = []

    def counted(gpu, desired):
        (on_loop if threading.current_thread() is threading.main_thread() else off_loop).append(gpu.pci)
        return plan_gpu(gpu, desired)

    async def go() -> None:
        assert await rig.apply(layout(mig([0, 1, 2, 3], {"1g.10gb": 7})))
        monkeypatch.setattr(action_inputs, "plan_gpu", counted)
        # the plans made while converging are forgotten (an unchanged re-read would find them kept
        # and plan nothing): the apply has to make every GPU's plan again, and must do it off the loop
        rig.rec.plans._plans.clear()
        runner = asyncio.create_task(rig.rec.run(debounce=0))
        try:
            assert await rig.rec.wait_for(await start_apply(rig.rec), 60)
        finally:
            runner.cancel()

    try:
        asyncio.run(go())
        assert {s.state for s in rig.rec.gpu_states.values()} == {"converged"}
        assert sorted(off_loop) == sorted(g.pci for g in rig.rec.observation.gpus) and on_loop == []
    finally:
        rig.close()


def test_a_gpu_read_again_after_a_step_is_resolved_off_the_loop(tmp_path, monkeypatch):
    """After each step of a pass its GPU is read again and the observation installed on the loop;
    the layout is resolved against it in the reading thread (at 64 GPUs milliseconds of the
    loop's time per step otherwise), and the loop takes that resolution. All four GPUs change, in
    parallel: a GPU whose read was prepared while another's was taken is prepared again, off the
    loop (the one-slot cache and the loop's own resolution for those held the loop ~3 ms each)."""
    import threading

    from gpud.engine import layout_keeper

    rig = SimRig(tmp_path, ("h100-80gb:4",))
    on_loop: list[int] = []
    off_loop: list[int] = []
    real = layout_keeper.resolve

    def counted(parsed, gpus, **kw):
        (on_loop if threading.current_thread() is threading.main_thread() else off_loop).append(len(gpus))
        return real(parsed, gpus, **kw)

    async def go() -> None:
        assert await rig.apply(layout(mig([0, 1, 2, 3], {"1g.10gb": 7})))
        rig.config.write_text(layout(mig([0, 1, 2, 3], {"3g.40gb": 2})))
        assert rig.rec.load_config()  # the new file resolved once, as taken (not a step's work)
        monkeypatch.setattr(layout_keeper, "resolve", counted)
        await rig.rec.converge()

    try:
        asyncio.run(go())
        assert {s.state for s in rig.rec.gpu_states.values()} == {"converged"}
        assert [len(g.nvml.instances) if g.nvml is not None else None for g in rig.rec.observation.gpus] == [2, 2, 2, 2]
        assert len(off_loop) >= 5 and on_loop == []  # the pass's read, and each GPU's after its steps
    finally:
        rig.close()
