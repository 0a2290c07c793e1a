"""Runs a VgpuPlan's steps through host.vgpu_sysfs, re-reading sysfs around each write.

The plan names types, never ids: ids are per driver release, so each step reads the id from the
VF's own creatable list (vendor VFIO) or the type directory from the parent's
mdev_supported_types right before writing. A removal re-checks the vGPU's holders first, because on
a 6.1 kernel removing an mdev a VM holds open does not fail, it blocks until the VM lets go. After
each creation the recorded identity (UUID per type, type per VF) is updated, so a reboot or a
daemon restart rebuilds the same vGPUs.
"""

from __future__ import annotations

from collections.abc import Callable

from msgspec import Struct, field

from gpud.host.sysfs import SysfsError
from gpud.host.vgpu_sysfs import VgpuSysfs
from gpud.model import Holder
from gpud.plan.vgpu import VgpuPlan, VgpuRecord, VgpuStep


class VgpuOutcome(Struct):
    state: str  # "done" | "blocked" | "failed"
    message: str = ""
    holders: list[Holder] = field(default_factory=list)
    created: list[str] = field(default_factory=list)  # "L40S-12Q on 0000:18:00.4", "T4-1Q <uuid>"
    removed: list[str] = field(default_factory=list)


def _describe(step: VgpuStep) -> str:
    where = step.uuid or step.vf or step.parent or ""
    return f"{step.type} {where}".strip()


def execute(vgpu: VgpuSysfs, plan: VgpuPlan, record: VgpuRecord, *, phase: str = "all",
            on_step: Callable[[VgpuStep], None] | None = None) -> VgpuOutcome:
    """Run the plan's `removals`, `creations` or both (`phase`). Never removes a held vGPU."""
    if plan.infeasible:
        return VgpuOutcome("failed", plan.infeasible)
    if plan.blocked_by:
        return VgpuOutcome("blocked", "vGPUs to remove are in use", holders=list(plan.blocked_by))
    steps = {"removals": plan.removals, "creations": plan.creations}.get(phase, plan.steps)
    out = VgpuOutcome("done")
    for step in steps:
        try:
            if step.action == "remove":
                now = vgpu.read(plan.pci)
                dev = next((d for d in now.devices if d.uuid == step.uuid), None)
                if dev is not None and dev.holders:
                    return VgpuOutcome("blocked", f"mdev {step.uuid} is in use", holders=list(dev.holders))
                if dev is not None:
                    vgpu.remove_mdev(step.uuid)
                out.removed.append(_describe(step))
            elif step.action == "free-vf":
                now = vgpu.read(plan.pci)
                dev = next((d for d in now.devices if d.vf == step.vf), None)
                if dev is not None and dev.holders:
                    return VgpuOutcome("blocked", f"VF {step.vf} is in use", holders=list(dev.holders))
                vgpu.set_vf_type(step.vf, 0)
                record.vfs.pop(step.vf, None)
                out.removed.append(_describe(step))
            elif step.action == "disable-vfs":
                vgpu.set_num_vfs(plan.pci, 0)
            elif step.action == "enable-vfs":
                vgpu.set_num_vfs(plan.pci, step.count or 0)
            elif step.action == "set-vf-type":
                ids = [i for i, name in vgpu.creatable_on(step.vf) if name == step.type]
                if not ids:
                    return VgpuOutcome("failed", f"{step.type} is not creatable on VF {step.vf} now "
                                                 "(its creatable_vgpu_types does not list it)")
                vgpu.set_vf_type(step.vf, ids[0])
                record.vfs[step.vf] = step.type
                out.created.append(_describe(step))
            elif step.action == "create-mdev":
                types = vgpu.mdev_types(step.parent)
                found = types.get(step.type)
                if found is None or found[1] < 1:
                    return VgpuOutcome("failed", f"{step.type} has no available instance on {step.parent}")
                vgpu.create_mdev(step.parent, found[0], step.uuid)
                uuids = record.uuids.setdefault(step.type, [])
                if step.uuid not in uuids:
                    uuids.append(step.uuid)
                out.created.append(_describe(step))
        except SysfsError as e:
            return VgpuOutcome("failed", f"{step.action} {_describe(step)}: {e}", created=out.created,
                               removed=out.removed)
        if on_step is not None:
            on_step(step)
    return out
