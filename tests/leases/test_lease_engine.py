"""The lease engine on a simulated host; every outcome read back from the simulator's state file."""

from __future__ import annotations

import asyncio
import subprocess
import threading

import pytest

from gpud.engine.leases.engine import LeaseRefused
from gpud.model import Placement
from gpud.sim import state as simstate
from tests.leases.rig import dynamic_rig, foreign_gi, pci, sim_gis
from tests.support.present import present
from tests.support.simrig import SimRig

SEED = ("1g.10gb", "1g.10gb", "1g.10gb", "3g.40gb", "1g.10gb")


@pytest.fixture
async def h100(tmp_path):
    rig = await dynamic_rig(tmp_path, ("h100-80gb:1",))
    yield rig
    rig.close()


async def test_seed_sequence_turns_mig_on_and_builds_the_partial_layout(h100):
    assert h100.mig_mode(0) == 0  # follow: MIG is off until the first lease
    calls = h100.calls()
    leases = [await h100.rec.leases.lease(name, owner="job-1") for name in SEED]
    assert h100.mig_mode(0) == 1
    assert h100.calls()["nvmlDeviceSetMigMode"] - calls["nvmlDeviceSetMigMode"] == 1  # once, at the first
    gis = sim_gis(h100)
    assert [(name, pl) for name, pl, _ in gis] == [
        ("1g.10gb", Placement(0, 1)), ("1g.10gb", Placement(1, 1)), ("1g.10gb", Placement(2, 1)),
        ("1g.10gb", Placement(3, 1)), ("3g.40gb", Placement(4, 4))]
    on_file = {uuid for _, _, uuids in gis for uuid in uuids}
    assert {lease.uuid for lease in leases} == on_file and len(on_file) == 5
    assert all(lease.devices[0].startswith("/dev/nvidia") and len(lease.devices) == 3 for lease in leases)


async def test_release_takes_only_its_own_and_mig_goes_off_after_the_last(h100):
    a = await h100.rec.leases.lease("3g.40gb")
    b = await h100.rec.leases.lease("1g.10gb")
    await h100.rec.leases.release(a.id)
    assert [(n, u) for n, _, u in sim_gis(h100)] == [("1g.10gb", [b.uuid])]
    calls = h100.calls()
    await h100.rec.leases.release(b.id)
    assert sim_gis(h100) == [] and h100.mig_mode(0) == 0
    assert calls["nvmlDeviceSetMigMode"] < h100.calls()["nvmlDeviceSetMigMode"]
    with pytest.raises(LeaseRefused) as e:
        await h100.rec.leases.release(b.id)
    assert e.value.code == "not-found"


async def test_foreign_instances_are_never_destroyed_and_avoided(h100):
    with simstate.locked(h100.dir) as state:
        for g in state.gpus.values():
            g.mig_mode = g.mig_pending = 1
    foreign_gi(h100, "3g.40gb", 0)
    await h100.rec.refresh_async()
    foreign = sim_gis(h100)
    mine = await h100.rec.leases.lease("3g.40gb")
    assert mine.placement == Placement(4, 4)
    with pytest.raises(LeaseRefused) as e:
        await h100.rec.leases.lease("1g.10gb")
    assert e.value.code == "no-room" and "free memory slices none (0 of 8)" in str(e.value)
    await h100.rec.leases.release(mine.id)
    assert sim_gis(h100) == foreign and h100.mig_mode(0) == 1  # MIG stays on under someone else's GI


async def test_busy_release_fails_under_on_busy_fail_and_kills_nothing(tmp_path):
    rig = await dynamic_rig(tmp_path, ("h100-80gb:1",), **{"on-busy": "fail"})
    try:
        lease = await rig.rec.leases.lease("1g.10gb")
        child = rig.hold(present(lease.uuid), "train.py")
        with pytest.raises(LeaseRefused) as e:
            await rig.rec.leases.release(lease.id)
        assert e.value.code == "busy" and f"pid {child.pid} train.py" in str(e.value)
        assert child.poll() is None and [u for _, _, u in sim_gis(rig)] == [[lease.uuid]]
    finally:
        rig.close()


