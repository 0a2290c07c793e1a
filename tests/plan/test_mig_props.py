"""Property tests: planner plans applied to the hardware model, cross-checked by brute force.

The brute-force enumerator lists every non-overlapping set of allowed placements of the GPU (a few
hundred per model) and tries every distinct assignment of wanted GIs to slots, so it shares nothing
with the solver's search but the objective's definition.
"""

from __future__ import annotations

from collections import Counter
from functools import cache

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpud.layout.desired import DesiredGpu
from gpud.model import Holder, Placement
from gpud.plan.mig import ci_name, desired_specs, plan_gpu
from gpud.plan.placement import W_BUSY, W_CI, W_GI, ExistingGi, GiSpec
from gpud.profiles import MODELS
from tests.plan.hwmodel import MIG_MODELS, HwError, HwGpu, apply_steps, gpu_of, make_hw, names_of
from tests.support.present import present

PCI = "0000:3b:00.0"
SETTINGS = settings(derandomize=True, max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ---- brute force -------------------------------------------------------------------------------
@cache
def layouts(model: str) -> dict[tuple[tuple[int, int], ...], list[tuple[tuple[int, Placement], ...]]]:
    """Every layout of the model (respecting instance counts), indexed by its profile multiset."""
    profiles = MODELS[model].profiles
    count = {p.id: p.instance_count for p in profiles}
    by_start: dict[int, list[tuple[int, Placement]]] = {}
    for p in profiles:
        for pl in p.placements:
            by_start.setdefault(pl.start, []).append((p.id, pl))
    # Memory slices of the GPU: 8 on the 7-slice GPUs, 4 on the A30, 12 on the RTX PRO 6000.
    n_slices = max(pl.start + pl.size for p in profiles for pl in p.placements)
    out: dict = {}

    def rec(s: int, used: frozenset[int], acc: tuple) -> None:
        if s == n_slices:
            c = Counter(pid for pid, _ in acc)
            if all(n <= count[pid] for pid, n in c.items()):
                out.setdefault(tuple(sorted(c.items())), []).append(acc)
            return
        if s in used:
            rec(s + 1, used, acc)
            return
        rec(s + 1, used, acc)
        for pid, pl in by_start.get(s, []):
            if not (pl.slices & used):
                rec(s + 1, used | pl.slices, acc + ((pid, pl),))

    rec(0, frozenset(), ())
    return out


def distinct_perms(items: tuple) -> list[tuple]:
    if not items:
        return [()]
    out = []
    for x in sorted(set(items)):
        rest = list(items)
        rest.remove(x)
        out += [(x,) + p for p in distinct_perms(tuple(rest))]
    return out


def score(spec: GiSpec, ex: ExistingGi | None) -> int:
    if ex is None or ex.profile_id != spec.profile_id:
        return 0
    want, have, busy = Counter(spec.cis), Counter(ex.cis), Counter(ex.busy_cis)
    kept = {pid: min(n, want[pid]) for pid, n in have.items()}
    return W_BUSY * sum(min(busy[pid], k) for pid, k in kept.items()) + W_CI * sum(kept.values()) + W_GI


def brute_best(model: str, specs: list[GiSpec], existing: list[ExistingGi]) -> int | None:
    """Best keep score over all feasible layouts, None when no layout holds the specs."""
    key = tuple(sorted(Counter(s.profile_id for s in specs).items()))
    at = {(e.profile_id, e.placement): e for e in existing}
    best = None
    for lay in layouts(model).get(key, []):
        total = 0
        for pid in {p for p, _ in lay}:
            slots = [pl for p, pl in lay if p == pid]
            mine = tuple(sorted(s for s in specs if s.profile_id == pid))
            total += max(sum(score(s, at.get((pid, pl))) for s, pl in zip(perm, slots, strict=True))
                         for perm in distinct_perms(mine))
        best = total if best is None or total > best else best
    return best


# ---- strategies --------------------------------------------------------------------------------
@st.composite
def current_state(draw, model: str) -> HwGpu:
    hw = make_hw(model, PCI, mode=draw(st.sampled_from([1, 1, 1, 0])))
    if hw.mode == 0:
        return hw
    profiles = hw.profiles
    ops = draw(st.lists(st.tuples(st.integers(0, len(profiles) - 1), st.integers(0, 6),
                                  st.integers(0, 3), st.booleans()), max_size=8))
    pid = 1000
    for pi, si, how, busy in ops:
        p = profiles[pi]
        try:
            gid = hw.create_gi(p.id, p.placements[si % len(p.placements)].start)
        except HwError:
            continue
        cis = sorted(p.ci_profiles, key=lambda c: c.slices)
        if how == 0:
            plan = [max(cis, key=lambda c: c.slices)]
        elif how == 1:
            plan = [cis[0]] * min(p.slices, cis[0].instance_count)
        elif how == 2:
            plan = [cis[0], cis[-1]] if len(cis) > 1 else []
        else:
            plan = []
        for c in plan:
            try:
                hw.create_ci(gid, c.id)
            except HwError:
                pass
        if busy and hw.gis[gid].cis:
            ci = next(iter(hw.gis[gid].cis.values()))
            pid += 1
            ci.holders = (Holder(pid, "job", ci.uuid),)
    return hw


def desired_devices(model: str):
    return st.dictionaries(st.sampled_from(names_of(MODELS[model].profiles)), st.integers(1, 4), max_size=4)


@st.composite
def desired_near(draw, model: str, hw: HwGpu) -> dict[str, int]:
    """Half the time a small edit of what the GPU has now: where keeping instances matters."""
    if draw(st.booleans()):
        return draw(desired_devices(model))
    devs = Counter(mig_devices(hw))
    names = names_of(MODELS[model].profiles)
    for name, delta in draw(st.lists(st.tuples(st.sampled_from(names), st.integers(-2, 2)), max_size=2)):
        devs[name] = max(0, devs[name] + delta)
    return {n: c for n, c in devs.items() if c > 0}


def existing_of(hw: HwGpu) -> list[ExistingGi]:
    return [ExistingGi(gid, g.profile_id, g.placement, tuple(sorted(c.profile_id for c in g.cis.values())),
                       tuple(sorted(c.profile_id for c in g.cis.values() if c.holders)))
            for gid, g in hw.gis.items()] if hw.mode == 1 else []


def release(hw: HwGpu) -> None:
    """The processes that blocked the plan have gone (what on-busy=wait waits for)."""
    hw.processes = ()
    for g in hw.gis.values():
        for c in g.cis.values():
            c.holders = ()


def mig_devices(hw: HwGpu) -> Counter[str]:
    by_id = {p.id: p for p in hw.profiles}
    return Counter(ci_name(by_id[g.profile_id], c.profile_id, g.profile_id)
                   for g in hw.gis.values() for c in g.cis.values())


# ---- properties --------------------------------------------------------------------------------
@pytest.mark.parametrize("model", MIG_MODELS)
@SETTINGS
@given(data=st.data())
def test_plan_reaches_desired_keeps_optimum_and_is_idempotent(model: str, data) -> None:
    hw = data.draw(current_state(model), label="current")
    devs = data.draw(desired_near(model, hw), label="mig-devices")
    desired = DesiredGpu(PCI, 0, "layouts.prop[0]", mig_enabled=True, mig_devices=devs)
    gpu = gpu_of(hw)
    p = plan_gpu(gpu, desired)
    specs = desired_specs(devs, hw.profiles, "x")
    existing = existing_of(hw)
    best = brute_best(model, specs, existing)
    event("infeasible" if best is None else "feasible")
    if best is None:
        assert p.infeasible, f"brute force finds no layout for {devs}, planner says feasible"
        assert p.steps == []
        return
    assert p.infeasible is None, f"brute force finds a layout for {devs}: {p.infeasible}"

    # The solver keeps as much as the best possible layout does.
    ex = {e.id: e for e in existing}
    assert p.target is not None
    got = sum(score(GiSpec(t.profile_id, t.ci_profile_ids), ex[t.gi]) for t in p.target if t.gi is not None)
    assert got == best
    event("keeps some" if p.kept else "keeps none")
    event("blocked" if p.blocked_by else "not blocked")
    ci_only = any(s.action.endswith("-ci") and s.gi is not None for s in p.steps)
    event("CI change in a kept GI" if ci_only else "no CI-only change")

    # Every MIG device present now is either kept or listed as destroyed; busy destroyed block the plan.
    before = hw.uuids()
    gone = {d.uuid for d in p.destroyed if d.uuid}
    assert set(p.kept) | gone == set(before) and not set(p.kept) & gone
    busy_gone = {h for d in p.destroyed for h in d.holders}
    assert busy_gone <= set(p.blocked_by)
    if not p.mode_change:
        assert set(p.blocked_by) == busy_gone

    release(hw)
    apply_steps(hw, p.steps)
    assert hw.mode == 1
    assert hw.layout() == sorted((s.profile_id, tuple(sorted(s.cis))) for s in specs)
    assert mig_devices(hw) == Counter({n: c for n, c in devs.items()})
    after = hw.uuids()
    assert all(u in after and after[u] == before[u] for u in p.kept), "a kept device moved or vanished"
    assert plan_gpu(gpu_of(hw), desired).steps == []


@pytest.mark.parametrize("model", MIG_MODELS)
@SETTINGS
@given(data=st.data())
def test_disable_always_clears_and_is_idempotent(model: str, data) -> None:
    hw = data.draw(current_state(model), label="current")
    desired = DesiredGpu(PCI, 0, "layouts.prop[0]", mig_enabled=False)
    p = plan_gpu(gpu_of(hw), desired)
    assert p.infeasible is None
    assert {h for d in p.destroyed for h in d.holders} <= set(p.blocked_by)
    release(hw)
    apply_steps(hw, p.steps)
    assert hw.mode == 0 and hw.gis == {}
    assert plan_gpu(gpu_of(hw), desired).steps == []


@pytest.mark.parametrize("model", MIG_MODELS)
@settings(derandomize=True, max_examples=400, deadline=None)
@given(data=st.data())
def test_feasibility_matches_brute_force_on_empty_gpu(model: str, data) -> None:
    devs = data.draw(desired_devices(model), label="mig-devices")
    hw = make_hw(model, PCI)
    p = plan_gpu(gpu_of(hw), DesiredGpu(PCI, 0, "e", mig_enabled=True, mig_devices=devs))
    feasible = brute_best(model, desired_specs(devs, hw.profiles, "x"), []) is not None
    assert (p.infeasible is None) == feasible, (devs, p.infeasible)
    if not feasible:
        assert f"{hw.name} {PCI}" in present(p.infeasible)


def test_brute_force_sanity() -> None:
    """The enumerator itself: a full GPU of 1g slices has exactly one layout, 7g exactly one."""
    lays = layouts("h100-80gb")
    assert len(lays[((19, 7),)]) == 1 and len(lays[((0, 1),)]) == 1
    assert len(lays[((9, 1), (19, 4))]) == 1  # 3g@4 + 1g@0..3
