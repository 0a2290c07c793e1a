"""The vGPU planner on an RTX PRO 6000 Blackwell, where one `+gfx` GPU instance holds several
MIG-backed vGPUs of one type: alone, and applied to the simulator through the host adapter and the
executor with results read back from the simulator's state file.

The capacities are NVIDIA's (vgpu-device-manager v0.5.0 examples/config-example.yaml: DC-1-3Q 32
and DC-1-24Q 4 per GPU, over the 4 instances of 1g.24gb+gfx in the model's MIG capture: 8 and 1 to
an instance), not read from gpud's table.
"""

from __future__ import annotations

from collections import Counter

import pytest

from gpud.model import VgpuDevice, VgpuState
from gpud.plan.vgpu import check_instances, check_rules
from gpud.sim import vgpu as sim_vgpu
from gpud.sim.cli import create
from gpud.sim.state import SimGi, load, locked
from gpud.sim.sysfs_tree import render
from gpud.vgpu_types import by_device
from tests.sim.vfs import set_vfs
from tests.support.present import present
from tests.support.vgpu_host import Host

RTX = "0000:18:00.0"
MODEL = by_device(0x2BB5)
WHERE = f"NVIDIA RTX PRO 6000 Blackwell Server Edition {RTX}"


def test_the_per_gpu_maximum_holds_for_mig_backed_types() -> None:
    state = VgpuState(interface="vfio", total_vfs=48, vfs=tuple(f"0000:18:0{i // 8}.{i % 8}" for i in range(48)))
    assert check_rules({"DC-1-3Q": 32}, MODEL, state, WHERE) is None
    assert check_rules({"DC-1-3Q": 33}, MODEL, state, WHERE) == (
        f"33 x DC-1-3Q on {WHERE}: the type fits at most 32 on one GPU")
    assert check_rules({"DC-1-2Q": 48}, MODEL, state, WHERE) is None  # 48 VFs, one vGPU each


def test_instances_hold_several_vgpus_of_one_type() -> None:
    two = {1: "1g.24gb+gfx", 2: "1g.24gb+gfx", 3: "1g.24gb"}  # the plain 1g.24gb never counts
    assert check_instances({"DC-1-3Q": 16}, MODEL, [], two, WHERE) is None
    assert check_instances({"DC-1-3Q": 17}, MODEL, [], two, WHERE) == (
        f"17 MIG-backed vGPUs need 3 GPU instances 1g.24gb+gfx on {WHERE} (vGPUs to an instance: DC-1-3Q: 8); "
        "the MIG layout has 2")
    assert check_instances({"DC-1-3Q": 8, "DC-1-24Q": 1}, MODEL, [], two, WHERE) is None
    # kept vGPUs keep their instance: one DC-1-24Q on instance 1 leaves one instance for DC-1-3Q
    kept = [VgpuDevice(type="DC-1-24Q", parent="vf0", vf="vf0", gi=1)]
    assert check_instances({"DC-1-24Q": 1, "DC-1-3Q": 8}, MODEL, kept, two, WHERE) is None
    assert "need 3 GPU instances" in present(check_instances({"DC-1-24Q": 1, "DC-1-3Q": 9}, MODEL, kept, two, WHERE))
    # a kept DC-1-3Q instance has room for seven more before a second one is needed
    kept = [VgpuDevice(type="DC-1-3Q", parent="vf0", vf="vf0", gi=2)]
    assert check_instances({"DC-1-3Q": 8, "DC-1-24Q": 1}, MODEL, kept, two, WHERE) is None


@pytest.fixture
def rtx(tmp_path):
    """An RTX PRO 6000 with the three 1g.24gb+gfx instances gpud's MIG planner makes for
    DC-1-3Q: 9 + DC-1-24Q: 1 (tests/layout/test_vgpu_blackwell.py), at the captured placements."""
    d = tmp_path / "h"
    create(d, ["rtx-pro-6000"], vgpu="vfio")
    with locked(d) as st:  # MIG mode, then the VFs (their rebind destroys instances), then instances
        st.gpus[RTX].mig_mode = st.gpus[RTX].mig_pending = 1
        render(d, st)
    set_vfs(d, RTX, 48)
    with locked(d) as st:
        st.gpus[RTX].gis = [SimGi(id=i + 1, profile_id=47, start=3 * i, size=3) for i in range(3)]
        render(d, st)
    return d


def occupancy(d) -> dict[int, Counter]:
    """GI id -> vGPU types on it, from the simulator's state file."""
    st = load(d)
    names = {t.vfio_id: t.name for t in sim_vgpu.sim_types(present(sim_vgpu.vgpu_model(st, RTX)))}
    out: dict[int, Counter] = {}
    for vf in st.vgpu[RTX].vfs:
        if vf.vgpu_type:
            out.setdefault(vf.gpu_instance_id, Counter())[names[vf.vgpu_type]] += 1
    return out


def test_several_vgpus_per_instance_on_the_simulator(rtx) -> None:
    host = Host(rtx, RTX)
    plan = host.apply({"DC-1-3Q": 9, "DC-1-24Q": 1}, mig=True)
    assert present(plan).infeasible is None and not present(plan).blocked_by
    assert sorted(occupancy(rtx).values(), key=lambda c: sorted(c.items())) == [
        Counter({"DC-1-24Q": 1}), Counter({"DC-1-3Q": 1}), Counter({"DC-1-3Q": 8})]
    before = occupancy(rtx)
    host.apply({"DC-1-3Q": 10, "DC-1-24Q": 1}, mig=True)  # the tenth fits beside the ninth
    after = occupancy(rtx)
    assert sorted(sum(c.values()) for c in after.values()) == [1, 2, 8]
    assert set(after) == set(before)
    plan = host.apply({"DC-1-3Q": 17, "DC-1-24Q": 1}, mig=True)
    assert present(plan).infeasible == (f"18 MIG-backed vGPUs need 4 GPU instances 1g.24gb+gfx on {RTX} (vGPUs to an "
                               "instance: DC-1-3Q: 8); the MIG layout has 3")
    assert occupancy(rtx) == after  # nothing changed
