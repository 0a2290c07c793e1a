"""Issue 33 item 12: a GPU lost late in a vGPU apply (after its first vGPU was made) could not be
tested, the simulator's unplug failing for a card whose VF carries a vGPU type. Now: the card is
pulled right after the first vGPU type is written; the apply stops on that GPU with `failed` and
a reason, raises nothing, and what the simulator holds (its state file) is the card gone, not a
half-made set claimed as done."""

from __future__ import annotations

import pytest

from gpud.engine.vgpu.executor import execute
from gpud.host.nvidia.sriov_manage import SriovManage
from gpud.layout.desired import DesiredGpu
from gpud.plan.vgpu import plan_vgpu
from gpud.sim import kernel
from gpud.sim.state import load
from gpud.vgpu_types import by_device
from tests.scenarios.vgpu_definitions import SCENARIOS
from tests.scenarios.vgpu_harness import VgpuRig


def test_a_gpu_pulled_after_its_first_vgpu_fails_that_gpu_and_says_so(tmp_path):
    sc = next(s for s in SCENARIOS if s.name == "l40s-vfio-seed-4x12Q")
    rig = VgpuRig(tmp_path, sc)
    pulled: list[str] = []
    store = rig.store.store

    def pull_after_first_type(path, data):
        n = store(path, data)
        if path.endswith("/nvidia/current_vgpu_type") and not pulled:
            kernel.unplug(rig.dir, rig.pf)
            pulled.append(path)
        return n

    rig.store.store = pull_after_first_type
    st = load(rig.dir)
    desired = DesiredGpu(pci=rig.pf, index=sc.gpu, entry="layouts.x[0]", workload="vm-vgpu",
                         vgpu_devices={"L40S-12Q": 4})
    plan = plan_vgpu(pci=rig.pf, index=sc.gpu, gpu_key=st.gpus[rig.pf].uuid, where=rig.pf,
                     state=rig.vgpu.read(rig.pf), desired=desired, model=by_device(st.functions[rig.pf].device),
                     record=rig.record)
    out = None
    for _ in range(4):  # the engine's rounds: plan, run, re-read
        out = execute(rig.vgpu, plan, rig.record, vf_tool=SriovManage(str(rig.dir / "bin" / "sriov-manage")))
        if out.state != "done" or pulled:
            break
        plan = plan_vgpu(pci=rig.pf, index=sc.gpu, gpu_key=st.gpus[rig.pf].uuid, where=rig.pf,
                         state=rig.vgpu.read(rig.pf), desired=desired,
                         model=by_device(st.functions[rig.pf].device), record=rig.record)
    assert pulled, "the card was never pulled: the apply made no vGPU"
    assert out is not None and out.state == "failed" and out.message, out
    sim = load(rig.dir)
    assert not sim.functions[rig.pf].present
    assert not any(sim.functions[vf.address].present for vf in sim.vgpu[rig.pf].vfs)
    if out.state == "done":
        pytest.fail("a half-made set on a gone GPU reported as done")
