"""Which driver each endpoint of a GPU's IOMMU group needs, as ordered sysfs steps (pure).

A GPU is usable by a VM only when *every* endpoint of its IOMMU group is on vfio-pci (QEMU: "group
N is not viable"), and unbinding the GPU does not unbind its audio/USB/UCSI functions, so the plan
always covers the whole group (vfio-manage and the DRA driver miss this: gpu-operator #1328, DRA
#1191). vfio-pci matches a device only through `driver_override`, and `drivers_probe` succeeds even
when nothing binds, so each rebind ends with a verification step. The plan is computed from an
observation; the binder re-reads the live state before each write, so a stale plan cannot unbind
something twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from msgspec import Struct, field

from gpud.layout.schema import WORKLOADS
from gpud.model import Gpu, Holder, PciFunction
from gpud.pci import is_bridge, is_vfio, pci_sort_key

VFIO = "vfio-pci"
VFIO_MODULE = "vfio-pci"  # modprobe name (module vfio_pci, driver directory vfio-pci)
NVIDIA_VENDOR = 0x10DE

AUTO = object()  # native_driver default: derive it from the function

# Step actions, in the order they can appear for one endpoint.
LOAD_MODULE = "load-module"  # module: load it unless /sys/bus/pci/drivers/<driver> exists
SET_OVERRIDE = "set-override"  # pci, driver: write driver_override
CLEAR_OVERRIDE = "clear-override"  # pci: write "\n" to driver_override
UNBIND = "unbind"  # pci, driver: the driver it was bound to when planned (re-read live)
PROBE = "probe"  # pci: write the address to bus/pci/drivers_probe
VERIFY_DRIVER = "verify-driver"  # pci, driver: bound to exactly that driver
VERIFY_NATIVE = "verify-native"  # pci: bound to some driver other than vfio-pci
VERIFY_RELEASED = "verify-released"  # pci: not on vfio-pci (a companion may stay unbound)
VERIFY_VFIO_NODE = "verify-vfio-node"  # group: /dev/vfio/<group> exists (udev may lag)
VERIFY_NO_VFIO_NODE = "verify-no-vfio-node"  # group: /dev/vfio/<group> is gone


class BindStep(Struct, frozen=True, omit_defaults=True):
    action: str
    pci: str | None = None
    driver: str | None = None
    module: str | None = None
    group: int | None = None

    def __str__(self) -> str:
        parts = [self.action]
        for v in (self.pci, self.driver, self.module):
            if v:
                parts.append(v)
        if self.group is not None:
            parts.append(f"group {self.group}")
        return " ".join(parts)


class BindDisruption(Struct, frozen=True):
    """What the rebind takes away, so `gpudctl plan` can say it before anything happens."""

    detached: dict[str, str] = field(default_factory=dict)  # pci -> driver it is taken from
    leaves_nvml: bool = False  # the GPU disappears from NVML, containers and monitoring
    mig_instances: int = 0  # MIG GPU instances that die with the nvidia binding
    holders: tuple[Holder, ...] = ()  # processes that must let go first (gpud waits, never kills)
    vfio_group: int | None = None  # a VM using /dev/vfio/<group> loses its device
    summary: str = ""


class BindingPlan(Struct, frozen=True):
    pci: str
    index: int
    workload: str
    target: str  # "vfio-pci" | "native"
    native_driver: str | None  # the GPU's expected native driver ("nvidia"), None = whatever probes
    group: int | None
    endpoints: tuple[str, ...]  # the GPU first, then its companions in address order
    steps: tuple[BindStep, ...] = ()
    disruption: BindDisruption = field(default_factory=BindDisruption)
    skipped: tuple[str, ...] = ()  # bridges in the group: left as they are
    infeasible: str | None = None

    @property
    def converged(self) -> bool:
        return not self.steps and self.infeasible is None


def vfio_driver(function: PciFunction) -> str:
    """The VFIO driver that takes this function: the variant driver modules.alias names for it
    (nvgrace_gpu_vfio_pci on a Grace GPU, docs/hardware/grace.md), else vfio-pci."""
    return function.vfio_variant or VFIO


def native_driver_for(function: PciFunction) -> str | None:
    """nvidia for an NVIDIA display controller; otherwise None: whatever the kernel probes."""
    if function.vendor == NVIDIA_VENDOR and function.class_code >> 16 == 0x03:
        return "nvidia"
    return None


def target_for(workload: str) -> str | None:
    """vfio-pci for passthrough; vGPU and containers both need the nvidia (native) driver."""
    if workload == "vm-passthrough":
        return VFIO
    if workload in ("container", "vm-vgpu"):
        return "native"
    return None


def _is_bridge(f: PciFunction) -> bool:
    return is_bridge(f.class_code)


def plan_binding(
    gpu: Gpu,
    workload: str,
    *,
    native_driver: str | None | object = AUTO,
    drivers: frozenset[str] | set[str] | None = None,
) -> BindingPlan:
    """Steps that move the GPU and every other endpoint of its group to the workload's driver.

    `native_driver`: what the GPU function must end up on for containers (default: nvidia for an
    NVIDIA display controller, else any non-vfio driver). `drivers`: the PCI drivers registered
    now (sysfs `bus/pci/drivers`); when unknown, a load-module step is emitted whenever a rebind
    to vfio-pci is needed and the binder skips it if the driver is already there.
    """
    fn = gpu.function
    native = native_driver_for(fn) if native_driver is AUTO else cast("str | None", native_driver)
    companions = sorted((c for c in gpu.companions if c.address != fn.address), key=lambda c: pci_sort_key(c.address))
    endpoints = [fn] + [c for c in companions if not _is_bridge(c)]
    skipped = tuple(c.address for c in companions if _is_bridge(c))
    target = target_for(workload)
    base: dict[str, Any] = {
        "pci": fn.address, "index": gpu.index, "workload": workload, "native_driver": native,
        "group": fn.iommu_group, "endpoints": tuple(e.address for e in endpoints), "skipped": skipped,
    }
    if target is None:
        return BindingPlan(target="native", infeasible=f"unknown workload {workload!r} (one of {', '.join(WORKLOADS)})", **base)
    if target == VFIO:
        if fn.iommu_group is None:
            return BindingPlan(
                target=VFIO,
                infeasible="no IOMMU group: vfio-pci cannot take the GPU (enable the IOMMU: intel_iommu=on or "
                "amd_iommu=on, and VT-d/AMD-Vi in the firmware)",
                **base,
            )
        if gpu.vgpu is not None and gpu.vgpu.vfs and not is_vfio(fn.driver):
            # vfio_pci_probe (drivers/vfio/pci/vfio_pci.c): "Cannot bind to PF with SR-IOV enabled",
            # EBUSY; a drivers_probe would only leave the GPU unbound
            return BindingPlan(
                target=VFIO,
                infeasible=f"the GPU has {len(gpu.vgpu.vfs)} SR-IOV VFs enabled and vfio-pci refuses a PF with "
                "SR-IOV enabled (EBUSY): disable them first (sriov-manage -d, or a vm-vgpu layout's removal)",
                **base,
            )
        steps = _to_vfio(endpoints, fn.iommu_group, drivers)
        return BindingPlan(target=VFIO, steps=steps, disruption=_disruption_vfio(gpu, steps), **base)
    steps = _to_native(fn, endpoints[1:], native)
    return BindingPlan(target="native", steps=steps, disruption=_disruption_native(gpu, steps), **base)


def _to_vfio(endpoints: list[PciFunction], group: int, drivers: frozenset[str] | set[str] | None) -> tuple[BindStep, ...]:
    """Each endpoint to its VFIO driver (`vfio_driver`: a variant driver binds, like vfio-pci, only
    through driver_override), its module loaded first where its driver is not registered."""
    steps: list[BindStep] = []
    probed: list[str] = []
    for f in endpoints:
        target = vfio_driver(f)
        if f.driver_override != target:
            steps.append(BindStep(SET_OVERRIDE, pci=f.address, driver=target))
        if f.driver != target:
            if f.driver is not None:
                steps.append(BindStep(UNBIND, pci=f.address, driver=f.driver))
            steps.append(BindStep(PROBE, pci=f.address))
            steps.append(BindStep(VERIFY_DRIVER, pci=f.address, driver=target))
            probed.append(target)
    if not steps:
        return ()
    if probed:
        for target in reversed(sorted(set(probed))):
            if drivers is None or target not in drivers:
                steps.insert(0, BindStep(LOAD_MODULE, module=VFIO_MODULE if target == VFIO else target, driver=target))
        steps.append(BindStep(VERIFY_VFIO_NODE, group=group))
    return tuple(steps)


def _to_native(fn: PciFunction, companions: list[PciFunction], native: str | None) -> tuple[BindStep, ...]:
    steps: list[BindStep] = []
    left_vfio = False
    # The GPU itself: must end bound to its native driver.
    gpu_ok_override = fn.driver_override is None or (native is not None and fn.driver_override == native)
    gpu_ok_driver = fn.driver is not None and not is_vfio(fn.driver) and (native is None or fn.driver == native)
    if not gpu_ok_override:
        steps.append(BindStep(CLEAR_OVERRIDE, pci=fn.address))
    if not gpu_ok_driver:
        if fn.driver is not None:
            steps.append(BindStep(UNBIND, pci=fn.address, driver=fn.driver))
            left_vfio |= is_vfio(fn.driver)
        steps.append(BindStep(PROBE, pci=fn.address))
        steps.append(
            BindStep(VERIFY_DRIVER, pci=fn.address, driver=native) if native else BindStep(VERIFY_NATIVE, pci=fn.address)
        )
    # Companions: undo what passthrough did and let the kernel probe; whichever driver it binds
    # is right, but none at all is not converged: a rebind cut short (gpud killed between the
    # unbind and the probe) leaves the HD-audio function on no driver, with no override to show it.
    for c in companions:
        if not is_vfio(c.driver_override) and not is_vfio(c.driver):
            if c.driver is None:
                steps.append(BindStep(PROBE, pci=c.address))
                steps.append(BindStep(VERIFY_NATIVE, pci=c.address))
            continue
        if c.driver_override is not None:
            steps.append(BindStep(CLEAR_OVERRIDE, pci=c.address))
        if c.driver is not None:
            steps.append(BindStep(UNBIND, pci=c.address, driver=c.driver))
            left_vfio |= is_vfio(c.driver)
        steps.append(BindStep(PROBE, pci=c.address))
        steps.append(BindStep(VERIFY_NATIVE, pci=c.address))
    if left_vfio and fn.iommu_group is not None:
        steps.append(BindStep(VERIFY_NO_VFIO_NODE, group=fn.iommu_group))
    return tuple(steps)


def _unbinds(steps: Sequence[BindStep]) -> dict[str, str]:
    return {s.pci: s.driver for s in steps if s.action == UNBIND and s.pci and s.driver}  # an unbind names both


def _disruption_vfio(gpu: Gpu, steps: Sequence[BindStep]) -> BindDisruption:
    detached = _unbinds(steps)
    if not detached:
        return BindDisruption(detached={}, summary="no driver is taken away" if steps else "")
    leaves_nvml = detached.get(gpu.pci) == "nvidia"
    mig = len(gpu.nvml.instances) if (leaves_nvml and gpu.nvml is not None) else 0
    parts = []
    for pci, drv in detached.items():
        what = f"{pci} leaves {drv}"
        if pci == gpu.pci and leaves_nvml:
            what += f" (GPU {gpu.index} disappears from NVML and containers"
            what += f"; {mig} MIG instance(s) destroyed)" if mig else ")"
        parts.append(what)
    if gpu.holders:
        parts.append("held by " + ", ".join(f"{h.pid} ({h.name})" for h in gpu.holders))
    return BindDisruption(
        detached=detached, leaves_nvml=leaves_nvml, mig_instances=mig, holders=gpu.holders,
        summary="; ".join(parts),
    )


def _disruption_native(gpu: Gpu, steps: Sequence[BindStep]) -> BindDisruption:
    detached = _unbinds(steps)
    if not detached:
        return BindDisruption(detached={}, summary="no driver is taken away" if steps else "")
    group = gpu.function.iommu_group if any(is_vfio(d) for d in detached.values()) else None
    parts = [f"{pci} leaves {drv}" for pci, drv in detached.items()]
    if group is not None:
        parts.append(f"a VM using /dev/vfio/{group} loses the device")
    if gpu.holders:
        parts.append("held by " + ", ".join(f"{h.pid} ({h.name})" for h in gpu.holders))
    return BindDisruption(detached=detached, holders=gpu.holders, vfio_group=group, summary="; ".join(parts))
