"""vGPU plan for one GPU: which vGPUs to remove and create, keeping what survives (pure).

NVIDIA's vgpu-device-manager deletes every vGPU of a GPU and recreates the lot with fresh UUIDs to
change one; a VM's libvirt domain names its mdev by UUID, so that breaks every domain. Here:
- vGPUs the layout still asks for stay where they are (same UUID, same VF); only the difference is
  removed or created;
- a vGPU a VM holds open is never removed: the plan is blocked and names the holders (the engine
  waits or fails by `on-busy`);
- the hardware's rules are checked before any change, so an impossible layout changes nothing:
  time-sliced vGPUs on one GPU are all of one type (the classic equal-size rule; the mixed-size
  mode of newer branches is not modelled), at most the type's per-GPU count, one vGPU per VF on
  SR-IOV GPUs; MIG-backed vGPUs sit on GPU instances of their profile, as many to an instance as
  the type allows (one on Ampere and Hopper, up to eight DC-1-3Q on an RTX PRO 6000's 1g.24gb+gfx),
  all vGPUs of one instance of one type (the equal-size rule, per instance); the MIG layout they
  imply is planned first by gpud.plan.mig, so this plan only counts instances and their room;
- identities are stable: a new mdev reuses the UUID recorded for that type on that GPU (what the
  daemon persisted before a reboot), else a UUID derived from the GPU and the type, so the same
  layout rebuilt after a reboot gives the same UUIDs; a VF gets back the type it had.

Steps come in two phases: `removals` (before any MIG change: a GPU instance carrying a vGPU cannot
go) and `creations` (after the MIG layout is in place).
"""

from __future__ import annotations

import uuid as uuidlib
from typing import Literal

import msgspec
from msgspec import Struct, field

from gpud.layout.desired import DesiredGpu
from gpud.model import Holder, NvmlGpu, VgpuDevice, VgpuState
from gpud.vgpu_types import VgpuModel, mig_need, parse_vgpu_name, strip_prefix

VgpuAction = Literal["remove", "free-vf", "disable-vfs", "enable-vfs", "create-mdev", "set-vf-type"]
_UUID_NAMESPACE = uuidlib.UUID("8d2f0a6c-47f1-4b55-9e0c-4a8c0f3f6b21")  # fixed: derived UUIDs are stable


class VgpuStep(Struct, frozen=True):
    action: VgpuAction
    pci: str  # the GPU
    type: str | None = None
    uuid: str | None = None  # mdev UUID (create-mdev, remove)
    vf: str | None = None  # VF address (set-vf-type, free-vf)
    parent: str | None = None  # mdev parent (create-mdev)
    count: int | None = None  # enable-vfs


class VgpuRecord(Struct):
    """What gpud chose for one GPU, kept under its state directory across restarts and reboots."""

    uuids: dict[str, list[str]] = field(default_factory=dict)  # type -> mdev UUIDs, in creation order
    vfs: dict[str, str] = field(default_factory=dict)  # VF address -> type it carries


class VgpuPlan(Struct, frozen=True):
    pci: str
    index: int
    interface: str | None = None
    removals: list[VgpuStep] = field(default_factory=list)
    creations: list[VgpuStep] = field(default_factory=list)
    kept: list[VgpuDevice] = field(default_factory=list)
    removed: list[VgpuDevice] = field(default_factory=list)
    infeasible: str | None = None
    blocked_by: list[Holder] = field(default_factory=list)

    @property
    def steps(self) -> list[VgpuStep]:
        return [*self.removals, *self.creations]


def derived_uuid(gpu_key: str, vgpu_type: str, ordinal: int) -> str:
    """The UUID gpud gives the n-th mdev of a type on a GPU when nothing was recorded."""
    return str(uuidlib.uuid5(_UUID_NAMESPACE, f"{gpu_key}/{vgpu_type}/{ordinal}"))


def wanted_types(desired: DesiredGpu | None) -> dict[str, int]:
    if desired is None or desired.workload != "vm-vgpu":
        return {}
    out: dict[str, int] = {}
    for name, n in desired.vgpu_devices.items():
        if n > 0:
            bare = strip_prefix(name)
            out[bare] = out.get(bare, 0) + n
    return out


