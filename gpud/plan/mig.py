"""Observed GPU + what the layout wants of it -> an ordered list of MIG steps and what they disrupt.

Pure: no I/O, so every plan can be shown before it runs (`gpudctl plan`) and tested exhaustively.

How `mig-devices` is read (it counts MIG devices, i.e. compute instances, like mig-parted):
- a plain GI name, `3g.40gb: 2`, asks for 2 GIs of profile 3g.40gb, each with one full-size CI;
- `Nc.Mg.XXgb: k` asks for k CIs of N compute slices inside GIs of profile Mg.XXgb, packed into as
  few GIs as fit (Mg slices // N per GI, bounded by the CI profile's instance count); the last GI
  takes the remainder. Each key packs on its own: two keys never share a GI;
- `Nc` equal to the GI's size (`3c.3g.40gb`) is the same as the plain name.

Unlike mig-parted, which destroys and recreates every instance of a changed GPU, the plan keeps each
GI that can stay at its placement (see placement.solve) and, inside a kept GI, touches only the CIs
that differ. Anything busy that would be destroyed is listed in `blocked_by`; the executor refuses
to start while that list is non-empty. A mode change is also blocked by the GPU's compute processes
(NVML's view); device-node holders such as nvidia-persistenced only matter to a reset, which the
executor decides.
"""

from __future__ import annotations

from collections import Counter

import msgspec
from msgspec import Struct, field

from gpud.layout.desired import DesiredGpu
from gpud.layout.names import device_name, find_profile
from gpud.model import (
    CiProfile,
    ComputeInstance,
    Gpu,
    GpuInstance,
    Holder,
    MigProfile,
    Placement,
)
from gpud.plan.placement import Assignment, ExistingGi, GiSpec, Infeasible, solve
from gpud.profiles import CI_PROFILE_ID, by_device, model_name, with_model_ci_profiles


class Step(Struct, frozen=True):
    """One NVML call. create-ci names its GI by (profile_id, placement) because a new GI's id is
    only known once it exists; `gi` is set for GIs that exist at planning time."""

    action: str  # set-mig-mode | destroy-ci | destroy-gi | create-gi | create-ci | reset
    pci: str
    profile: str | None = None
    profile_id: int | None = None  # GI profile id
    placement: Placement | None = None  # of the GI
    gi: int | None = None
    ci: int | None = None
    ci_profile_id: int | None = None
    uuid: str | None = None  # MIG device destroyed by a destroy-ci
    enabled: bool | None = None  # set-mig-mode


class Destroyed(Struct, frozen=True):
    """A MIG device (or an empty GI, uuid None) the plan takes away, with whoever uses it."""

    pci: str
    profile: str
    placement: Placement
    uuid: str | None
    holders: list[Holder] = field(default_factory=list)


class TargetGi(Struct, frozen=True, order=True):
    """One GI of the layout the plan converges to (what the executor checks at the end)."""

    placement: Placement
    profile_id: int
    profile: str
    ci_profile_ids: tuple[int, ...]
    gi: int | None = None  # id when the GI exists already and is kept


class GpuPlan(Struct, frozen=True):
    pci: str
    index: int
    steps: list[Step] = field(default_factory=list)
    destroyed: list[Destroyed] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # MIG UUIDs left untouched
    mode_change: bool = False
    reset: bool = False  # a reset is expected (mode already pending, or an Ampere mode change);
    # the executor decides from the GPU's answer after set-mig-mode
    infeasible: str | None = None
    blocked_by: list[Holder] = field(default_factory=list)
    target: list[TargetGi] | None = None  # None: MIG is left alone or turned off
    mig_enabled: bool | None = None  # the mode the plan converges to (None: untouched)


def full_ci(gi: MigProfile) -> CiProfile:
    """The CI profile covering the whole GI (what `nvidia-smi mig -cgi ... -C` creates)."""
    ci = next((c for c in sorted(gi.ci_profiles, key=lambda c: c.id) if c.slices == gi.slices), None)
    return ci or CiProfile(CI_PROFILE_ID.get(gi.slices, 0), gi.slices, 1, gi.sms)


