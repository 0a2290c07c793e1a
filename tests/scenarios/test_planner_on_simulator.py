"""Property test on the product simulator: random current layouts and random targets, applied by
gpud's reconciler through the fake NVML library (not the planner's own pure model).

Always: a feasible target is reached exactly; an infeasible one is reported and changes nothing
(feasibility cross-checked by brute force over every placement combination); no instance that sits
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

from gpud.plan.mig import desired_specs
from gpud.plan.placement import Infeasible
from gpud.profiles import MODELS
from tests.plan.test_mig_props import brute_best, names_of
from tests.scenarios.definitions import layout, mig
from tests.scenarios.harness import SimRig

MODELS_UNDER_TEST = ("a100-40gb", "h100-80gb", "h200")


def targets(model: str):
    names = names_of(MODELS[model].profiles)
    return st.dictionaries(st.sampled_from(names), st.integers(1, 3), min_size=1, max_size=3)


def feasible(model: str, devices: dict[str, int]) -> bool:
    try:
        specs = desired_specs(devices, MODELS[model].profiles, "test")
    except Infeasible:
        return False
    return brute_best(model, specs, []) is not None


async def _run(model: str, before: dict[str, int], after: dict[str, int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rig = SimRig(Path(tmp), (model,))
        try:
            await rig.apply(layout(mig([0], before)))
            start = rig.mig_devices()[0]
            calls = rig.calls()
            await rig.apply(layout(mig([0], after)))
            end = rig.mig_devices()[0]
            state = rig.rec.gpu_states[rig.rec.observation.gpus[0].pci]
            if feasible(model, after):
                assert state.state == "converged", (before, after, state)
                assert Counter(n for n, _, _ in end.values()) == Counter(after), (after, end)
            else:
                assert state.state == "failed", (after, state)
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