def check_rules(want: dict[str, int], model: VgpuModel | None, state: VgpuState, where: str) -> str | None:
    """Why `want` cannot exist on this GPU, or None (the rules that need no GPU instances; those
    are `check_instances`)."""
    if not want:
        return None
    if state.interface is None:
        return (f"{where} shows no vGPU interface (no mdev_supported_types, no SR-IOV): is NVIDIA's vGPU "
                "manager driver loaded?")
    parsed = {name: parse_vgpu_name(name) for name in want}
    # For a model gpud has no table for, the driver's list is the truth: read on a GPU without vGPUs
    # (later the lists shrink to what fits beside the vGPUs placed) and for time-sliced types (a
    # MIG-backed type is listed only once its GPU instance exists). A name outside NVIDIA's grammar
    # counts as time-sliced.
    if model is None and state.offers and not state.devices:
        offered = {o.type for o in state.offers}
        for name in want:
            if name not in offered and not ((p := parsed[name]) is not None and p.mig_backed):
                return f"{name} is not offered by {where}; it offers {', '.join(o.type for o in state.offers)}"
    time_sliced = sorted(n for n, p in parsed.items() if p is None or not p.mig_backed)
    mig_backed = sorted(n for n, p in parsed.items() if p is not None and p.mig_backed)
    if time_sliced and mig_backed:
        return (f"{time_sliced[0]} is time-sliced and {mig_backed[0]} is MIG-backed: one GPU runs one kind, "
                f"not both ({where})")
    if len(time_sliced) > 1:
        return (f"time-sliced vGPUs on one GPU must all be one type; asked {', '.join(time_sliced)} on {where}")
    if model is not None:
        for name, n in want.items():
            vtype = model.find(name)
            if vtype is None:
                return f"{name} is not a vGPU type of {where}; valid: {', '.join(model.names())}"
            if n > vtype.max_instances:
                return f"{n} x {name} on {where}: the type fits at most {vtype.max_instances} on one GPU"
    total = sum(want.values())
    vfs = state.total_vfs or (model.total_vfs if model is not None else 0)
    if state.interface in ("vfio", "sriov") or (state.interface == "mdev" and state.vfs):
        if vfs and total > vfs:
            return f"{total} vGPUs on {where}: one vGPU per VF and the GPU has {vfs} VFs"
    return None


