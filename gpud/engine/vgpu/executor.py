"""Runs a VgpuPlan's steps through host.nvidia.vgpu_sysfs, re-reading sysfs around each write.

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

from gpud.host.kernel.sysfs import SysfsError
from gpud.host.nvidia.sriov_manage import SriovManage
from gpud.host.nvidia.vgpu_sysfs import VgpuSysfs
from gpud.model import Holder, VgpuDevice
from gpud.plan.vgpu import VgpuPlan, VgpuRecord, VgpuStep


class _Malformed(Exception):
    """A step without the field its action needs: it fails before it writes."""


def _needs(value: str | None, name: str) -> str:
    if value is None:
        raise _Malformed(f"the step has no {name}")
    return value


class VgpuOutcome(Struct):
    state: str  # "done" | "blocked" | "failed"
    message: str = ""
    holders: list[Holder] = field(default_factory=list)
    created: list[str] = field(default_factory=list)  # "L40S-12Q on 0000:18:00.4", "T4-1Q <uuid>"
    removed: list[str] = field(default_factory=list)


def _now(vgpu: VgpuSysfs, pci: str, *, uuid: str | None = None, vf: str | None = None) -> VgpuDevice | None:
    """The vGPU a removal takes (by its UUID or its VF), as the host shows it now, holders re-read
    (None: already gone)."""
    return next((d for d in vgpu.read(pci).devices
                 if (uuid is not None and d.uuid == uuid) or (vf is not None and d.vf == vf)), None)


def _describe(step: VgpuStep) -> str:
    where = step.uuid or step.vf or step.parent or ""
    return f"{step.type} {where}".strip()


def _vfs(vgpu: VgpuSysfs, vf_tool: SriovManage | None, pf: str, enable: bool,
         holders: Callable[[str], list[Holder]] | None) -> VgpuOutcome | None:
    """VFs on or off through NVIDIA's sriov-manage (the caller closed its NVML session); None when done."""
    if vf_tool is None:
        return VgpuOutcome("failed", f"{'enabling' if enable else 'disabling'} the VFs of {pf} needs NVIDIA's "
                                     "sriov-manage, and none is configured (--sriov-manage)")
    result = vf_tool.enable(pf) if enable else vf_tool.disable(pf)
    now = len(vgpu.vfs(pf))
    if result.ok and (now > 0) == enable:
        return None
    if result.lock_refused:
        found = holders(pf) if holders is not None else []
        if found:
            names = ", ".join(f"pid {h.pid} {h.name}" for h in found)
            return VgpuOutcome("blocked", f"{result.summary()}; {pf} is held by {names}", holders=found)
        return VgpuOutcome("failed", f"{result.summary()}; no process holding {pf} was found (a kernel client "
                                     "such as nvidia_drm, or an NVML client that came and went)")
    if result.ok:
        return VgpuOutcome("failed", f"{result.summary()}; but {pf} has {now} VFs")
    return VgpuOutcome("failed", result.summary())


def execute(vgpu: VgpuSysfs, plan: VgpuPlan, record: VgpuRecord, *, phase: str = "all",
            on_step: Callable[[VgpuStep], None] | None = None, vf_tool: SriovManage | None = None,
            holders: Callable[[str], list[Holder]] | None = None) -> VgpuOutcome:
    """Run the plan's `removals`, `creations` or both (`phase`). Never removes a held vGPU.
    VFs change only through `vf_tool`; `holders(pf)` names what keeps a refused unbind lock."""
    if plan.infeasible:
        return VgpuOutcome("failed", plan.infeasible)
    if plan.blocked_by:
        return VgpuOutcome("blocked", "vGPUs to remove are in use", holders=list(plan.blocked_by))
    steps = {"removals": plan.removals, "creations": plan.creations}.get(phase, plan.steps)
    out = VgpuOutcome("done")
    for step in steps:
        try:
            if step.action == "remove":
                uuid = _needs(step.uuid, "uuid")
                dev = _now(vgpu, plan.pci, uuid=uuid)
                if dev is not None and dev.holders:
                    return VgpuOutcome("blocked", f"mdev {uuid} is in use", holders=list(dev.holders))
                if dev is not None:
                    vgpu.remove_mdev(uuid)
                out.removed.append(_describe(step))
            elif step.action == "free-vf":
                vf = _needs(step.vf, "vf")
                dev = _now(vgpu, plan.pci, vf=vf)
                if dev is not None and dev.holders:
                    return VgpuOutcome("blocked", f"VF {vf} is in use", holders=list(dev.holders))
                vgpu.set_vf_type(vf, 0)
                record.vfs.pop(vf, None)
                out.removed.append(_describe(step))
            elif step.action in ("disable-vfs", "enable-vfs"):
                failed = _vfs(vgpu, vf_tool, plan.pci, step.action == "enable-vfs", holders)
                if failed is not None:
                    failed.created, failed.removed = out.created, out.removed
                    return failed
            elif step.action == "set-vf-type":
                vf, vtype = _needs(step.vf, "vf"), _needs(step.type, "type")
                ids = [i for i, name in vgpu.creatable_on(vf) if name == vtype]
                if not ids:
                    return VgpuOutcome("failed", f"{vtype} is not creatable on VF {vf} now "
                                                 "(its creatable_vgpu_types does not list it)")
                vgpu.set_vf_type(vf, ids[0])
                record.vfs[vf] = vtype
                out.created.append(_describe(step))
            elif step.action == "create-mdev":
                parent, vtype, uuid = _needs(step.parent, "parent"), _needs(step.type, "type"), _needs(step.uuid, "uuid")
                types = vgpu.mdev_types(parent)
                found = types.get(vtype)
                if found is None or found[1] < 1:
                    return VgpuOutcome("failed", f"{vtype} has no available instance on {parent}")
                vgpu.create_mdev(parent, found[0], uuid)
                uuids = record.uuids.setdefault(vtype, [])
                if uuid not in uuids:
                    uuids.append(uuid)
                out.created.append(_describe(step))
        except (SysfsError, _Malformed) as e:
            return VgpuOutcome("failed", f"{step.action} {_describe(step)}: {e}", created=out.created,
                               removed=out.removed)
        if on_step is not None:
            on_step(step)
    return out
