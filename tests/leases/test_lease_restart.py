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


@pytest.mark.parametrize(("stage", "outcome"), [
    ("intent", "lease-dropped"), ("gi-made", "lease-dropped"), ("ci-made", "lease-adopted"), ("held", None)])
async def test_kill_9_at_each_step_of_a_lease(tmp_path, stage, outcome):
    rig = await dynamic_rig(tmp_path, ("h100-80gb:1",))
    try:
        child = subprocess.run([sys.executable, "-m", "tests.leases.lease_child", str(tmp_path), "3g.40gb", stage],
                               timeout=120, capture_output=True, text=True)
        assert child.returncode == -9, child.stderr
        calls = rig.calls()
        events = await restarted(rig, tmp_path)
        kinds = [e["kind"] for e in events if e["kind"].startswith("lease")]
        leases = rig.rec.leases.leases()
        gis = sim_gis(rig)
        if outcome == "lease-dropped":
            assert kinds == ["lease-dropped"] and leases == [] and gis == []
        else:
            assert kinds == ([outcome] if outcome else [])
            assert len(leases) == 1 and leases[0].state == "held" and leases[0].owner == "killed"
            assert [(n, u) for n, _, u in gis] == [("3g.40gb", [leases[0].uuid])]
            assert rig.mutating(calls) == 0  # adopting needs no NVML change
            calls = rig.calls()
            again = await restarted(rig, tmp_path)  # records and NVML agree: nothing to do
            assert rig.mutating(calls) == 0 and [e for e in again if e["kind"].startswith("lease")] == []
            await rig.rec.leases.release(leases[0].id)
            assert sim_gis(rig) == []
    finally:
        rig.close()


@pytest.mark.parametrize("stage", ["releasing", "ci-destroyed", "gi-destroyed"])
async def test_kill_9_at_each_step_of_a_release(tmp_path, stage):
    rig = await dynamic_rig(tmp_path, ("h100-80gb:1",))
    try:
        other = await rig.rec.leases.lease("1g.10gb", owner="stays")
        lease = await rig.rec.leases.lease("3g.40gb", owner="goes")
        await rig.rec.leases.settled()
        child = subprocess.run([sys.executable, "-m", "tests.leases.lease_child", str(tmp_path),
                                f"release:{lease.id}", stage], timeout=120, capture_output=True, text=True)
        assert child.returncode == -9, child.stderr
        events = await restarted(rig, tmp_path)
        assert [e["kind"] for e in events if e["kind"].startswith("lease")] == ["lease-released"]
        assert [r.id for r in rig.rec.leases.leases()] == [other.id]
        assert [(n, u) for n, _, u in sim_gis(rig)] == [("1g.10gb", [other.uuid])]  # only its own went
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
