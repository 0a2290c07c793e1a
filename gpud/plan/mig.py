"""Observed GPU + what the layout wants of it -> an ordered list of MIG steps and what they disrupt.

Pure: no I/O, so every plan can be shown before it runs (`gpudctl plan`) and tested exhaustively.

How `mig-devices` is read (it counts MIG devices, i.e. compute instances, like mig-parted):
- a plain GI name, `3g.40gb: 2`, asks for 2 GIs of profile 3g.40gb, each with one full-size CI;
- `Nc.Mg.XXgb: k` asks for k CIs of N compute slices inside GIs of profile Mg.XXgb. All `Nc.` keys of
  one GI profile pack together into as few GIs as their CI placements allow, largest CIs first
  (`2c.3g.40gb: 1, 1c.3g.40gb: 1` is one 3g GI: the 2c at compute slice 0, the 1c at 2);
- `Nc` equal to the GI's size (`3c.3g.40gb`) is the same as the plain name.

Every CI is planned at an explicit placement inside its GI (ci_placement), so a kept GI keeps each
CI whose placement survives and only the others are destroyed and created.

Unlike mig-parted, which destroys and recreates every instance of a changed GPU, the plan keeps each
GI that can stay at its placement (see placement.solve) and, inside a kept GI, touches only the CIs
that differ. Anything busy that would be destroyed is listed in `blocked_by`; the executor refuses
to start while that list is non-empty. A mode change is also blocked by the GPU's compute processes
(NVML's view); device-node holders such as nvidia-persistenced only matter to a reset, which the
executor decides.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct, field

from gpud.layout.desired import DesiredGpu
from gpud.layout.names import device_name, find_profile
from gpud.mig_text import step_text
from gpud.model import (
    CiProfile,
    ComputeInstance,
    Gpu,
    GpuInstance,
    Holder,
    MigProfile,
    Placement,
)
from gpud.plan.ci_placement import CiLayout, ExistingCi, fits, place_cis
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
    ci_placement: Placement | None = None  # of the CI inside its GI, in compute slices

    def __str__(self) -> str:
        """The step's line in `gpudctl events` and `gpudctl plan` (gpud.mig_text: one wording)."""
        return step_text(self)


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
    ci_placements: tuple[tuple[int, int], ...] = ()  # (CI profile id, start) when placements are known


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
    shared: dict[int, list[int]] = {}  # GI profile id -> CI profile ids of its `Nc.` keys
    by_id = {p.id: p for p in profiles}
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
        if ci is None or ci.slices == gi.slices:
            specs += [GiSpec(gi.id, ((ci or full_ci(gi)).id,))] * count
        else:
            shared.setdefault(gi.id, []).extend([ci.id] * count)
    for gi_id, cis in sorted(shared.items()):
        specs += [GiSpec(gi_id, tuple(sorted(b))) for b in _pack(by_id[gi_id], cis)]
    return specs


def _pack(gi: MigProfile, cis: list[int]) -> list[list[int]]:
    """First-fit decreasing of CIs into GIs of profile `gi`, each GI's CIs checked to have
    non-overlapping placements (ci_placement.fits)."""
    slices = {c.id: c.slices for c in gi.ci_profiles}
    bins: list[list[int]] = []
    for pid in sorted(cis, key=lambda p: (-slices.get(p, 0), p)):
        target = next((b for b in bins if fits(gi.ci_profiles, b + [pid], gi.slices)), None)
        if target is None:
            bins.append([pid])
        else:
            target.append(pid)
    return bins


def _packing_note(mig_devices: dict[str, int], profiles: tuple[MigProfile, ...]) -> str:
    """How `Nc.` keys turned into GIs, so an over-count message can be traced to the lines written."""
    keys: dict[str, dict[str, int]] = {}  # GI profile name -> its `Nc.` keys and counts
    for name, count in sorted(mig_devices.items()):
        found = find_profile(name, profiles)
        if not found or found[1] is None or found[1].slices == found[0].slices or count <= 0:
            continue
        keys.setdefault(found[0].name, {})[name] = count
    notes = []
    for gi_name, asked in keys.items():
        specs = desired_specs(asked, profiles, "")
        written = ", ".join(f"{name}: {count}" for name, count in asked.items())
        if len(asked) == 1:
            notes.append(f"{written} packs into {len(specs)} x {gi_name} ({len(specs[0].cis)} per GI)")
        else:
            notes.append(f"{written} pack into {len(specs)} x {gi_name}")
    return f" ({'; '.join(notes)})" if notes else ""


