"""The binding plan: whole IOMMU group, idempotent, verified, disruption said up front."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpud.model import (
    ComputeInstance,
    Gpu,
    GpuInstance,
    Holder,
    NvmlGpu,
    PciFunction,
    Placement,
)
from gpud.plan.binding import (
    CLEAR_OVERRIDE,
    LOAD_MODULE,
    PROBE,
    SET_OVERRIDE,
    UNBIND,
    VERIFY_DRIVER,
    VERIFY_NATIVE,
    VERIFY_NO_VFIO_NODE,
    VERIFY_VFIO_NODE,
    plan_binding,
)
from tests.support.present import present

GPU = "0000:3b:00.0"


def fn(addr, *, vendor=0x10DE, device=0x2335, cls=0x030200, driver=None, override=None, group=7):
    return PciFunction(addr, vendor, device, 0x10DE, 0x18BF, cls, driver=driver, driver_override=override,
                       iommu_group=group)


def h200(driver="nvidia", override=None, audio_driver="snd_hda_intel", audio_override=None, *, group=7,
         holders=(), nvml=None, extra=()):
    return Gpu(
        index=0,
        function=fn(GPU, driver=driver, override=override, group=group),
        companions=(fn("0000:3b:00.1", device=0x22A3, cls=0x040300, driver=audio_driver, override=audio_override,
                       group=group),) + tuple(extra),
        holders=tuple(holders),
        nvml=nvml,
    )


def actions(plan):
    return [(s.action, s.pci or s.module or s.group) for s in plan.steps]


def test_container_to_vfio_covers_the_whole_group_in_order():
    plan = plan_binding(h200(), "vm-passthrough", drivers={"nvidia", "snd_hda_intel"})
    assert plan.target == "vfio-pci" and plan.group == 7
    assert plan.endpoints == (GPU, "0000:3b:00.1")
    assert actions(plan) == [
        (LOAD_MODULE, "vfio-pci"),
        (SET_OVERRIDE, GPU), (UNBIND, GPU), (PROBE, GPU), (VERIFY_DRIVER, GPU),
        (SET_OVERRIDE, "0000:3b:00.1"), (UNBIND, "0000:3b:00.1"), (PROBE, "0000:3b:00.1"),
        (VERIFY_DRIVER, "0000:3b:00.1"),
        (VERIFY_VFIO_NODE, 7),
    ]
    unbinds = {s.pci: s.driver for s in plan.steps if s.action == UNBIND}
    assert unbinds == {GPU: "nvidia", "0000:3b:00.1": "snd_hda_intel"}
    assert all(s.driver == "vfio-pci" for s in plan.steps if s.action in (SET_OVERRIDE, VERIFY_DRIVER))


def test_module_load_only_when_vfio_driver_missing():
    plan = plan_binding(h200(), "vm-passthrough", drivers={"nvidia", "vfio-pci"})
    assert LOAD_MODULE not in [s.action for s in plan.steps]


def test_already_on_vfio_is_no_steps_and_idempotent():
    gpu = h200("vfio-pci", "vfio-pci", "vfio-pci", "vfio-pci")
    plan = plan_binding(gpu, "vm-passthrough")
    assert plan.steps == () and plan.converged and plan.infeasible is None
    assert plan.disruption.summary == ""


def test_bound_to_vfio_without_override_only_sets_the_override():
    """Bound through ids= elsewhere: no unbind, but the override makes it stick on a re-probe."""
    plan = plan_binding(h200("vfio-pci", None, "vfio-pci", "vfio-pci"), "vm-passthrough")
    assert actions(plan) == [(SET_OVERRIDE, GPU)]
    assert plan.disruption.detached == {}


def test_unbound_companion_gets_probed_without_unbind():
    plan = plan_binding(h200("vfio-pci", "vfio-pci", None, None), "vm-passthrough", drivers={"vfio-pci"})
    assert actions(plan) == [(SET_OVERRIDE, "0000:3b:00.1"), (PROBE, "0000:3b:00.1"),
                             (VERIFY_DRIVER, "0000:3b:00.1"), (VERIFY_VFIO_NODE, 7)]


def test_no_iommu_group_is_infeasible_with_a_reason():
    plan = plan_binding(h200(group=None), "vm-passthrough")
    assert plan.steps == () and not plan.converged
    assert "IOMMU" in present(plan.infeasible) and "intel_iommu=on" in present(plan.infeasible)


def test_bridges_in_the_group_are_left_alone():
    bridge = fn("0000:3a:00.0", vendor=0x8086, device=0x2030, cls=0x060400, driver="pcieport")
    plan = plan_binding(h200(extra=(bridge,)), "vm-passthrough")
    assert plan.skipped == ("0000:3a:00.0",)
    assert "0000:3a:00.0" not in {s.pci for s in plan.steps}


def test_vfio_back_to_container_verifies_nvidia_and_node_gone():
    plan = plan_binding(h200("vfio-pci", "vfio-pci", "vfio-pci", "vfio-pci"), "container")
    assert plan.target == "native" and plan.native_driver == "nvidia"
    assert actions(plan) == [
        (CLEAR_OVERRIDE, GPU), (UNBIND, GPU), (PROBE, GPU), (VERIFY_DRIVER, GPU),
        (CLEAR_OVERRIDE, "0000:3b:00.1"), (UNBIND, "0000:3b:00.1"), (PROBE, "0000:3b:00.1"),
        (VERIFY_NATIVE, "0000:3b:00.1"),
        (VERIFY_NO_VFIO_NODE, 7),
    ]
    assert next(s for s in plan.steps if s.action == VERIFY_DRIVER).driver == "nvidia"
    assert plan.disruption.vfio_group == 7 and "/dev/vfio/7" in plan.disruption.summary


def test_a_companion_left_on_no_driver_is_probed_and_must_end_on_one():
    """A rebind cut short (gpud killed between the companion's unbind and its probe) leaves the
    HD-audio function on no driver with no override: for containers that is not converged."""
    plan = plan_binding(h200("nvidia", None, None, None), "container")
    assert actions(plan) == [(PROBE, "0000:3b:00.1"), (VERIFY_NATIVE, "0000:3b:00.1")]
    assert not plan.converged


def test_vgpu_needs_the_native_driver_too():
    assert plan_binding(h200(), "vm-vgpu").steps == ()
    assert plan_binding(h200("vfio-pci", "vfio-pci"), "vm-vgpu").target == "native"


def test_container_in_place_is_no_steps():
    assert plan_binding(h200(), "container").steps == ()
    # an override naming the native driver is harmless
    assert plan_binding(h200(override="nvidia"), "container").steps == ()


def test_stale_override_alone_is_cleared_without_unbind():
    plan = plan_binding(h200(override="vfio-pci"), "container")
    assert actions(plan) == [(CLEAR_OVERRIDE, GPU)]


def test_companion_on_other_driver_is_not_touched_for_containers():
    """Only what passthrough did is undone: a companion someone bound elsewhere stays."""
    plan = plan_binding(h200(audio_driver="snd_hda_intel", audio_override="pci-stub"), "container")
    assert plan.steps == ()


def test_unbound_gpu_gets_probed():
    plan = plan_binding(h200(driver=None), "container")
    assert actions(plan) == [(PROBE, GPU), (VERIFY_DRIVER, GPU)]


def test_gpu_on_wrong_native_driver_is_rebound():
    plan = plan_binding(h200(driver="nouveau"), "container")
    assert actions(plan)[:2] == [(UNBIND, GPU), (PROBE, GPU)]


def test_non_nvidia_function_accepts_whatever_the_kernel_probes():
    """The VM test manages e1000 NICs: no expected driver name, just 'not vfio-pci, bound'."""
    nic = Gpu(index=0, function=fn("0000:00:11.0", vendor=0x8086, device=0x100E, cls=0x020000,
                                   driver="vfio-pci", override="vfio-pci", group=10))
    plan = plan_binding(nic, "container")
    assert plan.native_driver is None
    assert [s.action for s in plan.steps] == [CLEAR_OVERRIDE, UNBIND, PROBE, VERIFY_NATIVE, VERIFY_NO_VFIO_NODE]


def test_unknown_workload_is_infeasible():
    assert "unknown workload" in present(plan_binding(h200(), "vm-gpu").infeasible)


def test_disruption_names_mig_instances_and_holders():
    ci = ComputeInstance(id=0, profile_id=0, slices=1, uuid="MIG-x")
    nvml = NvmlGpu(pci=GPU, uuid="GPU-x", name="NVIDIA H200",
                   instances=(GpuInstance(id=1, profile_id=19, placement=Placement(0, 1), cis=(ci,)),
                              GpuInstance(id=2, profile_id=19, placement=Placement(1, 1))))
    holder = Holder(pid=4242, name="python3", device="/dev/nvidia0")
    plan = plan_binding(h200(nvml=nvml, holders=[holder]), "vm-passthrough")
    d = plan.disruption
    assert d.leaves_nvml and d.mig_instances == 2 and d.holders == (holder,)
    assert d.detached == {GPU: "nvidia", "0000:3b:00.1": "snd_hda_intel"}
    assert "2 MIG instance(s) destroyed" in d.summary and "4242 (python3)" in d.summary


DRIVERS = st.sampled_from([None, "nvidia", "vfio-pci", "snd_hda_intel", "nouveau"])
OVERRIDES = st.sampled_from([None, "vfio-pci", "nvidia", "pci-stub"])


def _apply(gpu: Gpu, plan) -> Gpu:
    """A tiny model of the kernel: what the steps leave behind when every probe succeeds."""
    state = {f.address: [f.driver, f.driver_override] for f in (gpu.function, *gpu.companions)}
    natives = {gpu.pci: plan.native_driver or "e1000", **{c.address: "snd_hda_intel" for c in gpu.companions}}
    for s in plan.steps:
        if s.action == SET_OVERRIDE:
            state[s.pci][1] = s.driver
        elif s.action == CLEAR_OVERRIDE:
            state[s.pci][1] = None
        elif s.action == UNBIND:
            state[s.pci][0] = None
        elif s.action == PROBE and state[s.pci][0] is None:
            state[s.pci][0] = state[s.pci][1] or natives[s.pci]

    def upd(f):
        d, o = state[f.address]
        return PciFunction(f.address, f.vendor, f.device, f.subsystem_vendor, f.subsystem_device, f.class_code,
                           driver=d, driver_override=o, iommu_group=f.iommu_group)

    return Gpu(index=gpu.index, function=upd(gpu.function), companions=tuple(upd(c) for c in gpu.companions))


@settings(derandomize=True, deadline=None)
@given(DRIVERS, OVERRIDES, DRIVERS, OVERRIDES, st.sampled_from(["container", "vm-passthrough"]))
def test_plan_reaches_a_fixed_point(gd, go, ad, ao, workload):
    """Whatever the start, one plan executed against a cooperative kernel needs no second one."""
    gpu = h200(gd, go, ad, ao)
    plan = plan_binding(gpu, workload)
    after = _apply(gpu, plan)
    again = plan_binding(after, workload)
    if workload == "vm-passthrough":
        assert all(f.driver == "vfio-pci" for f in (after.function, *after.companions))
        assert again.steps == ()
    else:
        assert after.function.driver == "nvidia"
        assert all(c.driver != "vfio-pci" for c in after.companions)
        # a companion someone else pinned to pci-stub (and unbound) may legitimately be left alone
        assert [s for s in again.steps if s.pci == GPU] == []


def test_a_pf_with_vfs_enabled_is_refused_for_vfio_with_the_kernels_reason():
    """vfio_pci_probe: "Cannot bind to PF with SR-IOV enabled" (EBUSY)."""
    import msgspec

    from gpud.model import VgpuState

    gpu = msgspec.structs.replace(h200(), vgpu=VgpuState(interface="vfio", total_vfs=16,
                                                          vfs=("0000:18:00.4", "0000:18:00.5")))
    plan = plan_binding(gpu, "vm-passthrough")
    assert plan.steps == () and "2 SR-IOV VFs enabled" in present(plan.infeasible) and "EBUSY" in present(plan.infeasible)
    assert plan_binding(h200(), "vm-passthrough").infeasible is None