def check_instances(want: dict[str, int], model: VgpuModel | None, kept: list[VgpuDevice],
                    gi_profiles: dict[int, str], where: str) -> str | None:
    """Why the MIG-backed vGPUs of `want` do not fit on the GPU's instances (GI id -> profile name,
    as NVML lists them) beside the vGPUs kept, or None. An instance holds vGPUs of one type only, up
    to the type's per-instance count; a new vGPU goes where its type has room, else onto an
    instance without vGPUs (after the removals, the doomed vGPUs' instances are free)."""
    on: dict[int, tuple[str, int]] = {}  # GI id -> (type, vGPUs kept on it)
    for d in kept:
        if d.gi is not None:
            t, n = on.get(d.gi, (d.type, 0))
            on[d.gi] = (t, n + 1)
    by_profile: dict[str, list[tuple[str, int]]] = {}  # profile -> [(type, missing)]
    per_gi: dict[str, int] = {}
    for name, n in want.items():
        need = mig_need(name, model)
        if need is None:
            continue
        profile, per_gi[name] = need
        missing = n - sum(1 for d in kept if d.type == name)
        by_profile.setdefault(profile, []).append((name, missing))
    for profile, types in sorted(by_profile.items()):
        gis = [gi for gi, p in gi_profiles.items() if p == profile]
        empty = sum(1 for gi in gis if gi not in on)
        carrying = {t: sum(1 for gi in gis if on.get(gi, ("", 0))[0] == t) for t, _ in types}
        needed = 0
        for name, missing in types:
            room = sum(per_gi[name] - on[gi][1] for gi in gis if gi in on and on[gi][0] == name)
            needed += -(-max(0, missing - room) // per_gi[name])
        if needed > empty:
            total = sum(n for t, n in want.items() if t in dict(types))
            have = empty + sum(carrying.values())
            shared = [f"{t}: {per_gi[t]}" for t, _ in types if per_gi[t] > 1]
            note = f" (vGPUs to an instance: {', '.join(shared)})" if shared else ""
            return (f"{total} MIG-backed vGPUs need {needed + sum(carrying.values())} GPU instances {profile} on "
                    f"{where}{note}; the MIG layout has {have}")
    return None


def plan_vgpu(*, pci: str, index: int, gpu_key: str, where: str, state: VgpuState, desired: DesiredGpu | None,
              model: VgpuModel | None, record: VgpuRecord | None = None,
              gi_profiles: dict[int, str] | None = None) -> VgpuPlan:
    """Steps that take the GPU's vGPUs from `state` to what `desired` asks (nothing for a GPU that
    is not vm-vgpu: its vGPUs go and its VFs are disabled). `gi_profiles`: GI id -> MIG profile name
    of the GPU's current instances, for MIG-backed types (checked once the MIG layout is in place)."""
    record = record or VgpuRecord()
    want = wanted_types(desired)
    base = VgpuPlan(pci=pci, index=index, interface=state.interface)
    reason = check_rules(want, model, state, where)
    if reason is not None:
        return msgspec.structs.replace(base, infeasible=reason)

    # Survivors: per type, keep up to the count asked; busy ones and recorded identities first.
    recorded = {u for us in record.uuids.values() for u in us}
    by_type: dict[str, list[VgpuDevice]] = {}
    for d in state.devices:
        by_type.setdefault(d.type, []).append(d)
    kept: list[VgpuDevice] = []
    doomed: list[VgpuDevice] = []
    for vtype, devices in by_type.items():
        order = sorted(devices, key=lambda d: (not d.holders, (d.uuid or d.vf or "") not in recorded,
                                               d.uuid or d.vf or ""))
        n = want.get(vtype, 0)
        kept += order[:n]
        doomed += order[n:]
    if gi_profiles is not None:
        reason = check_instances(want, model, kept, gi_profiles, where)
        if reason is not None:
            return msgspec.structs.replace(base, infeasible=reason)
    busy = sorted({h for d in doomed for h in d.holders})
    if busy:
        return msgspec.structs.replace(base, kept=kept, removed=doomed, blocked_by=busy)

    removals: list[VgpuStep] = []
    for d in doomed:
        if d.uuid is not None:
            removals.append(VgpuStep("remove", pci, type=d.type, uuid=d.uuid))
        else:
            removals.append(VgpuStep("free-vf", pci, type=d.type, vf=d.vf))
    if not want and state.vfs and state.interface in ("vfio", "mdev"):
        removals.append(VgpuStep("disable-vfs", pci, count=0))

    creations: list[VgpuStep] = []
    missing = {t: n - sum(1 for d in kept if d.type == t) for t, n in want.items()}
    missing = {t: n for t, n in missing.items() if n > 0}
    if missing:
        sriov_no_vfs = state.interface == "sriov" or (not state.vfs and state.total_vfs > 0)
        if sriov_no_vfs:
            # The interface shows itself only once VFs exist: enable them (all, as sriov-manage -e
            # does) and plan the vGPUs on the next round.
            count = state.total_vfs or (model.total_vfs if model is not None else 0)
            return msgspec.structs.replace(base, kept=kept, removed=doomed, removals=removals,
                         creations=[VgpuStep("enable-vfs", pci, count=count)])
        busy_parents = {d.parent for d in kept}
        free = [v for v in state.vfs if v not in busy_parents]
        mdev_on_vfs = state.interface == "mdev" and bool(state.vfs)
        in_use = {d.uuid for d in state.devices if d.uuid}
        for vtype in sorted(missing):
            for _ in range(missing[vtype]):
                if state.interface == "vfio" or mdev_on_vfs:
                    # prefer the VF that carried this type before (its identity), then the lowest
                    pick = next((v for v in free if record.vfs.get(v) == vtype), None) or \
                        next((v for v in free if v not in record.vfs), None) or (free[0] if free else None)
                    if pick is None:
                        return msgspec.structs.replace(base, infeasible=f"no free VF left on {where} for {vtype}")
                    free.remove(pick)
                    if state.interface == "vfio":
                        creations.append(VgpuStep("set-vf-type", pci, type=vtype, vf=pick))
                        continue
                    parent = pick
                else:
                    parent = pci
                new = _next_uuid(gpu_key, vtype, record, in_use)
                in_use.add(new)
                creations.append(VgpuStep("create-mdev", pci, type=vtype, uuid=new, parent=parent))
    return msgspec.structs.replace(base, kept=kept, removed=doomed, removals=removals, creations=creations)


def _next_uuid(gpu_key: str, vtype: str, record: VgpuRecord, in_use: set[str]) -> str:
    for u in record.uuids.get(vtype, []):
        if u not in in_use:
            return u
    ordinal = 0
    while (u := derived_uuid(gpu_key, vtype, ordinal)) in in_use or any(
            u in us for t, us in record.uuids.items() if t != vtype):
        ordinal += 1
    return u


def gi_profiles_of(nvml: NvmlGpu | None) -> dict[int, str] | None:
    """GI id -> profile name of an NvmlGpu's GPU instances (None when MIG is off or unknown)."""
    if nvml is None or not nvml.mig_capable or not nvml.mig_mode:
        return None
    names = {p.id: p.name for p in nvml.profiles}
    return {gi.id: names.get(gi.profile_id, str(gi.profile_id)) for gi in nvml.instances}
