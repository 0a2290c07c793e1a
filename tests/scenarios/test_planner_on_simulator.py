"""Property test on the product simulator: random current layouts and random targets, applied by
gpud's reconciler through the fake NVML library (not the planner's own pure model).

Always: a feasible target is reached exactly; an infeasible one is reported and changes nothing
(feasibility cross-checked by an oracle that shares no code with the planner: a brute-force
search over every placement combination); no instance that sits
at the same place with the same profile before and after was destroyed (its MIG UUID is unchanged);
and applying the result again makes no NVML mutating call.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpud.profiles import MODELS
from tests.plan.hwmodel import names_of
from tests.scenarios.definitions import layout, mig
from tests.support.simrig import SimRig

MODELS_UNDER_TEST = ("a100-40gb", "h100-80gb", "h200")


def targets(model: str):
    names = names_of(MODELS[model].profiles)
    return st.dictionaries(st.sampled_from(names), st.integers(1, 3), min_size=1, max_size=3)


def feasible(model: str, devices: dict[str, int]) -> bool:
    """Independent oracle (no gpud.plan code): pack each `mig-devices` entry into GPU instances as
    the README's layout.yaml section defines it (`Nc.<gi>`: as many per GI as its slices and the CI
    profile's instance count allow), then search every placement combination of the profile table
    for one without overlapping memory slices and within each profile's instance count."""
    profiles = {p.name: p for p in MODELS[model].profiles}
    needed: list = []
    for name, count in devices.items():
        ci_part, _, gi_name = name.partition("c.") if name.split(".")[0].endswith("c") else ("", "", name)
        gi = profiles[gi_name]
        if ci_part:
            ci = next(c for c in gi.ci_profiles if c.slices == int(ci_part))
            per_gi = max(1, min(gi.slices // ci.slices, ci.instance_count))
        else:
            per_gi = 1
        needed += [gi] * -(-count // per_gi)
    needed.sort(key=lambda p: -max(pl.size for pl in p.placements))

    def place(i: int, used: frozenset, counts: Counter) -> bool:
        if i == len(needed):
            return True
        gi = needed[i]
        if counts[gi.id] >= gi.instance_count:
            return False
        for pl in gi.placements:
            cells = frozenset(range(pl.start, pl.start + pl.size))
            if not cells & used and place(i + 1, used | cells, counts + Counter({gi.id: 1})):
                return True
        return False

    return place(0, frozenset(), Counter())


async def _run(model: str, before: dict[str, int], after: dict[str, int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rig = SimRig(Path(tmp), (model,))
        try:
            await rig.apply(layout(mig([0], before)))
            start = rig.mig_devices()[0]
            calls = rig.calls()
            taken = await rig.apply(layout(mig([0], after)))
            end = rig.mig_devices()[0]
            if feasible(model, after):
                state = rig.rec.gpu_states[rig.rec.observation.gpus[0].pci]
                assert taken and state.state == "converged", (before, after, state, rig.rec.layout_issues)
                assert Counter(n for n, _, _ in end.values()) == Counter(after), (after, end)
            else:  # one verdict per file (gpud.engine.feasibility): refused whole, naming the GPU
                assert not taken, after
                assert any("infeasible" in e for e in rig.rec.layout_issues[0]), rig.rec.layout_issues
                assert end == start and rig.mutating(calls) == 0
            for uuid, where in end.items():
                same_place = [u for u, w in start.items() if w == where]
                assert not same_place or same_place[0] == uuid, f"{where} destroyed and re-created"
            calls = rig.calls()
            await rig.apply(layout(mig([0], after)))
            assert rig.mutating(calls) == 0
        finally:
            rig.close()


@pytest.mark.parametrize("model", MODELS_UNDER_TEST)
def test_random_transitions_on_the_simulator(model: str) -> None:
    @settings(derandomize=True, max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(before=targets(model), after=targets(model))
    def check(before: dict[str, int], after: dict[str, int]) -> None:
        asyncio.run(_run(model, before, after))

    check()
