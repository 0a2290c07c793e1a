"""The vGPU planner, alone (hand-made observed states) and applied to the simulator through the
host adapter and the executor, with results read back from the simulator's state file (not through
gpud's adapter): survivors keep their UUIDs and VFs, only the difference is written, busy vGPUs are
never removed, impossible layouts change nothing, and a reboot rebuilds the same identities."""

from __future__ import annotations

import pytest

from gpud.engine.vgpu.executor import execute
from gpud.model import Holder, VgpuDevice, VgpuOffer, VgpuState
from gpud.plan.vgpu import VgpuPlan, VgpuRecord, VgpuStep, check_instances, check_rules, derived_uuid, plan_vgpu
from gpud.sim import vgpu as sim_vgpu
from gpud.sim.cli import create, hold, release
from gpud.sim.state import SimGi, load, locked
from gpud.sim.sysfs_tree import render
from gpud.vgpu_types import by_device
from tests.sim.vfs import set_vfs
from tests.support.present import present
from tests.support.vgpu_host import Host, want

L40S, A100, H200, T4 = "0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"
L40S_MODEL, T4_MODEL = by_device(0x26B9), by_device(0x1EB8)


# ---- rules, before any change

@pytest.mark.parametrize(("types", "reason"), [
    ({"L40S-12Q": 4, "L40S-24Q": 1}, "time-sliced vGPUs on one GPU must all be one type; asked L40S-12Q, L40S-24Q"),
    ({"L40S-12Q": 5}, "5 x L40S-12Q on NVIDIA L40S 0000:18:00.0: the type fits at most 4 on one GPU"),
    ({"L40S-1Q": 33}, "the type fits at most 32"),
    ({"H200X-4C": 1}, "H200X-4C is not a vGPU type of NVIDIA L40S 0000:18:00.0; valid: L40S-1B, L40S-1Q"),
    ({"L40S-12Q": 1, "H200X-1-18C": 1}, "one GPU runs one kind"),
    ({"BOGUS-TYPE": 1}, "BOGUS-TYPE is not a vGPU type of NVIDIA L40S 0000:18:00.0; valid: L40S-1B"),
])
def test_impossible_layouts_are_infeasible(types, reason) -> None:
    state = VgpuState(interface="vfio", total_vfs=32, vfs=tuple(f"0000:18:00.{i}" for i in range(4, 8)))
    plan = plan_vgpu(pci=L40S, index=0, gpu_key=L40S, where=f"NVIDIA L40S {L40S}", state=state,
                     desired=want(L40S, types), model=L40S_MODEL)
    assert plan.infeasible is not None and reason in plan.infeasible
    assert plan.steps == []


def test_mig_backed_needs_instances() -> None:
    h200 = by_device(0x2335)
    state = VgpuState(interface="vfio", total_vfs=32, vfs=("0000:3a:00.4",))
    two = {1: "1g.18gb", 2: "1g.18gb"}
    reason = check_instances({"H200X-1-18C": 3}, h200, [], two, "H200")
    assert reason == "3 MIG-backed vGPUs need 3 GPU instances 1g.18gb on H200; the MIG layout has 2"
    assert check_instances({"H200X-1-18C": 2}, h200, [], two, "H200") is None
    assert "one GPU runs one kind" in present(check_rules({"H200X-1-18C": 1, "H200X-4C": 1}, h200, state, "H200"))


def test_the_drivers_offer_is_the_truth() -> None:
    """A GPU gpud has no table for: the driver's offered names decide (here the kernel mtty sample's)."""
    state = VgpuState(interface="mdev", offers=(VgpuOffer("Single port serial", 1, 24), VgpuOffer("Dual port serial", 2, 12)))
    assert check_rules({"Quad port serial": 1}, None, state, "mtty") == (
        "Quad port serial is not offered by mtty; it offers Single port serial, Dual port serial")
    assert check_rules({"Dual port serial": 2}, None, state, "mtty") is None


def test_one_vgpu_per_vf() -> None:
    state = VgpuState(interface="vfio", total_vfs=2, vfs=("a", "b"))
    assert check_rules({"L40S-1Q": 3}, L40S_MODEL, state, "L40S") == "3 vGPUs on L40S: one vGPU per VF and the GPU has 2 VFs"


def test_busy_vgpus_block_instead_of_going() -> None:
    vm = Holder(pid=9, name="qemu-system-x86", device="u1", vm="web-1")
    devs = (VgpuDevice("T4-2Q", T4, uuid="u1", holders=(vm,)), VgpuDevice("T4-2Q", T4, uuid="u2"))
    state = VgpuState(interface="mdev", devices=devs)
    shrink = plan_vgpu(pci=T4, index=3, gpu_key=T4, where="T4", state=state, desired=want(T4, {"T4-2Q": 1}),
                       model=T4_MODEL)
    assert [d.uuid for d in shrink.kept] == ["u1"] and [s.uuid for s in shrink.removals] == ["u2"]  # the idle one goes
    change = plan_vgpu(pci=T4, index=3, gpu_key=T4, where="T4", state=state, desired=want(T4, {"T4-4Q": 2}),
                       model=T4_MODEL)
    assert change.blocked_by == [vm] and change.steps == []


def test_new_mdevs_reuse_recorded_uuids_then_derive() -> None:
    record = VgpuRecord(uuids={"T4-4Q": ["11111111-2222-3333-4444-555555555555"]})
    plan = plan_vgpu(pci=T4, index=3, gpu_key="GPU-x", where="T4", state=VgpuState(interface="mdev"),
                     desired=want(T4, {"T4-4Q": 2}), model=T4_MODEL, record=record)
    assert [s.uuid for s in plan.creations] == ["11111111-2222-3333-4444-555555555555", derived_uuid("GPU-x", "T4-4Q", 0)]