async def test_busy_release_waits_for_the_process_then_releases(h100):
    lease = await h100.rec.leases.lease("2g.20gb")
    child = h100.hold(lease.uuid, "train.py")
    q = h100.bus.subscribe()
    release = asyncio.create_task(h100.rec.leases.release(lease.id))
    while (ev := await asyncio.wait_for(q.get(), 10))["kind"] != "lease-waiting":
        pass
    assert f"pid {child.pid} train.py" in ev["message"] and sim_gis(h100) != []
    child.kill()
    child.wait()
    await asyncio.wait_for(release, 30)
    assert sim_gis(h100) == []


async def test_holder_pid_gone_releases_the_lease(h100):
    job = subprocess.Popen(["sleep", "600"])
    h100.children.append(job)
    lease = await h100.rec.leases.lease("1g.10gb", pid=job.pid)
    q = h100.bus.subscribe()
    job.kill()
    job.wait()
    while (ev := await asyncio.wait_for(q.get(), 10))["kind"] != "release":
        pass
    assert f"holder pid {job.pid} exited" in ev["message"] and lease.id in ev["message"]
    assert sim_gis(h100) == []


async def test_whole_gpu_lease_excludes_mig_leases(h100):
    whole = await h100.rec.leases.lease("gpu", gpu="0")
    with pytest.raises(LeaseRefused) as e:
        await h100.rec.leases.lease("1g.10gb")
    assert e.value.code == "no-room" and "leased whole" in str(e.value)
    await h100.rec.leases.release(whole.id)
    mig = await h100.rec.leases.lease("1g.10gb")
    with pytest.raises(LeaseRefused) as e:
        await h100.rec.leases.lease("gpu", gpu=pci(h100))
    assert e.value.code == "conflict" and mig.id in str(e.value)


async def test_ampere_keeps_mig_on_after_the_last_release(tmp_path):
    rig = await dynamic_rig(tmp_path, ("a100-80gb:1",))
    try:
        assert rig.mig_mode(0) == 1  # the apply turned it on (with its reset)
        lease = await rig.rec.leases.lease("1g.10gb")
        await rig.rec.leases.release(lease.id)
        assert rig.mig_mode(0) == 1 and sim_gis(rig) == []
    finally:
        rig.close()


async def test_fifty_concurrent_leases_on_eight_gpus_never_share_a_placement(tmp_path):
    rig = await dynamic_rig(tmp_path, ("h100-80gb:8",))
    try:
        names = ["1g.10gb", "2g.20gb", "3g.40gb", "1g.20gb", "4g.40gb"] * 10
        got = await asyncio.gather(*(rig.rec.leases.lease(n) for n in names), return_exceptions=True)
        ok = [g for g in got if not isinstance(g, BaseException)]
        refused = [g for g in got if isinstance(g, BaseException)]
        assert all(isinstance(r, LeaseRefused) and r.code == "no-room" and "free memory slices" in str(r)
                   for r in refused)
        state = simstate.load(rig.dir)
        gis = [(a, gi.start, gi.size) for a, g in state.gpus.items() for gi in g.gis]
        assert len(gis) == len(ok)  # one GI per lease, none twice
        for a, g in state.gpus.items():
            used = [s for gi in g.gis for s in range(gi.start, gi.start + gi.size)]
            assert len(used) == len(set(used)), a
        assert {lease.uuid for lease in ok} == {c.uuid for g in state.gpus.values() for gi in g.gis for c in gi.cis}
    finally:
        rig.close()


async def test_a_static_layout_over_leases_is_refused_naming_them(h100):
    lease = await h100.rec.leases.lease("3g.40gb", owner="slurm-9")
    static = ("version: v1\nlayouts:\n  s:\n    - devices: all\n      mig-enabled: true\n"
              "      mig-devices: {\"1g.10gb\": 7}\n")
    _, res, _ = await h100.rec.evaluate_async(static, "layout.yaml")
    assert res.errors and lease.id in str(res.errors[0]) and "slurm-9" in str(res.errors[0])
    assert str(res.errors[0]).startswith("layout.yaml:6 layouts.s[0].mig-devices: GPU 0")
    calls = h100.calls()
    assert not await h100.apply(static)  # the daemon's load refuses it the same way: nothing changes
    assert h100.mutating(calls) == 0 and [u for _, _, u in sim_gis(h100)] == [[lease.uuid]]
    keeps = static.replace('{"1g.10gb": 7}', '{"3g.40gb": 1, "1g.10gb": 3}')
    _, res, _ = await h100.rec.evaluate_async(keeps, "layout.yaml")
    assert res.errors == []  # a static layout that keeps the leased instance is fine


