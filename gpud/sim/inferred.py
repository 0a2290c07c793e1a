"""The cells of a model that no source gives, as the simulator fills them in order to serve the
model at all (docs/hardware/mig-profiles.md, "Inferred cells").

gpud's own table (gpud.profiles) keeps these cells unknown: on a real host gpud reads NVML and never
presents one of them as fact. Only the simulator serves them, `ModelInfo.inferred` lists them and
`gpud-sim create` says which, so a test on such a model shows nothing about those cells.

The rules, by analogy with the H200 (the 7-slice table of the same family captured whole, on this
project's own host, tests/fixtures/h200):
- placements: the 7-slice ones every published `-lgipp` shows; CI profiles: the CI-split rule;
- a missing profile id: the id that size has on every 7-slice capture (3g 9, 4g 5, 7g 0);
- a 3g/4g/7g row's SMs and engine counts: the H200's row scaled, field by field, by the model's
  2g row over the H200's 2g row (B200: copy engines 6, 8, 16, which the MIG guide's B200 table
  also gives);
- memory: 7g is the GPU's total less what the H200 keeps back from its 7g, 3g and 4g are 7g times
  the H200's 3g/7g ratio, each rounded down to 64 MiB;
- the GPU's total, where no source gives it: the H200's, scaled by the figure in the model's 7g
  profile name over the H200's (7g.144gb over 7g.141gb); the same rule gives the B200 183539 MiB
  where a capture shows 183359;
- a captured row's cut-off cells (GB200 2g.47gb: copy engines, JPEG, OFA): the pre-production
  board's printed line (NVIDIA/gpu-operator#1303: 4, 2, 0);
- a model with no sourced row at all (GB300): its SMs and engines scaled as above from its
  predecessor's 2g row (GB200's, itself partly inferred), each row from the H200 row of the same
  profile id; other rows' memory likewise from the H200 row of the same id, against the 7g.
Profile names follow the host's driver where the model's names differ by driver branch
(`ModelInfo.renamed`, GB300 R59x vs R61x); the memory rules then read the served names.
"""

from __future__ import annotations

from functools import cache

from msgspec.structs import replace

from gpud.model import MigProfile, Placement
from gpud.profiles import _SEVEN_SLICE_SIZE, _SEVEN_SLICE_STARTS, MODELS, WHOLE_GPU, ModelInfo, _ci_profiles

_SEVEN_SLICE_ID = {3: 9, 4: 5, 7: 0}
_H200 = MODELS["h200"]
_CUT_OFF = {("gb200", "2g.47gb"): {"copy_engines": 4, "jpegs": 2, "ofas": 0}}
_PREDECESSOR = {"gb300": "gb200"}  # whose 2g row scales a model that has no sourced row
_SCALED = ("sms", "copy_engines", "decoders", "encoders", "jpegs", "ofas")
_INFERRABLE = {"id", "memory_mb", "sms", "placements", "ci_profiles", "copy_engines", "decoders", "encoders",
               "jpegs", "ofas"}


def _h200(slices: int) -> MigProfile:
    return next(p for p in _H200.profiles if p.slices == slices and "+" not in p.name)


def _h200_id(pid: int) -> MigProfile:
    return next(p for p in _H200.profiles if p.id == pid)


def _name_gb(m: ModelInfo, slices: int) -> int:
    """The memory figure in the name of the model's plain `slices`g profile (7g.180gb: 180)."""
    name = next(p.name for p in m.profiles if p.slices == slices and "+" not in p.name)
    return int(name.split(".", 1)[1].removesuffix("gb"))


def _down64(mib: float) -> int:
    return int(mib) // 64 * 64


