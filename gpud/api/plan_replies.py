"""The `plan` reply (gpudctl plan): the engine's preview of each GPU (engine/preview.py) translated
into wire steps, what each disrupts (instances destroyed, vGPUs removed, holders, the reset and the
rebind it brings along), and the layout's errors when there is nothing to plan."""

from __future__ import annotations

from collections.abc import Sequence

from gpud.api.replies import DYNAMIC_NOTE, capped, holders, placement
from gpud.engine.gpu_state import BindAction, GpuState, MigAction, VgpuAction
from gpud.engine.preview import GpuPreview, Rebind
from gpud.layout.resolve import Resolution
from gpud.model import Gpu, VgpuDevice
from gpud.plan.binding import BindStep
from gpud.plan.mig import Destroyed, GpuPlan, Step
from gpud.plan.vgpu import VgpuStep
from gpud.wire import replies as wire_replies


def mig_step(step: Step) -> wire_replies.StepInfo:
    return wire_replies.StepInfo(action=step.action, pci=step.pci, profile=step.profile,
                                 placement=placement(step.placement) if step.placement is not None else None,
                                 gi=step.gi, ci=step.ci, uuid=step.uuid, enabled=step.enabled,
                                 ci_placement=placement(step.ci_placement) if step.ci_placement is not None else None)


def bind_step(step: BindStep) -> wire_replies.StepInfo:
    return wire_replies.StepInfo(action=step.action, pci=step.pci, driver=step.driver, module=step.module, group=step.group)


def vgpu_step(step: VgpuStep) -> wire_replies.StepInfo:
    return wire_replies.StepInfo(action=step.action, pci=step.parent or step.pci, type=step.type, uuid=step.uuid, vf=step.vf,
                                 count=step.count)


def vgpu_removed(pci: str, dev: VgpuDevice) -> wire_replies.VgpuRemovedInfo:
    return wire_replies.VgpuRemovedInfo(pci=pci, type=dev.type, uuid=dev.uuid, vf=dev.vf, holders=holders(dev.holders))


def destroyed(item: Destroyed) -> wire_replies.DestroyedInfo:
    return wire_replies.DestroyedInfo(pci=item.pci, profile=item.profile, placement=placement(item.placement),
                                      uuid=item.uuid, holders=holders(item.holders))


def _gpu_plan(p: GpuPreview, disruption: wire_replies.Disruption) -> wire_replies.GpuPlanInfo:
    gpu, action = p.gpu, p.action
    entry = wire_replies.GpuPlanInfo(index=gpu.index, pci=gpu.pci,
                                     dynamic=DYNAMIC_NOTE if p.desired is not None and p.desired.dynamic else None)
    if isinstance(action, GpuState):
        entry.infeasible = action.message
    elif isinstance(action, MigAction):
        plan: GpuPlan = action.plan
        entry.steps = [mig_step(s) for s in plan.steps]
        entry.blocked_by = holders(plan.blocked_by)
        disruption.destroyed += [destroyed(x) for x in plan.destroyed]
        if plan.mode_change:
            disruption.mode_changes.append(gpu.pci)
        if plan.reset:
            disruption.resets.append(gpu.pci)
            disruption.reset_with = sorted(set(disruption.reset_with) | set(p.reset_with))
    elif isinstance(action, VgpuAction):
        vplan = action.plan
        entry.steps = [vgpu_step(s) for s in vplan.steps]
        entry.blocked_by = holders(vplan.blocked_by)
        disruption.vgpus_removed += [vgpu_removed(gpu.pci, d) for d in vplan.removed]
        if any(s.action == "disable-vfs" for s in vplan.steps):
            disruption.vfs_disabled.append(gpu.pci)
    elif isinstance(action, BindAction):
        entry.steps = [bind_step(s) for s in action.plan.steps]
    if p.then is not None:
        entry.steps.append(_THEN[p.then](p))
    if p.rebind is not None:
        _add_rebind(gpu, p.rebind, disruption)
    return entry


# What follows a GPU's next action, as the plan's last line.
_THEN = {
    "bind": lambda p: wire_replies.StepInfo(action="bind", driver="vfio-pci"),
    "vgpu": lambda p: wire_replies.StepInfo(action="then-vgpu", message="vGPUs are created once the MIG layout is in place"),
    "workload": lambda p: wire_replies.StepInfo(action="then-workload", message=f"then {p.desired.workload}"),
    "mig": lambda p: wire_replies.StepInfo(action="then-mig", message="MIG is planned once nvidia has the GPU"),
}


def _add_rebind(gpu: Gpu, rebind: Rebind, disruption: wire_replies.Disruption) -> None:
    """A driver change is a disruption like a destroyed MIG device: containers (or a VM) lose the
    GPU and every endpoint of its IOMMU group that leaves its driver."""
    plan = rebind.plan
    d = plan.disruption
    if not d.detached:
        return
    disruption.rebinds.append(wire_replies.RebindInfo(
        pci=gpu.pci, to=plan.target, detached=dict(d.detached), leaves_nvml=d.leaves_nvml,
        mig_instances=d.mig_instances, vfio_group=d.vfio_group, holders=holders(rebind.holders),
        summary=d.summary))


def plan_reply(resolution: Resolution | None = None, previews: Sequence[GpuPreview] = (),
               *, errors: list[str] | None = None) -> wire_replies.PlanReply:
    """What a pass would do now, without doing it (`gpudctl plan`): the engine's preview of
    `resolution` (gpud.engine.preview), translated. With `errors`, the plan is empty and says why."""
    if errors:
        shown, omitted = capped(errors, "errors")
        return wire_replies.PlanReply(errors=shown, errors_omitted=omitted)
    if resolution is None:
        return wire_replies.PlanReply()
    warnings, warnings_omitted = capped([str(w) for w in resolution.warnings], "warnings")
    reply = wire_replies.PlanReply(warnings=warnings, warnings_omitted=warnings_omitted)
    for p in previews:
        reply.gpus.append(_gpu_plan(p, reply.disruption))
    return reply
