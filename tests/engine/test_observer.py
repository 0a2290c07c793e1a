"""The observer's contract: reads off the loop, one at a time, shared by whoever waits for a read
begun after a moment; a caller going away never cancels a shared read; an older read never
replaces a newer observation; the background re-read is bounded."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from gpud.engine.observe.discovery import Observation
from gpud.engine.observe.observer import Observer
from gpud.model import Gpu, Holder, PciFunction


class Host:
    """Each read returns a new Observation that differs from the others (an unchanged read is kept
    as the observation in force, below), told apart by identity; a read can be held mid-read."""

    def __init__(self) -> None:
        self.reads: list[Observation] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)
        self.threads: set[str] = set()

    def read(self) -> Observation:
        self.threads.add(threading.current_thread().name)
        self.entered.release()
        assert self.gate.wait(30)
        obs = Observation(gpus=(), functions=(), nvml_error=f"read {len(self.reads) + 1}")
        self.reads.append(obs)
        return obs


def _observer(host: Host, installed: list, **kw) -> Observer:
    return Observer(host.read, installed.append, **kw)


async def _entered(host: Host) -> None:
    assert await asyncio.to_thread(host.entered.acquire, True, 30)


async def test_reads_run_off_the_loop_and_concurrent_callers_share_one():
    host, installed = Host(), list[Any]()
    obs = _observer(host, installed)
    host.gate.clear()
    since = time.monotonic()  # five requests that arrived together
    callers = [asyncio.create_task(obs.fresh(since)) for _ in range(5)]
    await _entered(host)
    host.gate.set()
    results = await asyncio.gather(*callers)
    assert len(host.reads) == 1 and all(r is host.reads[0] for r in results)
    assert installed == host.reads and obs.reads == 1
    assert threading.main_thread().name not in host.threads


async def test_a_read_begun_before_the_request_is_not_taken_as_fresh():
    host, installed = Host(), list[Any]()
    obs = _observer(host, installed)
    host.gate.clear()
    first = asyncio.create_task(obs.refresh())
    await _entered(host)
    second = asyncio.create_task(obs.refresh())  # asked while the first read is under way
    await asyncio.sleep(0)
    host.gate.set()
    a, b = await asyncio.gather(first, second)
    assert a is host.reads[0] and b is host.reads[1] and len(host.reads) == 2
    assert installed == host.reads


async def test_a_cancelled_caller_does_not_cancel_the_shared_read():
    host, installed = Host(), list[Any]()
    obs = _observer(host, installed)
    host.gate.clear()
    leaving = asyncio.create_task(obs.refresh())
    await _entered(host)
    staying = asyncio.create_task(obs.fresh(0.0))
    await asyncio.sleep(0)
    leaving.cancel()
    host.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert await staying is host.reads[0] and installed == host.reads


async def test_an_older_read_finishing_late_never_replaces_a_newer_observation():
    host, installed = Host(), list[Any]()
    obs = _observer(host, installed)
    host.gate.clear()
    slow = asyncio.create_task(obs.refresh())
    await _entered(host)

    def read_now_elsewhere() -> Observation:  # a read begun later, finished first
        result = Observation(gpus=(), functions=())
        obs._take(result, time.monotonic(), 0.0)
        return result

    newer = read_now_elsewhere()
    host.gate.set()
    older = await slow
    assert older is not newer and installed == [newer]
    assert obs._current is newer


async def test_background_reread_is_bounded_by_max_age_and_waits_for_hardware_steps():
    host, installed = Host(), list[Any]()
    busy = [False]
    obs = _observer(host, installed, max_age=3600, busy=lambda: busy[0])
    await obs.refresh()
    for _ in range(3):
        obs.poke()
        await asyncio.sleep(0)
    assert len(host.reads) == 1  # younger than max_age: nothing read
    obs.max_age = 0.0
    busy[0] = True
    obs.poke()
    await asyncio.sleep(0)
    assert obs._running is None and len(host.reads) == 1  # a step is in flight: it re-reads itself
    busy[0] = False
    obs.poke()
    assert obs._background is not None
    await obs._background
    assert len(host.reads) == 2 and installed[-1] is host.reads[-1]
    assert 0.0 <= obs.age() < 3600


# ---- what did not change stays the same object ---------------------------------------------------
def _gpu(index: int, holder: int | None = None) -> Gpu:
    """A new record each call: equal records from separate reads are separate objects."""
    pci = f"0000:{0x18 + index:02x}:00.0"
    fn = PciFunction(address=pci, vendor=0x10DE, device=0x2330, subsystem_vendor=0x10DE, subsystem_device=0x16C1,
                     class_code=0x030200, driver="nvidia", iommu_group=10 + index)
    holders = (Holder(pid=holder, name="python3", device=f"/dev/nvidia{index}"),) if holder else ()
    return Gpu(index=index, function=fn, holders=holders)


async def test_a_read_that_found_the_host_unchanged_keeps_the_observation_in_force():
    """What is built from an observation (resolution, view, the status reply, labels) is kept by
    identity: a background re-read of an unchanged host must not make it all new on the loop."""
    reads: list[Observation] = []

    def read() -> Observation:
        gpus = (_gpu(0), _gpu(1))
        reads.append(Observation(gpus=gpus, functions=tuple(g.function for g in gpus)))
        return reads[-1]

    installed: list[Observation] = []
    obs = Observer(read, installed.append)
    first = await obs.refresh()
    started = obs.started
    again = await obs.refresh()
    assert len(reads) == 2 and reads[1] is not reads[0] and reads[1] == reads[0]
    assert again is first and installed == [first, first]
    assert obs.reads == 2 and obs.started > started  # the answer's age is the new read's


async def test_a_read_keeps_each_unchanged_gpu_record_and_takes_the_changed_one():
    holder: list[int | None] = [None, None, None]

    def read() -> Observation:
        gpus = tuple(_gpu(i, h) for i, h in enumerate(holder))
        return Observation(gpus=gpus, functions=tuple(g.function for g in gpus))

    obs = Observer(read, lambda o: None)
    first = await obs.refresh()
    holder[1] = 41  # a process opened GPU 1
    second = await obs.refresh()
    assert second is not first and second.functions is first.functions
    assert second.gpus[0] is first.gpus[0] and second.gpus[2] is first.gpus[2]
    assert second.gpus[1] is not first.gpus[1] and second.gpus[1].holders[0].pid == 41
    assert second == read()  # the content is the read's, whatever objects carry it
    # one GPU read again alone after a step, found as it was: the record in force is kept
    third = await obs.refresh_gpu(second.gpus[1].pci, lambda g: _gpu(1, 41))
    assert third.gpus[1] is second.gpus[1]


# ---- the reconciler's wiring: no background read of the whole host while a pass's GPUs step --------
async def test_no_background_reread_while_a_pass_steps_its_gpus(tmp_path):
    """Between one GPU's steps and the next, no step is in flight but the GPU is still in its
    rounds: the pass re-reads what it changes and the whole host at its end, so a client's look
    starts no read of all GPUs then (at 64 GPUs one costs about 1,000 NVML calls and competes with
    the pass's own)."""
    from tests.scenarios.definitions import layout
    from tests.support.simrig import SimRig

    rig = SimRig(tmp_path, ("h100-80gb:2",))
    try:
        assert await rig.apply(layout({"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}))
        observer = rig.rec.observer
        observer.max_age = 0.0
        started: list[bool] = []
        refresh_gpu = observer.refresh_gpu

        async def poke_after(pci, read_gpu):  # a client looks as a GPU's MIG steps end
            out = await refresh_gpu(pci, read_gpu)
            assert rig.rec.rounds.running and not rig.rec.steps.inflight
            observer.poke()
            started.append(observer._background is not None and not observer._background.done())
            return out

        observer.refresh_gpu = poke_after  # type: ignore[method-assign]
        assert await rig.apply(layout({"devices": "all", "mig-enabled": True, "mig-devices": {"3g.40gb": 2}}))
        assert started and not any(started)
        observer.refresh_gpu = refresh_gpu  # type: ignore[method-assign]
        observer.poke()  # the pass over: a look re-reads again
        assert observer._background is not None
        await observer._background
    finally:
        rig.close()


async def test_a_pass_waiting_for_the_apply_lock_leaves_looks_their_reads(tmp_path):
    """A pass that waits (here for the apply lock another gpud holds; hooks, operands and the CDI
    refresh are waits too) re-reads nothing meanwhile: a client's look still re-reads the host, or
    status would show the host as it was when the pass began for as long as it waits."""
    import fcntl
    import os

    from gpud.engine.apply_lock import open_lock_file
    from tests.scenarios.definitions import layout
    from tests.support.simrig import SimRig

    rig = SimRig(tmp_path, ("h100-80gb:1",))
    try:
        assert await rig.apply(layout({"devices": "all", "mig-enabled": False}))
        observer = rig.rec.observer
        observer.max_age = 0.0
        fd = open_lock_file(rig.dir / "apply.lock")
        fcntl.flock(fd, fcntl.LOCK_EX)  # another gpud applying
        runner = asyncio.create_task(rig.rec.run(debounce=0))
        try:
            ticket = rig.rec.kick("test")
            while not rig.rec.scheduler.running:  # the pass has begun: it waits for the lock
                await asyncio.sleep(0)
            reads = observer.reads
            observer.poke()
            assert observer._background is not None
            await observer._background
            assert observer.reads == reads + 1 and rig.rec.scheduler.running
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        assert await rig.rec.wait_for(ticket, 60)
        runner.cancel()
    finally:
        rig.close()


async def test_a_read_a_look_started_after_the_rounds_is_the_pass_end_read(tmp_path):
    """The pass ends with a read of the whole host begun after its GPUs' rounds ended; when a
    client's look started one in that window (the rounds are over, hooks or the CDI refresh may
    still run), the pass takes it rather than reading all GPUs again."""
    from tests.scenarios.definitions import layout
    from tests.support.simrig import SimRig

    rig = SimRig(tmp_path, ("h100-80gb:2",))
    try:
        assert await rig.apply(layout({"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}))
        observer, rounds = rig.rec.observer, rig.rec.rounds
        observer.max_age = 0.0
        looked: list[float] = []
        converge = rounds.converge

        async def look_after(pci, desired):  # a client looks as the last GPU's rounds end
            await converge(pci, desired)
            if rounds.running == 0:
                observer.poke()
                looked.append(observer._running_since)
            return None

        rounds.converge = look_after  # type: ignore[method-assign]
        seen = rig.read_spy()
        assert await rig.apply(layout({"devices": "all", "mig-enabled": True, "mig-devices": {"3g.40gb": 2}}))
        assert looked and looked[-1] >= rounds.ended  # the look's read began after the rounds
        last_gpu = max(i for i, x in enumerate(seen) if x != "*")
        assert seen[last_gpu + 1:] == ["*"]  # after the GPUs' reads, one of the whole host: the look's
        assert observer.started == looked[-1]  # the observation in force is that read
        assert [len(g.nvml.instances) for g in rig.rec.observation.gpus if g.nvml] == [2, 2]
    finally:
        rig.close()