async def test_mig_mode_is_not_left_pending_when_a_process_holds_the_gpu(h100):
    with simstate.locked(h100.dir) as state:
        gpu_uuid = next(iter(state.gpus.values())).uuid
    child = h100.hold(gpu_uuid, "cuda-app")
    with pytest.raises(LeaseRefused) as e:
        await h100.rec.leases.lease("1g.10gb")
    assert e.value.code == "failed" and "processes use the GPU" in str(e.value)
    g = next(iter(simstate.load(h100.dir).gpus.values()))
    assert (g.mig_mode, g.mig_pending, g.gis) == (0, 0, []) and child.poll() is None
    assert h100.rec.leases.leases() == []


async def test_lease_and_release_never_wait_behind_a_static_apply_of_another_gpu(tmp_path):
    """GPU 1's static apply is held inside its first GI creation until the test lets it go; a lease
    and its release on dynamic GPU 0 complete meanwhile (were they queued behind the apply, they
    would wait for ever: the apply is let go only after them)."""
    rig = SimRig(tmp_path, ("h100-80gb:2",), state_dir=str(tmp_path / "state"))
    entered, go = threading.Event(), threading.Event()
    static_pci = pci(rig, 1)
    real_create = rig.hw.nvml.create_gpu_instance

    def held_create(pci: str, profile_id: int, start: int) -> int:
        if pci == static_pci:
            entered.set()
            go.wait(120)
        return real_create(pci, profile_id, start)

    rig.hw.nvml.create_gpu_instance = held_create  # type: ignore[method-assign]
    try:
        rig.config.write_text("version: v1\nlayouts:\n  d:\n    - devices: [0]\n      mig-enabled: true\n"
                              "      mig-devices: dynamic\n    - devices: [1]\n      mig-enabled: true\n"
                              "      mig-devices: {\"1g.10gb\": 7}\n")
        assert rig.rec.load_config()
        await rig.rec.leases.start()
        apply = asyncio.create_task(rig.rec.converge())
        assert await asyncio.to_thread(entered.wait, 120)  # the static apply is inside its NVML work
        lease = await asyncio.wait_for(rig.rec.leases.lease("3g.40gb"), 60)
        assert [(n, u) for n, _, u in sim_gis(rig, 0)] == [("3g.40gb", [lease.uuid])] and sim_gis(rig, 1) == []
        await asyncio.wait_for(rig.rec.leases.release(lease.id), 60)
        assert sim_gis(rig, 0) == [] and not apply.done()
        go.set()
        await asyncio.wait_for(apply, 120)
        assert [n for n, _, _ in sim_gis(rig, 1)] == ["1g.10gb"] * 7
    finally:
        go.set()
        rig.close()


async def test_every_layout_name_leases_its_gi_and_ci(h100):
    """A CI variant makes a smaller CI in the GI; `+me` is a GI profile of its own: both as the
    simulator's state file names its MIG devices."""
    small_ci = await h100.rec.leases.lease("1c.3g.40gb")
    me = await h100.rec.leases.lease("1g.10gb+me")
    on_file = {uuid: name for uuid, (name, _, _) in h100.mig_devices()[0].items()}
    assert on_file == {small_ci.uuid: "1c.3g.40gb", me.uuid: "1g.10gb+me"}
    with pytest.raises(LeaseRefused) as e:
        await h100.rec.leases.lease("5g.50gb")
    assert e.value.code == "no-room" and "not a MIG profile" in str(e.value) and "1g.10gb+me" in str(e.value)
    assert set(h100.mig_devices()[0]) == {small_ci.uuid, me.uuid}  # nothing changed