# ---- applied to the simulator

@pytest.fixture
def vfio(tmp_path):
    create(tmp_path / "h", ["l40s", "a100-pcie-40gb", "h200", "t4"], vgpu="vfio")
    return tmp_path / "h"


@pytest.fixture
def mdev(tmp_path):
    create(tmp_path / "h", ["l40s", "a100-pcie-40gb", "h200", "t4"], vgpu="mdev")
    return tmp_path / "h"


def test_vfio_seed_then_count_change_keeps_survivors(vfio) -> None:
    host = Host(vfio, L40S)
    host.apply({"L40S-12Q": 4})
    first = host.devices()
    assert [t for t, _ in first] == ["L40S-12Q"] * 4
    assert len(load(vfio).vgpu[L40S].vfs) == 32  # all VFs enabled, as sriov-manage -e does
    host.writes = 0
    assert present(host.apply({"L40S-12Q": 4})).steps == [] and host.writes == 0  # re-apply: nothing written
    host.apply({"L40S-12Q": 2})
    after = host.devices()
    assert set(after) < set(first) and len(after) == 2 and host.writes == 2
    host.apply({"L40S-12Q": 3})
    assert set(after) < set(host.devices())


def test_vfio_type_change_and_busy_vf(vfio) -> None:
    host = Host(vfio, L40S)
    host.apply({"L40S-12Q": 2})
    vf = host.devices()[0][1]
    hold(vfio, vf, 4242, vm="web-1")
    plan = host.apply({"L40S-24Q": 2})
    assert present(plan).blocked_by == [Holder(pid=4242, name="qemu-system-x86", device=vf, vm="web-1")]
    assert [t for t, _ in host.devices()] == ["L40S-12Q"] * 2  # nothing changed
    release(vfio, vf, 4242)
    host.apply({"L40S-24Q": 2})
    assert [t for t, _ in host.devices()] == ["L40S-24Q"] * 2


def test_mdev_t4_keeps_uuids_and_rebuilds_them_after_reboot(vfio) -> None:
    host = Host(vfio, T4)
    host.apply({"GRID T4-4Q": 3})
    uuids = [u for _, u in host.devices()]
    host.apply({"T4-4Q": 4})
    assert set(uuids) < {u for _, u in host.devices()}
    before = host.devices()
    with locked(vfio) as st:  # a reboot: every mdev gone
        sim_vgpu.clear_for_reboot(st)
        render(vfio, st)
    assert host.devices() == []
    restarted = Host(vfio, T4)  # a new daemon: the record comes back from its state directory
    restarted.record = host.record
    restarted.apply({"T4-4Q": 4})
    assert restarted.devices() == before


def test_derived_uuids_are_stable_without_a_record(vfio) -> None:
    a = Host(vfio, T4)
    a.apply({"T4-8Q": 2})
    before = a.devices()
    with locked(vfio) as st:
        sim_vgpu.clear_for_reboot(st)
        render(vfio, st)
    b = Host(vfio, T4)  # state directory lost too
    b.apply({"T4-8Q": 2})
    assert b.devices() == before


def test_mdev_on_vfs_and_leaving_vgpu_disables_vfs(mdev) -> None:
    host = Host(mdev, A100)
    host.apply({"A100-10C": 4})
    devs = host.devices()
    st = load(mdev)
    assert len(devs) == 4 and all(m.parent != A100 for m in st.vgpu[A100].mdevs)  # parents are VFs
    assert len({m.parent for m in st.vgpu[A100].mdevs}) == 4
    host.apply({}, workload="container")
    st = load(mdev)
    assert st.vgpu[A100].mdevs == [] and st.vgpu[A100].vfs == []


def test_mig_backed_vgpus_sit_on_instances(vfio) -> None:
    host = Host(vfio, H200)
    with locked(vfio) as st:  # MIG mode first; the VFs next (their rebind destroys instances)
        st.gpus[H200].mig_mode = st.gpus[H200].mig_pending = 1
        render(vfio, st)
    set_vfs(vfio, H200, 16)
    with locked(vfio) as st:  # the MIG layout gpud's MIG planner makes for H200X-1-18C: 3 + H200X-3-71C: 1
        gpu = st.gpus[H200]
        gpu.gis = [SimGi(id=i + 1, profile_id=19, start=i, size=1) for i in range(3)] + \
            [SimGi(id=4, profile_id=9, start=4, size=4)]
        render(vfio, st)
    host.apply({"H200X-1-18C": 3, "H200X-3-71C": 1}, mig=True)
    st = load(vfio)
    on = sorted((vf.vgpu_type, vf.gpu_instance_id) for vf in st.vgpu[H200].vfs if vf.vgpu_type)
    assert [gi for _, gi in on] == [1, 2, 3, 4] and on[0][0] == 1414
    plan = host.apply({"H200X-1-18C": 4}, mig=True)
    assert present(plan).infeasible == (f"4 MIG-backed vGPUs need 4 GPU instances 1g.18gb on {H200}; the MIG layout has 3")


@pytest.mark.parametrize("bad", [VgpuStep("create-mdev", T4, type="T4-4Q", parent=T4),  # no uuid
                                 VgpuStep("set-vf-type", L40S, type="L40S-12Q"),  # no VF
                                 VgpuStep("remove", T4)])  # no uuid
def test_a_step_without_the_field_its_action_needs_fails_before_any_write(mdev, bad) -> None:
    host = Host(mdev, bad.pci)
    before = load(mdev).vgpu
    out = execute(host.vgpu, VgpuPlan(pci=bad.pci, index=0, creations=[bad]), host.record)
    assert out.state == "failed" and "the step has no" in out.message, out
    assert load(mdev).vgpu == before and host.record == VgpuRecord()