def ci_name(gi: MigProfile | None, ci_profile_id: int, gi_profile_id: int) -> str:
    if gi is None:
        return f"profile {gi_profile_id}"
    c = next((c for c in gi.ci_profiles if c.id == ci_profile_id), None)
    return device_name(gi, c.slices if c is not None else None)


def desired_specs(mig_devices: dict[str, int], profiles: tuple[MigProfile, ...], where: str) -> list[GiSpec]:
    """Turn `mig-devices` into GI specs (see the module docstring). Raises Infeasible."""
    specs: list[GiSpec] = []
    for name, count in sorted(mig_devices.items()):
        if count < 0:
            raise Infeasible(f"{name}: {count} is not a number of MIG devices")
        if count == 0:
            continue
        found = find_profile(name, profiles)
        if found is None:
            known = ", ".join(p.name for p in profiles)
            raise Infeasible(f"{name} is not a MIG profile of {where} (it offers {known})")
        gi, ci = found
        ci = ci or full_ci(gi)
        per_gi = max(1, min(gi.slices // ci.slices, ci.instance_count))
        full, rest = divmod(count, per_gi)
        specs += [GiSpec(gi.id, (ci.id,) * per_gi)] * full
        if rest:
            specs.append(GiSpec(gi.id, (ci.id,) * rest))
    return specs


def _packing_note(mig_devices: dict[str, int], profiles: tuple[MigProfile, ...]) -> str:
    """How `Nc.` keys turned into GIs, so an over-count message can be traced to the line written."""
    notes = []
    for name, count in sorted(mig_devices.items()):
        found = find_profile(name, profiles)
        if not found or found[1] is None or found[1].slices == found[0].slices or count <= 0:
            continue
        gi, ci = found
        per_gi = max(1, min(gi.slices // ci.slices, ci.instance_count))
        notes.append(f"{name}: {count} packs into {-(-count // per_gi)} x {gi.name} ({per_gi} per GI)")
    return f" ({'; '.join(notes)})" if notes else ""


def _existing(gi: GpuInstance) -> ExistingGi:
    return ExistingGi(
        id=gi.id, profile_id=gi.profile_id, placement=gi.placement,
        cis=tuple(sorted(c.profile_id for c in gi.cis)),
        busy_cis=tuple(sorted(c.profile_id for c in gi.cis if c.holders)),
    )


def _split_cis(gi: GpuInstance, want: tuple[int, ...]
               ) -> tuple[list[ComputeInstance], list[ComputeInstance], list[int]]:
    """(kept, doomed, to-create CI profile ids) turning gi's CIs into `want` in place; busy CIs are
    the ones kept when only some of a profile survive (same rule as placement.kept_cis)."""
    need = Counter(want)
    kept, doomed = [], []
    for c in sorted(gi.cis, key=lambda c: (not c.holders, c.id)):
        if need[c.profile_id] > 0:
            need[c.profile_id] -= 1
            kept.append(c)
        else:
            doomed.append(c)
    create = sorted(pid for pid, n in need.items() for _ in range(n))
    return sorted(kept, key=lambda c: c.id), sorted(doomed, key=lambda c: c.id), create


def plan_gpu(gpu: Gpu, desired: DesiredGpu) -> GpuPlan:
    """The MIG steps that take `gpu` to `desired`. Order: destroy CIs (of doomed GIs and the
    differing CIs of kept GIs), destroy doomed GIs, set-mig-mode, create GIs at explicit
    placements, create CIs. Observed == desired gives zero steps."""
    base = GpuPlan(pci=gpu.pci, index=gpu.index)
    want = desired.mig_enabled
    if want is None:
        return base
    where = f"{model_name(gpu)} {gpu.pci}"
    nv = gpu.nvml
    if nv is None:
        return _replace(base, infeasible=f"MIG on {where} cannot be managed: NVML does not see the GPU "
                                         f"(driver: {gpu.function.driver or 'none'})")
    if not nv.mig_capable:
        if want:
            return _replace(base, infeasible=f"{where} does not support MIG")
        return base

    mode = nv.mig_mode or 0
    pending = nv.mig_pending if nv.mig_pending is not None else mode
    mode_change = mode != int(want) or pending != int(want)
    existing = list(nv.instances) if mode == 1 else []

    profiles = with_model_ci_profiles(nv.profiles, gpu.function.device)
    assignments: list[Assignment] = []
    if want:
        try:
            specs = desired_specs(desired.mig_devices, profiles, where)
            assignments = solve(profiles, specs, [_existing(g) for g in existing], where=where)
        except Infeasible as e:
            return _replace(base, infeasible=str(e) + _packing_note(desired.mig_devices, profiles))

    by_id = {p.id: p for p in profiles}
    keep = {a.keep: a for a in assignments if a.keep is not None}
    destroy_ci: list[Step] = []
    destroy_gi: list[Step] = []
    create_gi: list[Step] = []
    create_ci: list[Step] = []
    destroyed: list[Destroyed] = []
    kept_uuids: list[str] = []
    blockers: set[Holder] = set()

    def doom_ci(gi: GpuInstance, c: ComputeInstance) -> None:
        name = ci_name(by_id.get(gi.profile_id), c.profile_id, gi.profile_id)
        destroy_ci.append(Step("destroy-ci", gpu.pci, name, gi.profile_id, gi.placement, gi.id, c.id,
                               c.profile_id, c.uuid))
        destroyed.append(Destroyed(gpu.pci, name, gi.placement, c.uuid, sorted(c.holders)))
        blockers.update(c.holders)

    for gi in sorted(existing, key=lambda g: (g.placement, g.id)):
        gname = by_id[gi.profile_id].name if gi.profile_id in by_id else f"profile {gi.profile_id}"
        a = keep.get(gi.id)
        if a is None:
            for c in sorted(gi.cis, key=lambda c: c.id):
                doom_ci(gi, c)
            if not gi.cis:
                destroyed.append(Destroyed(gpu.pci, gname, gi.placement, None, []))
            destroy_gi.append(Step("destroy-gi", gpu.pci, gname, gi.profile_id, gi.placement, gi.id))
            continue
        kept, doomed, create = _split_cis(gi, a.spec.cis)
        kept_uuids += [c.uuid for c in kept]
        for c in doomed:
            doom_ci(gi, c)
        for pid in create:
            create_ci.append(Step("create-ci", gpu.pci, ci_name(by_id[gi.profile_id], pid, gi.profile_id),
                                  gi.profile_id, gi.placement, gi.id, None, pid))

    for a in sorted(assignments, key=lambda a: a.placement):
        if a.keep is not None:
            continue
        p = by_id[a.spec.profile_id]
        create_gi.append(Step("create-gi", gpu.pci, p.name, p.id, a.placement))
        for pid in a.spec.cis:
            create_ci.append(Step("create-ci", gpu.pci, ci_name(p, pid, p.id), p.id, a.placement, None, None, pid))
    create_ci.sort(key=lambda s: (s.placement, s.ci_profile_id))

    mode_steps = [Step("set-mig-mode", gpu.pci, enabled=want)] if mode_change else []
    # The mode in effect is already the wanted one and only the opposite is pending (an earlier
    # flip that never got its reset): setting the mode back cancels the flip. Nothing changes
    # under running processes, so they do not block it and no reset follows.
    cancel_pending = mode == int(want) and pending != int(want)
    if mode_change and not cancel_pending:
        blockers.update(nv.processes)
        blockers.update(h for g in existing for h in g.holders)
    arch = by_device(gpu.function.device)
    already_pending = pending == int(want) and mode != int(want)
    reset = mode_change and not cancel_pending and (
        already_pending or (arch is not None and arch.mode_change_needs_reset))
    target = None
    if want:
        target = sorted(TargetGi(a.placement, a.spec.profile_id, by_id[a.spec.profile_id].name, a.spec.cis, a.keep)
                        for a in assignments)
    return GpuPlan(
        pci=gpu.pci, index=gpu.index,
        steps=destroy_ci + destroy_gi + mode_steps + create_gi + create_ci,
        destroyed=destroyed, kept=kept_uuids, mode_change=mode_change, reset=reset,
        blocked_by=sorted(blockers), target=target, mig_enabled=want,
    )


def _replace(plan: GpuPlan, **kw) -> GpuPlan:
    return msgspec.structs.replace(plan, **kw)