def fill(m: ModelInfo) -> ModelInfo | None:
    """`m` with every unknown cell inferred, `unknown` emptied and `inferred` listing what was
    filled; None when a cell lies outside the rules (a geometry other than 7 slices, a missing
    instance count)."""
    unknown = dict(m.unknown)
    if any(set(f) - _INFERRABLE for n, f in unknown.items() if n != WHOLE_GPU):
        return None
    if any(p.slices not in (1, 2, 3, 4, 7) or p.instance_count == 0 for p in m.profiles):
        return None
    two_g = next((replace(p, **_CUT_OFF.get((m.key, p.name), {})) for p in m.profiles
                  if p.slices == 2 and "+" not in p.name
                  and set(unknown.get(p.name, ())) - set(_CUT_OFF.get((m.key, p.name), {})) <= {"placements",
                                                                                              "ci_profiles"}), None)
    if two_g is None and m.key in _PREDECESSOR:
        ref = sim_model(_PREDECESSOR[m.key])
        two_g = next((p for p in ref.profiles if p.slices == 2 and "+" not in p.name), None)
    if two_g is None and any(set(unknown.get(p.name, ())) & set(_SCALED) for p in m.profiles):
        return None
    total = m.memory_mb
    if WHOLE_GPU in unknown:
        total = _down64(_H200.memory_mb * _name_gb(m, 7) / _name_gb(_H200, 7))
    kept_back = _H200.memory_mb - _h200(7).memory_mb
    seven_mb = _down64(total - kept_back)
    out = []
    for p in m.profiles:
        fields = set(unknown.get(p.name, ()))
        changes: dict = dict(_CUT_OFF.get((m.key, p.name), {}))
        fields |= set(changes)
        if "id" in fields:
            changes["id"] = _SEVEN_SLICE_ID[p.slices]
        pid = changes.get("id", p.id)
        if "memory_mb" in fields:
            changes["memory_mb"] = seven_mb if p.slices == 7 else _down64(seven_mb * _h200_id(pid).memory_mb
                                                                           / _h200(7).memory_mb)
        for f in _SCALED:
            if f in fields and f not in changes:
                assert two_g is not None
                ref, ours = getattr(_h200(2), f), getattr(two_g, f)
                same = getattr(_h200_id(pid), f)
                changes[f] = round(same * ours / ref) if ref else same
        if "placements" in fields:
            changes["placements"] = tuple(Placement(s, _SEVEN_SLICE_SIZE[pid]) for s in _SEVEN_SLICE_STARTS[pid])
        out.append((replace(p, **changes), tuple(f for f in (*unknown.get(p.name, ()), *_CUT_OFF.get((m.key, p.name), {}))
                                              if f != "instance_count")))
    sms_per_slice = min(p.sms for p, _ in out if p.slices == 1 and "+" not in p.name)
    out = [(replace(p, ci_profiles=_ci_profiles(p.slices, sms_per_slice, p.sms)) if "ci_profiles" in fields else p,
            fields) for p, fields in out]
    inferred = tuple((p.name, fields) for p, fields in out if fields)
    if WHOLE_GPU in unknown:
        inferred += ((WHOLE_GPU, ("memory_mb",)),)
    return replace(m, profiles=tuple(p for p, _ in out), memory_mb=total, unknown=(), inferred=m.inferred + inferred)


def named(m: ModelInfo, driver_version: str | None) -> ModelInfo:
    """`m` with the profile names a driver of `driver_version` gives (ModelInfo.renamed)."""
    names = m.names_for(driver_version)
    if not names:
        return m
    old = {p.id: p.name for p in m.profiles}
    by_old = {old[i]: n for i, n in names.items() if i in old}

    def keyed(cells: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return tuple((by_old.get(name, name), fields) for name, fields in cells)

    return replace(m, profiles=tuple(replace(p, name=names.get(p.id, p.name)) for p in m.profiles),
                   unknown=keyed(m.unknown), inferred=keyed(m.inferred))


@cache
def sim_model(key: str, driver_version: str | None = None) -> ModelInfo:
    """The model as the simulator serves it under a driver of `driver_version` (None: the table's
    names): gpud's table, or its inferred completion where the model has unknown cells."""
    m = named(MODELS[key], driver_version)
    if m.unknown and m.mig_capable:
        return fill(m) or m
    return m
