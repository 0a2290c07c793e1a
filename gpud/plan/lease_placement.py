"""Where a leased MIG instance goes: which dynamic GPU, which placement. Pure (no I/O).

Why a rule at all: NVML (and every scheduler that leaves placement to it) puts a 1-slice GI at the
first free start of a fixed preference order (6, 4, 5, 0, ...), which on an H100 leaves slice 7
usable by nothing smaller than a 3g and splits the GPU in two; a few leases later a 3g.40gb no
longer fits although half the GPU is free. Leases come and go one at a time, so there is no whole
layout to solve (gpud.plan.placement does that for the file); each lease is placed so that the
largest profiles stay placeable. The rule, compared in this order (smallest wins):

1. **scarcity**: per GI profile, the demand for it lately (`asked`: each request adds 1, older ones
   fade by DEMAND_MEMORY) times how much scarcer the placement makes it host-wide (1/(n+1), n the
   instances of it that still fit on all dynamic GPUs together): giving up one of many 1g slots
   costs little, the host's last 4g or 7g slot the most, a profile nobody asks for nothing;
2. **dead slices**: free memory slices that no placement of any profile could use any more
   (1g at 6 on an H100 kills slice 7 for everything but 3g/7g, which the 1g then blocks);
3. **the hole** (best fit): the size of the run of free slices the placement sits in, so small
   leases fill the gaps already cut, and across GPUs a used GPU is filled before an empty one is cut;
4. **the largest run left** in that GPU, larger first (a lease sits at the edge of its hole);
5. **what it costs the large profiles on that GPU**: per GI profile, largest first, how many
   instances of it could still be placed there before minus after (lexicographic);
6. pack: the fuller GPU first; then the GPU's index, then the start.

`policy.lease-placement: spread` puts one key before all of these, the GPU with the most free
memory slices first, and prefers the emptier GPU at 6 (leases spread over GPUs, each GPU still
filled by the rule above). The rule
reaches the seed's partial layout on an empty H100 80GB lease by lease: 1g.10gb at 0, 1, 2, then
3g.40gb at 4, then 1g.10gb at 3 (tests/plan/test_lease_placement.py). Foreign instances (made by
someone else) are occupied slices like any other: never chosen, never moved.

Alternatives measured on bench/lease_bench.py's churn (8 x H100, loads 12-24, seeds 27, 1, 2) did
no better than this rule by more than a few percent of first-fit's refusals: the scarcity as
r**n (r 0.5-0.9) instead of 1/(n+1); a lexicographic key (empty GPUs kept, then 4g, 3g, 2g ...
slots host-wide); small and half-GPU profiles segregated onto separate GPUs (worse within a GPU);
even a rule told each lease's end in advance. What keeps the heavy loads above half of first-fit's
refusals with room are refusals whose free slices lie scattered over GPUs, which only moving
running instances would join (bench/results/leases.md counts them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
from msgspec import Struct

from gpud.layout.desired import DesiredGpu
from gpud.layout.names import find_profile, sorted_names
from gpud.layout.schema import Policy
from gpud.model import CiProfile, Gpu, MigProfile, Placement
from gpud.profiles import by_device


class Room(Struct, frozen=True):
    """One dynamic GPU as a lease sees it: its profiles and the GIs on it now (anyone's)."""

    pci: str
    index: int
    profiles: tuple[MigProfile, ...]
    used: tuple[tuple[int, Placement], ...] = ()  # (GI profile id, placement) of every GI present
    where: str = ""  # "GPU 0 (0000:3b:00.0, NVIDIA H100 80GB HBM3)"


class Choice(Struct, frozen=True):
    """Where the lease goes: the GI profile and placement, and the CI made inside it."""

    pci: str
    profile: MigProfile
    placement: Placement
    ci: CiProfile
    name: str  # the MIG device name as asked ("1g.10gb", "1c.3g.40gb")


class NoRoom(Struct, frozen=True):
    """No dynamic GPU has room: `message` names the shortfall (what is free where, what fits)."""

    message: str


class UnknownProfile(Struct, frozen=True):
    message: str


def slices_of(profiles: Sequence[MigProfile]) -> int:
    """Memory slices of the GPU: the end of its farthest-reaching placement."""
    return max((pl.start + pl.size for p in profiles for pl in p.placements), default=0)


def _mask(p: Placement) -> int:
    return ((1 << p.size) - 1) << p.start


def _used_mask(room: Room) -> int:
    m = 0
    for _, pl in room.used:
        m |= _mask(pl)
    return m


def _left(room: Room, profile: MigProfile, extra: int = 0) -> int:
    """Instances of `profile` the GPU still allows (its instance count minus those present)."""
    return profile.instance_count - extra - sum(1 for pid, _ in room.used if pid == profile.id)


def free_placements(room: Room, profile: MigProfile, mask: int | None = None) -> list[Placement]:
    """Placements of `profile` whose slices are all free now (its instance count allowing)."""
    mask = _used_mask(room) if mask is None else mask
    if _left(room, profile) < 1:
        return []
    return [pl for pl in sorted(profile.placements) if not _mask(pl) & mask]


def _placeable(profile: MigProfile, mask: int, left: int) -> int:
    """How many GIs of `profile` fit at once in the free slices: earliest end first is optimal for
    intervals on a line; bounded by the instances the profile has left."""
    count, taken = 0, mask
    for pl in sorted(profile.placements, key=lambda p: (p.start + p.size, p.start)):
        if count >= left:
            break
        if not _mask(pl) & taken:
            taken |= _mask(pl)
            count += 1
    return count


def _runs(mask: int, total: int) -> list[tuple[int, int]]:
    """Runs of free slices as (start, length)."""
    out, start = [], None
    for s in range(total + 1):
        free = s < total and not mask >> s & 1
        if free and start is None:
            start = s
        elif not free and start is not None:
            out.append((start, s - start))
            start = None
    return out


def _dead(profiles: Sequence[MigProfile], mask: int, total: int, room: Room, new_pid: int | None) -> int:
    """Free slices no free placement of any profile with instances left covers."""
    covered = 0
    for p in profiles:
        if _left(room, p, 1 if p.id == new_pid else 0) < 1:
            continue
        for pl in p.placements:
            if not _mask(pl) & mask:
                covered |= _mask(pl)
    return sum(1 for s in range(total) if not mask >> s & 1 and not covered >> s & 1)


def _by_size(profiles: Sequence[MigProfile]) -> list[MigProfile]:
    return sorted(profiles, key=lambda p: (-(p.placements[0].size if p.placements else 0), -p.slices, p.id))


def _host_capacity(rooms: Sequence[Room]) -> tuple[list[MigProfile], list[list[int]], list[int]]:
    """(profiles largest first, per room how many of each still fit, per profile the host's total)."""
    profs = _by_size(rooms[0].profiles) if rooms else []
    profs = [p for p in profs if p.placements]
    per_room = [[_placeable(p, _used_mask(r), _left(r, p)) if any(q.id == p.id for q in r.profiles) else 0
                 for p in profs] for r in rooms]
    return profs, per_room, [sum(c[j] for c in per_room) for j in range(len(profs))]


def scarcity_cost(room: Room, profile: MigProfile, pl: Placement, profs: Sequence[MigProfile],
                  here: Sequence[int], host: Sequence[int], demand: Mapping[str, float]) -> float:
    """What putting `profile` at `pl` costs the requests to come: per GI profile, the demand for it
    times how much scarcer it becomes host-wide (1/(n+1) with n the instances of it that still fit
    on all dynamic GPUs together): losing one of many 1g slots costs little, losing the host's last
    4g slot costs the most, and a profile nobody asks for costs nothing."""
    after = _used_mask(room) | _mask(pl)
    cost = 0.0
    for j, p in enumerate(profs):
        weight = demand.get(p.name, 0.0)
        if not weight or not any(q.id == p.id for q in room.profiles):
            continue
        left = _placeable(p, after, _left(room, p, 1 if p.id == profile.id else 0))
        cost += weight * (1 / (host[j] - here[j] + left + 1) - 1 / (host[j] + 1))
    return round(cost, 9)


def score(room: Room, profile: MigProfile, pl: Placement, *, spread: bool = False, cost: float = 0.0) -> tuple:
    """The rule's key for putting a GI of `profile` at `pl` on `room` (smaller is better); `cost`:
    its scarcity cost (`scarcity_cost`)."""
    total = slices_of(room.profiles)
    before = _used_mask(room)
    after = before | _mask(pl)
    hole = next(n for s, n in _runs(before, total) if s <= pl.start < s + n)
    largest_left = max((n for _, n in _runs(after, total)), default=0)
    used_before = bin(before).count("1")
    loss = tuple(
        _placeable(p, before, _left(room, p)) - _placeable(p, after, _left(room, p, 1 if p.id == profile.id else 0))
        for p in _by_size(room.profiles) if p.placements
    )
    return (cost, _dead(room.profiles, after, total, room, profile.id), hole, -largest_left, loss,
            used_before if spread else -used_before, room.index, pl.start)


DEMAND_MEMORY = 0.995  # each request keeps this much of the weight of those before it (~200 requests)


def asked(demand: Mapping[str, float], gi_name: str, keep: float = DEMAND_MEMORY) -> dict[str, float]:
    """The demand after one more request for GI profile `gi_name`: older requests fade, so the
    rule follows what the scheduler asks for now."""
    out = {k: v * keep for k, v in demand.items() if v * keep > 1e-6}
    out[gi_name] = out.get(gi_name, 0.0) + 1.0
    return out


def resolve_name(name: str, profiles: Sequence[MigProfile]) -> tuple[MigProfile, CiProfile] | None:
    """A MIG device name as the layout takes it -> (GI profile, the CI a lease makes in it)."""
    found = find_profile(name, profiles)
    if found is None:
        return None
    gi, ci = found
    if ci is None:
        ci = next((c for c in sorted(gi.ci_profiles, key=lambda c: c.id) if c.slices == gi.slices), None)
        if ci is None:
            return None
    return gi, ci


def choose(name: str, rooms: Sequence[Room], *, spread: bool = False,
           demand: Mapping[str, float] | None = None) -> Choice | NoRoom | UnknownProfile:
    """The best (GPU, placement) for one MIG device `name` over `rooms` (see the module docstring).
    `demand`: GI profile name -> how often it was asked for lately (None: this request's only)."""
    best: tuple | None = None
    choice: Choice | None = None
    known = False
    profs, per_room, host = _host_capacity(rooms)
    for i, room in enumerate(rooms):
        found = resolve_name(name, room.profiles)
        if found is None:
            continue
        known = True
        gi, ci = found
        weights = demand if demand else {gi.name: 1.0}
        for pl in free_placements(room, gi):
            cost = scarcity_cost(room, gi, pl, profs, per_room[i], host, weights)
            key = score(room, gi, pl, spread=spread, cost=cost)
            if spread:
                key = (-(slices_of(room.profiles) - bin(_used_mask(room)).count("1")),) + key
            if best is None or key < best:
                best, choice = key, Choice(room.pci, gi, pl, ci, name)
    if choice is not None:
        return choice
    if not known:
        offered = sorted({n for r in rooms for n in sorted_names(r.profiles)})
        if not rooms:
            return UnknownProfile("no dynamic GPU (mig-devices: dynamic) is in the layout in force")
        return UnknownProfile(f"{name} is not a MIG profile of any dynamic GPU; valid: {', '.join(offered)}")
    return NoRoom(shortfall(name, rooms))


def exact(name: str, room: Room, start: int) -> Choice | NoRoom | UnknownProfile:
    """A caller that picked the placement itself (a DRA scheduler): `name` at `start` on `room`,
    refused unless that placement is one the profile offers and free now."""
    found = resolve_name(name, room.profiles)
    if found is None:
        return UnknownProfile(f"{name} is not a MIG profile of {room.where or room.pci}; "
                              f"valid: {', '.join(sorted_names(room.profiles))}")
    gi, ci = found
    pl = next((p for p in gi.placements if p.start == start), None)
    if pl is None:
        starts = ",".join(str(p.start) for p in sorted(gi.placements))
        return NoRoom(f"{name} cannot start at {start} on {room.where or room.pci} (allowed starts: {starts})")
    if pl not in free_placements(room, gi):
        return NoRoom(f"{name} at {pl.start}:{pl.size} on {room.where or room.pci} is not free: "
                      f"{describe_room(room)}")
    return Choice(room.pci, gi, pl, ci, name)


def describe_room(room: Room) -> str:
    """`free slices 4-7 (4 of 8); fits 3g.40gb x1, 1g.10gb x3, ...`"""
    total = slices_of(room.profiles)
    mask = _used_mask(room)
    runs = _runs(mask, total)
    free = sum(n for _, n in runs)
    where = ", ".join(f"{s}" if n == 1 else f"{s}-{s + n - 1}" for s, n in runs) or "none"
    fits = [f"{p.name} x{n}" for p in _by_size(room.profiles) if p.placements
            and (n := _placeable(p, mask, _left(room, p)))]
    return f"free memory slices {where} ({free} of {total}); fits {', '.join(fits) or 'nothing'}"


def capacity(room: Room) -> dict[str, int]:
    """Per GI profile, how many more leases of it fit on the GPU now (each alone, not together)."""
    mask = _used_mask(room)
    return {p.name: _placeable(p, mask, _left(room, p)) for p in _by_size(room.profiles) if p.placements}


def shortfall(name: str, rooms: Sequence[Room]) -> str:
    """What each dynamic GPU has free and what would fit there, for a refused lease."""
    per = "; ".join(f"{r.where or r.pci}: {describe_room(r)}" for r in rooms)
    return f"no dynamic GPU has room for {name}: {per}"


def room_of(gpu: Gpu, profiles: tuple[MigProfile, ...], used: Sequence[tuple[int, Placement]], where: str) -> Room:
    return Room(gpu.pci, gpu.index, profiles, tuple(used), where)


def dynamic_mode(gpu: Gpu, desired: DesiredGpu, policy: Policy | None) -> DesiredGpu:
    """What the static pass does on a dynamic GPU: only the MIG mode, and only where leases cannot
    see to it themselves. Ampere needs a reset to change it, so there it stays as `mig-enabled`
    says (the pass turns it on, with the reset, as for a static GPU); `policy.lease-mig-mode: keep-on`
    keeps it on everywhere. Instances are never planned here: with MIG already on, nothing is asked
    (mig_enabled None); with MIG off there are none to keep."""
    nv = gpu.nvml
    arch = by_device(gpu.function.device)
    keep_on = (arch is not None and arch.mode_change_needs_reset) or (
        policy is not None and policy.lease_mig_mode == "keep-on")
    if nv is None or not keep_on or not desired.mig_enabled or nv.mig_mode == 1:
        return msgspec.structs.replace(desired, mig_enabled=None, mig_devices={}, dynamic=False)
    return msgspec.structs.replace(desired, mig_enabled=True, mig_devices={}, dynamic=False)
