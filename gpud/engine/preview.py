"""What a pass would do now, without doing it (`gpudctl plan`): per GPU its next action as the
pass itself plans it (`Reconciler.next_action`), and what that action brings along.

A plan shows one action per GPU, but a user deciding whether to apply needs the disruption of
the whole way there: the GPUs a reset takes along (gpud.plan.reset_scope), the driver change that
follows a MIG or vGPU action on the way to vm-passthrough, and who loses the GPU in a rebind.
The pass order (vGPUs, then the workload's driver, then MIG) is the engine's: the socket API only
translates these records, it never plans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import msgspec

from gpud.engine.gpu_state import Action, BindAction, GpuState, MigAction, VgpuAction
from gpud.engine.observe.discovery import Observation
from gpud.engine.observe.holders import rebind_holders
from gpud.layout.desired import DesiredGpu
from gpud.layout.resolve import Resolution
from gpud.model import Gpu, Holder
from gpud.plan.binding import BindingPlan, plan_binding
from gpud.plan.reset_scope import FABRIC_MANAGER, nvswitches, reset_takes_along
from gpud.profiles import by_device

if TYPE_CHECKING:
    from gpud.engine.reconciler import Reconciler

Then = Literal["bind", "vgpu", "workload", "mig"]


class Rebind(msgspec.Struct, frozen=True):
    """A driver change on the way: its plan (with the disruption it computes) and who loses the GPU."""

    plan: BindingPlan
    holders: tuple[Holder, ...]


class GpuPreview(msgspec.Struct, frozen=True):
    gpu: Gpu
    desired: DesiredGpu
    action: Action | GpuState | None  # GpuState: it cannot go on (the message says why)
    reset_with: tuple[str, ...] = ()  # the GPUs (this one included) a reset of this one takes along
    rebind: Rebind | None = None  # the driver change this action is, or the one that follows it
    then: Then | None = None  # what follows once this action is done


def preview(rec: Reconciler, resolution: Resolution, observation: Observation) -> list[GpuPreview]:
    """The GPUs of `observation` that `resolution` has an entry for, in order."""
    drivers = frozenset(rec.hw.sysfs.drivers())
    out = []
    for gpu in observation.gpus:
        desired = resolution.desired.get(gpu.pci)
        if desired is not None:
            out.append(_one(rec, gpu, desired, rec.next_action(gpu, desired), observation, drivers))
    return out


def _one(rec: Reconciler, gpu: Gpu, desired: DesiredGpu, action: Action | GpuState | None,
         observation: Observation, drivers: frozenset[str]) -> GpuPreview:
    def rebind(plan: BindingPlan) -> Rebind:  # holders are read only where the GPU leaves a driver
        found = rebind_holders(rec.hw.sysfs, rec.hw.procs, gpu) if plan.disruption.detached else ()
        return Rebind(plan, found)

    if isinstance(action, MigAction):
        along: tuple[str, ...] = ()
        if action.plan.reset:
            info = by_device(gpu.function.device)
            fm = bool(rec.hw.procs.running((FABRIC_MANAGER,))) if nvswitches(observation.functions) else None
            along = tuple(reset_takes_along(gpu.pci, observation.functions, arch=info.arch if info else None,
                                            fabric_manager=fm))
        if desired.workload == "vm-passthrough":
            return GpuPreview(gpu, desired, action, along, rebind(plan_binding(gpu, desired.workload, drivers=drivers)),
                              "bind")
        then: Then | None = "vgpu" if desired.workload == "vm-vgpu" and desired.vgpu_devices else None
        return GpuPreview(gpu, desired, action, along, then=then)
    if isinstance(action, VgpuAction):
        then = "workload" if desired.workload != "vm-vgpu" else None
        if desired.workload != "vm-passthrough":
            return GpuPreview(gpu, desired, action, then=then)
        # the rebind comes after this plan's removals, which disable the VFs vfio-pci would refuse
        vfs_off = any(s.action == "disable-vfs" for s in action.plan.steps)
        after = msgspec.structs.replace(gpu, vgpu=None) if vfs_off else gpu
        return GpuPreview(gpu, desired, action, rebind=rebind(plan_binding(after, desired.workload, drivers=drivers)),
                          then=then)
    if isinstance(action, BindAction):
        then = "mig" if desired.workload == "container" and desired.mig_enabled is not None else None
        return GpuPreview(gpu, desired, action, rebind=rebind(action.plan), then=then)
    return GpuPreview(gpu, desired, action)
