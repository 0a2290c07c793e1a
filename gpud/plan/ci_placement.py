"""Placement of compute instances inside one GPU instance, keeping the CIs that can stay.

Why: CIs have placements too (NVML's nvmlGpuInstanceGetComputeInstancePossiblePlacements, in
compute slices), and a CI created without one lands where the driver chooses, which can leave no
room for the next one (a 1c created first at 0 of a 3g leaves no slot for a 2c, whose only
placement is 0:2). Solving the GI's CIs first and creating each at an explicit start makes the
order irrelevant, and lets a CI whose placement survives keep running while its neighbours change.

Pure: CI profiles in, a layout out. A GI holds at most 8 compute slices, so the depth-first search
over (next CI, occupied-slice mask) is tiny; it is memoised anyway for the packing loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from msgspec import Struct

from gpud.model import CiProfile


class ExistingCi(Struct, frozen=True):
    """A CI present now in the GI being planned. `start` None: its placement was not read."""

    id: int
    profile_id: int
    start: int | None = None
    busy: bool = False


class CiLayout(Struct, frozen=True):
    """Which existing CIs stay, which go, and which to create where (start None: the driver picks,
    used only when placements are unknown)."""

    kept: tuple[int, ...]  # ids of existing CIs left untouched
    doomed: tuple[int, ...]  # ids of existing CIs to destroy
    create: tuple[tuple[int, int | None], ...]  # (CI profile id, start)
    placed: tuple[tuple[int, int], ...] = ()  # (CI profile id, start) of every CI after the change


W_BUSY, W_KEPT = 1 << 8, 1


def _known(profiles: dict[int, CiProfile], want: Sequence[int], existing: Sequence[ExistingCi]) -> bool:
    return all(profiles.get(p) is not None and profiles[p].starts for p in want) and \
        all(c.start is not None and c.profile_id in profiles for c in existing)


def place_cis(ci_profiles: Sequence[CiProfile], want: Sequence[int], existing: Sequence[ExistingCi] = (),
              *, gi_slices: int | None = None) -> CiLayout | None:
    """The CIs `want` (CI profile ids) inside one GI, as placements that do not overlap, keeping
    the existing CIs that can stay at their placement (busy ones first, then the most), ties to the
    lowest starts. None when `want` cannot be placed (too many of a profile, or no arrangement).

    Placements unknown (no possible placements for a wanted profile, or an existing CI whose
    placement was not read): falls back to counting compute slices, keeping per profile as many
    existing CIs as wanted (busy first), creating the rest without a placement."""
    profiles = {c.id: c for c in ci_profiles}
    counts = Counter(want)
    if any(p not in profiles or n > profiles[p].instance_count for p, n in counts.items()):
        return None
    if not _known(profiles, want, existing):
        return _by_count(profiles, want, existing, gi_slices)

    items = sorted(want, key=lambda p: (-profiles[p].slices, p))
    at = {(c.profile_id, c.start): c for c in existing}
    options = []
    for p in items:
        prof = profiles[p]
        opts = []
        for s in sorted(prof.starts):
            c = at.get((p, s))
            score = (W_BUSY * c.busy + W_KEPT) if c is not None else 0
            opts.append((s, ((1 << prof.slices) - 1) << s, score))
        options.append(opts)
    twin = [i > 0 and items[i] == items[i - 1] for i in range(len(items))]
    memo: dict[tuple[int, int, int], tuple[int, tuple[int, ...]] | None] = {}

    def best(i: int, mask: int, min_start: int) -> tuple[int, tuple[int, ...]] | None:
        if i == len(items):
            return 0, ()
        key = (i, mask, min_start)
        if key not in memo:
            result = None
            for k, (s, m, score) in enumerate(options[i]):
                if m & mask or s < min_start:
                    continue
                sub = best(i + 1, mask | m, s + 1 if i + 1 < len(items) and twin[i + 1] else 0)
                if sub is not None and (result is None or score + sub[0] > result[0]):
                    result = (score + sub[0], (k,) + sub[1])
            memo[key] = result
        return memo[key]

    found = best(0, 0, 0)
    if found is None:
        return None
    placed = [(p, options[i][k][0]) for i, (p, k) in enumerate(zip(items, found[1], strict=True))]
    kept = sorted(at[pl].id for pl in placed if pl in at)
    create = tuple(sorted((p, s) for p, s in placed if (p, s) not in at))
    doomed = tuple(sorted(c.id for c in existing if c.id not in kept))
    return CiLayout(tuple(kept), doomed, create, tuple(sorted(placed)))


def _by_count(profiles: dict[int, CiProfile], want: Sequence[int], existing: Sequence[ExistingCi],
              gi_slices: int | None) -> CiLayout | None:
    if gi_slices is not None and sum(profiles[p].slices for p in want) > gi_slices:
        return None
    need = Counter(want)
    kept, doomed = [], []
    for c in sorted(existing, key=lambda c: (not c.busy, c.id)):
        if need[c.profile_id] > 0:
            need[c.profile_id] -= 1
            kept.append(c.id)
        else:
            doomed.append(c.id)
    create = tuple((p, None) for p in sorted(need.elements()))
    return CiLayout(tuple(sorted(kept)), tuple(sorted(doomed)), create)


def fits(ci_profiles: Sequence[CiProfile], want: Sequence[int], gi_slices: int) -> bool:
    """Whether the CIs `want` can share one empty GI of `gi_slices` compute slices."""
    return place_cis(ci_profiles, want, gi_slices=gi_slices) is not None