def _existing(gi: GpuInstance) -> ExistingGi:
    return ExistingGi(
        id=gi.id, profile_id=gi.profile_id, placement=gi.placement,
        cis=tuple(sorted(c.profile_id for c in gi.cis)),
        busy_cis=tuple(sorted(c.profile_id for c in gi.cis if c.holders)),
        ci_slots=tuple(ExistingCi(c.id, c.profile_id, c.start, bool(c.holders)) for c in gi.cis),
    )


def _ci_layout(gi_profile: MigProfile | None, gi: GpuInstance | None, want: tuple[int, ...]) -> CiLayout:
    """Where the CIs `want` go in a GI (kept GI: keeping every CI whose placement survives)."""
    existing = [ExistingCi(c.id, c.profile_id, c.start, bool(c.holders)) for c in (gi.cis if gi else ())]
    ci_profiles = gi_profile.ci_profiles if gi_profile else ()
    layout = place_cis(ci_profiles, want, existing, gi_slices=gi_profile.slices if gi_profile else None)
    if layout is None:  # the GI spec was packed with fits(), so only an unknown GI profile gets here
        return CiLayout((), tuple(c.id for c in existing), tuple((p, None) for p in want))
    return layout


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
        return msgspec.structs.replace(base, infeasible=f"MIG on {where} cannot be managed: NVML does not see the GPU "
                                         f"(driver: {gpu.function.driver or 'none'})")
    if not nv.mig_capable:
        if want:
            return msgspec.structs.replace(base, infeasible=f"{where} does not support MIG")
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
            return msgspec.structs.replace(base, infeasible=str(e) + _packing_note(desired.mig_devices, profiles))

    by_id = {p.id: p for p in profiles}
    keep = {a.keep: a for a in assignments if a.keep is not None}
    destroy_ci: list[Step] = []
    destroy_gi: list[Step] = []
    create_gi: list[Step] = []
    create_ci: list[Step] = []
    destroyed: list[Destroyed] = []
    kept_uuids: list[str] = []
    blockers: set[Holder] = set()
    layouts: dict[int, CiLayout] = {}  # kept GI id -> its CIs' layout
    new_layouts: dict[Placement, CiLayout] = {}  # new GI placement -> its CIs' layout

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
        layout = layouts[gi.id] = _ci_layout(by_id.get(gi.profile_id), gi, a.spec.cis)
        kept_uuids += [c.uuid for c in sorted(gi.cis, key=lambda c: c.id) if c.id in layout.kept]
        for c in sorted(gi.cis, key=lambda c: c.id):
            if c.id in layout.doomed:
                doom_ci(gi, c)
        for pid, start in layout.create:
            create_ci.append(Step("create-ci", gpu.pci, ci_name(by_id[gi.profile_id], pid, gi.profile_id),
                                  gi.profile_id, gi.placement, gi.id, None, pid,
                                  ci_placement=_ci_placement(by_id[gi.profile_id], pid, start)))

    for a in sorted(assignments, key=lambda a: a.placement):
        if a.keep is not None:
            continue
        p = by_id[a.spec.profile_id]
        create_gi.append(Step("create-gi", gpu.pci, p.name, p.id, a.placement))
        layout = new_layouts[a.placement] = _ci_layout(p, None, a.spec.cis)
        for pid, start in layout.create:
            create_ci.append(Step("create-ci", gpu.pci, ci_name(p, pid, p.id), p.id, a.placement, None, None, pid,
                                  ci_placement=_ci_placement(p, pid, start)))
    create_ci.sort(key=lambda s: (s.placement, s.ci_placement or Placement(-1, 0), s.ci_profile_id))

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
        target = sorted(
            TargetGi(a.placement, a.spec.profile_id, by_id[a.spec.profile_id].name, a.spec.cis, a.keep,
                     ((layouts.get(a.keep) if a.keep is not None else new_layouts.get(a.placement))
                      or CiLayout((), (), ())).placed)
            for a in assignments)
    return GpuPlan(
        pci=gpu.pci, index=gpu.index,
        steps=destroy_ci + destroy_gi + mode_steps + create_gi + create_ci,
        destroyed=destroyed, kept=kept_uuids, mode_change=mode_change, reset=reset,
        blocked_by=sorted(blockers), target=target, mig_enabled=want,
    )


def _ci_placement(gi: MigProfile, ci_profile_id: int, start: int | None) -> Placement | None:
    if start is None:
        return None
    ci = next((c for c in gi.ci_profiles if c.id == ci_profile_id), None)
    return Placement(start, ci.slices) if ci is not None else None
