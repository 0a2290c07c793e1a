"""Exact-cover placement of GPU instances over a GPU's memory slices, keeping what already exists.

Why: NVML picks a slot itself when no placement is given, so creation order decides whether a layout
fits (mig-parted tries permutations and still destroys everything). Solving the whole layout first
and creating every GI at an explicit start makes order irrelevant and lets untouched instances stay.

The search is a memoised depth-first search over (next instance, occupied-slice mask, lowest start
allowed for an identical twin). A 7-slice GPU has 8 memory slices and at most 7 GIs, so the state
space is a few thousand entries at most; the objective is additive per (instance, placement) because
existing GIs never overlap, which is what makes memoisation exact.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from msgspec import Struct

from gpud.model import MigProfile, Placement
from gpud.plan.ci_placement import ExistingCi, place_cis

# Objective weights (lexicographic in one integer): a kept busy MIG device beats any number of idle
# ones (destroying it blocks the plan), a kept MIG device beats any number of kept empty GIs.
# A GPU has at most 8 GIs and 7 CIs, so the lower terms never reach the next weight.
W_BUSY = 1 << 10
W_CI = 1 << 4
W_GI = 1


class GiSpec(Struct, frozen=True, order=True):
    """One wanted GPU instance: its GI profile id and the CI profile ids inside it (sorted)."""

    profile_id: int
    cis: tuple[int, ...] = ()


class ExistingGi(Struct, frozen=True):
    """A GPU instance present now. `busy_cis`: CI profile ids of its CIs that have holders."""

    id: int
    profile_id: int
    placement: Placement
    cis: tuple[int, ...] = ()
    busy_cis: tuple[int, ...] = ()
    ci_slots: tuple[ExistingCi, ...] = ()  # its CIs with their placements, when read


class Assignment(Struct, frozen=True, order=True):
    """Where one wanted GI goes; `keep` is the id of the existing GI reused in place (else None)."""

    spec: GiSpec
    placement: Placement
    keep: int | None = None


class Infeasible(ValueError):
    """The wanted instances cannot coexist on this GPU; the message says why in layout terms."""


def kept_cis(have: Iterable[int], busy: Iterable[int], want: Iterable[int]) -> tuple[int, int]:
    """(CIs kept, busy CIs kept) when an existing GI's CI set is turned into `want` in place.
    Per CI profile min(have, want) survive; busy ones are the ones chosen to survive."""
    h, b, w = Counter(have), Counter(busy), Counter(want)
    kept = busy_kept = 0
    for pid, n in h.items():
        k = min(n, w[pid])
        kept += k
        busy_kept += min(b[pid], k)
    return kept, busy_kept


def keep_score(spec: GiSpec, gi: ExistingGi, profile: MigProfile | None = None) -> int:
    """What reusing `gi` for `spec` saves (0 when the profile differs: it cannot be reused). With
    the CIs' placements known, only CIs whose slot survives count (ci_placement.place_cis);
    otherwise per-profile counts do."""
    if gi.profile_id != spec.profile_id:
        return 0
    layout = None
    if profile is not None and gi.ci_slots:
        layout = place_cis(profile.ci_profiles, spec.cis, gi.ci_slots, gi_slices=profile.slices)
    if layout is not None:
        kept = len(layout.kept)
        busy = sum(1 for c in gi.ci_slots if c.busy and c.id in layout.kept)
    else:
        kept, busy = kept_cis(gi.cis, gi.busy_cis, spec.cis)
    return W_BUSY * busy + W_CI * kept + W_GI


def describe(counts: Counter[int] | dict[int, int], names: dict[int, str]) -> str:
    """`2 x 3g.71gb + 1 x 4g.71gb`, largest profiles first (order of the table otherwise)."""
    order = list(names)
    rank = {pid: i for i, pid in enumerate(order)}
    items = sorted(((pid, n) for pid, n in counts.items() if n), key=lambda x: rank.get(x[0], len(rank)))
    return " + ".join(f"{n} x {names.get(pid, f'profile {pid}')}" for pid, n in items)


def _mask(p: Placement) -> int:
    return ((1 << p.size) - 1) << p.start


def solve(
    profiles: Sequence[MigProfile],
    desired: Sequence[GiSpec],
    existing: Sequence[ExistingGi] = (),
    *,
    where: str = "this GPU",
) -> list[Assignment]:
    """Place every wanted GI. Among feasible layouts the one with the highest keep score wins;
    ties go to the lexicographically smallest starts in (largest size, profile id, CIs) order,
    so the answer depends only on the inputs. Raises Infeasible with an actionable reason.

    `where` names the GPU in messages ("NVIDIA H200 0000:3b:00.0")."""
    by_id = {p.id: p for p in profiles}
    def size(p: MigProfile) -> int:
        return p.placements[0].size if p.placements else 0

    names = {p.id: p.name for p in sorted(profiles, key=lambda p: (-size(p), -p.slices, p.id))}
    counts = Counter(s.profile_id for s in desired)
    for pid in counts:
        if pid not in by_id or not by_id[pid].placements:
            raise Infeasible(f"GPU instance profile id {pid} is not offered by {where}")
    over = [(pid, n) for pid, n in counts.items() if n > by_id[pid].instance_count]
    if over:
        pid, n = over[0]
        cap = by_id[pid].instance_count
        raise Infeasible(f"{n} x {names[pid]} exceeds the {cap} instance{'' if cap == 1 else 's'} "
                         f"allowed on {where}")
    total = max((pl.start + pl.size for p in profiles for pl in p.placements), default=0)
    need = sum(by_id[pid].placements[0].size * n for pid, n in counts.items())
    if need > total:
        raise Infeasible(f"{describe(counts, names)} needs {need} of {total} memory slices on {where}")

    items = sorted(desired, key=lambda s: (-by_id[s.profile_id].placements[0].size, s.profile_id, s.cis))
    # Existing GI by (profile, start): unique because existing GIs do not overlap.
    at = {(g.profile_id, g.placement.start): g for g in existing}
    options: list[list[tuple[Placement, int, int, int | None]]] = []
    for s in items:
        opts = []
        for pl in sorted(by_id[s.profile_id].placements):
            g = at.get((s.profile_id, pl.start))
            keep = g if g is not None and g.placement == pl else None
            opts.append((pl, _mask(pl), keep_score(s, keep, by_id[s.profile_id]) if keep else 0,
                         keep.id if keep else None))
        options.append(opts)
    twin = [i > 0 and items[i] == items[i - 1] for i in range(len(items))]
    memo: dict[tuple[int, int, int], tuple[int, tuple[int, ...]] | None] = {}
    n_items = len(items)

    def best(i: int, mask: int, min_start: int) -> tuple[int, tuple[int, ...]] | None:
        """Best (score, option indexes) for items[i:], or None when they cannot be placed."""
        if i == n_items:
            return 0, ()
        key = (i, mask, min_start)
        if key in memo:
            return memo[key]
        result: tuple[int, tuple[int, ...]] | None = None
        for k, (pl, m, score, _) in enumerate(options[i]):
            if m & mask or pl.start < min_start:
                continue
            nxt_min = pl.start + 1 if i + 1 < n_items and twin[i + 1] else 0
            sub = best(i + 1, mask | m, nxt_min)
            if sub is not None and (result is None or score + sub[0] > result[0]):
                result = (score + sub[0], (k,) + sub[1])
        memo[key] = result
        return result

    found = best(0, 0, 0)
    if found is None:
        raise Infeasible(_conflict(items, by_id, names, counts, where))
    out = []
    for i, (s, k) in enumerate(zip(items, found[1], strict=True)):
        pl, _, _, keep_id = options[i][k]
        out.append(Assignment(s, pl, keep_id))
    return out


def _conflict(items: list[GiSpec], by_id: dict[int, MigProfile], names: dict[int, str],
              counts: Counter[int], where: str) -> str:
    """Why the slices add up but the starts do not: the allowed starts and the largest subset that fits."""
    starts = "; ".join(
        f"{names[pid]} at {','.join(str(p.start) for p in sorted(by_id[pid].placements))}"
        for pid in names if pid in counts
    )
    fit = largest_fit([s.profile_id for s in items], by_id)
    return (f"{describe(counts, names)} cannot be placed on {where}: the allowed starts ({starts}) "
            f"leave them overlapping; the most that fits is {describe(fit, names) or 'nothing'}")


def largest_fit(profile_ids: Sequence[int], by_id: dict[int, MigProfile]) -> Counter[int]:
    """Largest sub-multiset (most instances, then most memory slices) that can be placed."""
    ids = sorted(profile_ids, key=lambda pid: (-by_id[pid].placements[0].size, pid))
    memo: dict[tuple[int, int], tuple[tuple[int, int], tuple[int, ...]]] = {}

    def go(i: int, mask: int) -> tuple[tuple[int, int], tuple[int, ...]]:
        if i == len(ids):
            return (0, 0), ()
        if (i, mask) in memo:
            return memo[(i, mask)]
        (c, m), chosen = go(i + 1, mask)  # skip this one
        res = ((c, m), chosen)
        for pl in by_id[ids[i]].placements:
            bits = _mask(pl)
            if bits & mask:
                continue
            (c2, m2), ch2 = go(i + 1, mask | bits)
            cand = ((c2 + 1, m2 + pl.size), (ids[i],) + ch2)
            if cand[0] > res[0]:
                res = cand
        memo[(i, mask)] = res
        return res

    return Counter(go(0, 0)[1])
