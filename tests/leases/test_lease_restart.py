"""Leases outlive gpud: `kill -9` at each step of a lease, then a new engine on the same state
directory; the outcome read from the simulator's state file. No orphan instance, no lease twice,
and 0 mutating NVML calls where the records and the GPU agree."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from gpud.engine.leases.engine import LeaseRefused
from gpud.sim import state as simstate
from tests.leases.rig import dynamic_rig, restarted, sim_gis

# Every step of a lease, in order (gpud.engine.leases.executor): the GPU starts with MIG off, so the
# first lease turns it on (`mode-on`). What a new gpud finds: `None` nothing of the lease (it never
# reached the disk), `lease-dropped` (rolled back: no instance left), `lease-adopted` (GI and CI
# were made: the lease stands), `held` (it was complete).
LEASE_STEPS = [("before-intent", None), ("intent", "lease-dropped"), ("mode-on", "lease-dropped"),
               ("gi-created", "lease-dropped"), ("gi-made", "lease-dropped"), ("ci-made", "lease-adopted"),
               ("held", "held")]


@pytest.mark.parametrize(("stage", "outcome"), LEASE_STEPS)
async def test_kill_9_at_each_step_of_a_lease(tmp_path, stage, outcome):
    rig = await dynamic_rig(tmp_path, ("h100-80gb:1",))
    try:
        child = subprocess.run([sys.executable, "-m", "tests.leases.lease_child", str(tmp_path), "3g.40gb", stage],
                               timeout=120, capture_output=True, text=True)
        assert child.returncode == -9, child.stderr
        reached_nvml = stage not in ("before-intent", "intent")
        assert rig.mig_mode(0) == (1 if reached_nvml else 0)  # the simulator's state file, as the kill left it
        if stage in ("gi-created", "gi-made", "ci-made", "held"):
            assert [n for n, _, _ in sim_gis(rig)] == ["3g.40gb"]  # made before the kill
        calls = rig.calls()
        events = await restarted(rig, tmp_path)
        kinds = [e["kind"] for e in events if e["kind"].startswith("lease")]
        leases = rig.rec.leases.leases()
        gis = sim_gis(rig)
        if outcome is None or outcome == "lease-dropped":
            assert kinds == ([outcome] if outcome else []) and leases == [] and gis == []
            # rolled back: only the half-made GI is destroyed (no CI: nothing ran in it)
            assert rig.mutating(calls) == (1 if stage in ("gi-created", "gi-made") else 0)
            again = await rig.rec.leases.lease("3g.40gb", owner="next")  # nothing left in the way
            assert [(n, u) for n, _, u in sim_gis(rig)] == [("3g.40gb", [again.uuid])]
        else:
            assert kinds == ([] if outcome == "held" else [outcome])
            assert len(leases) == 1 and leases[0].state == "held" and leases[0].owner == "killed"
            assert [(n, u) for n, _, u in gis] == [("3g.40gb", [leases[0].uuid])]
            assert rig.mutating(calls) == 0  # adopting needs no NVML change
            calls = rig.calls()
            events = await restarted(rig, tmp_path)  # records and NVML agree: nothing to do
            assert rig.mutating(calls) == 0 and [e for e in events if e["kind"].startswith("lease")] == []
            await rig.rec.leases.release(leases[0].id)
            assert sim_gis(rig) == [] and rig.mig_mode(0) == 0  # the last release turns MIG off
    finally:
        rig.close()


# Every step of a release: `released` when a new gpud finishes it, `held` when the kill came before
# its first record write, `gone` when it had finished but for turning MIG mode off.
RELEASE_STEPS = [("before-releasing", "held"), ("releasing", "released"), ("ci-destroyed", "released"),
                 ("gi-destroyed", "released"), ("dropped", "gone")]


@pytest.mark.parametrize(("stage", "outcome"), RELEASE_STEPS)
async def test_kill_9_at_each_step_of_a_release(tmp_path, stage, outcome):
    rig = await dynamic_rig(tmp_path, ("h100-80gb:1",))
    try:
        other = await rig.rec.leases.lease("1g.10gb", owner="stays")
        lease = await rig.rec.leases.lease("3g.40gb", owner="goes")
        await rig.rec.leases.settled()
        child = subprocess.run([sys.executable, "-m", "tests.leases.lease_child", str(tmp_path),
                                f"release:{lease.id}", stage], timeout=120, capture_output=True, text=True)
        assert child.returncode == -9, child.stderr
        calls = rig.calls()
        events = await restarted(rig, tmp_path)
        kinds = [e["kind"] for e in events if e["kind"].startswith("lease")]
        if outcome == "held":
            assert kinds == [] and rig.mutating(calls) == 0
            assert [r.id for r in rig.rec.leases.leases()] == [other.id, lease.id]
            assert [(n, u) for n, _, u in sim_gis(rig)] == [("1g.10gb", [other.uuid]), ("3g.40gb", [lease.uuid])]
            await rig.rec.leases.release(lease.id)  # the release asked again completes
        else:
            assert kinds == (["lease-released"] if outcome == "released" else [])
            assert [r.id for r in rig.rec.leases.leases()] == [other.id]
        assert [(n, u) for n, _, u in sim_gis(rig)] == [("1g.10gb", [other.uuid])]  # only its own went
        assert rig.mig_mode(0) == 1  # the other lease still holds MIG on
    finally:
        rig.close()


async def test_kill_9_after_the_last_release_before_mig_mode_off(tmp_path):
    """The one window no record covers: the last lease's record dropped, MIG mode not yet off. A new
    gpud leaves the mode on (no record says gpud turned it on; the next lease uses it, the next last
    release turns it off), and nothing else is touched."""
    rig = await dynamic_rig(tmp_path, ("h100-80gb:1",))
    try:
        lease = await rig.rec.leases.lease("2g.20gb", owner="goes")
        await rig.rec.leases.settled()
        child = subprocess.run([sys.executable, "-m", "tests.leases.lease_child", str(tmp_path),
                                f"release:{lease.id}", "dropped"], timeout=120, capture_output=True, text=True)
        assert child.returncode == -9, child.stderr
        calls = rig.calls()
        await restarted(rig, tmp_path)
        assert rig.mutating(calls) == 0 and sim_gis(rig) == [] and rig.rec.leases.leases() == []
        again = await rig.rec.leases.lease("1g.10gb")
        await rig.rec.leases.release(again.id)
        assert sim_gis(rig) == [] and rig.mig_mode(0) == 0
    finally:
        rig.close()


async def test_a_vanished_instance_is_reported_and_released_without_nvml(tmp_path):
    rig = await dynamic_rig(tmp_path, ("h100-80gb:1",))
    try:
        lease = await rig.rec.leases.lease("1g.10gb", owner="job-7")
        with simstate.locked(rig.dir) as state:  # someone ran `nvidia-smi mig -dci -dgi` meanwhile
            next(iter(state.gpus.values())).gis.clear()
        events = await restarted(rig, tmp_path)
        vanished = [e for e in events if e["kind"] == "lease-vanished"]
        assert len(vanished) == 1 and lease.id in vanished[0]["message"] and "job-7" in vanished[0]["message"]
        assert [r.state for r in rig.rec.leases.leases()] == ["vanished"]
        calls = rig.calls()
        await rig.rec.leases.release(lease.id)
        assert rig.mutating(calls) <= 1 and rig.rec.leases.leases() == []  # at most MIG mode off
    finally:
        rig.close()


async def test_records_on_disk_are_the_leases(tmp_path):
    rig = await dynamic_rig(tmp_path, ("h100-80gb:1",))
    try:
        lease = await rig.rec.leases.lease("2g.20gb", owner="slurm-42")
        on_disk = msgspec.json.decode((tmp_path / "state" / "leases.json").read_bytes())
        assert on_disk[lease.id]["state"] == "held" and on_disk[lease.id]["uuid"] == lease.uuid
        await rig.rec.leases.release(lease.id)
        assert msgspec.json.decode((tmp_path / "state" / "leases.json").read_bytes()) == {}
        with pytest.raises(LeaseRefused):
            await rig.rec.leases.release(lease.id)
    finally:
        rig.close()
