"""How bench/mig_bench.py scores the other tool (issue 28, item 6): a run that exited non-zero is a
failure even where gpud's expected GPU state is not `converged`, unless the layout had to be refused
and nothing changed; each row names the simulator rules without a public source its outcome rests on."""

from __future__ import annotations

from bench import mig_bench
from tests.scenarios.definitions import SCENARIOS


class _Rig:
    """What `_matches` asks of a rig: the MIG mode of a GPU by index."""

    def __init__(self, modes: dict[int, int]) -> None:
        self.modes = modes

    def mig_mode(self, idx: int) -> int:
        return self.modes.get(idx, 0)


def _as_expected(sc) -> tuple[_Rig, dict]:
    after = {idx: {f"MIG-{idx}-{name}-{k}": (name, k, 0) for name, n in (want or {}).items() for k in range(n)}
             for idx, want in sc.expect.items()}
    return _Rig({idx: 1 if want is not None else 0 for idx, want in sc.expect.items()}), after


def test_an_exit_1_is_a_failure_even_where_the_scenario_does_not_converge():
    sc = next(s for s in SCENARIOS if s.state != "converged" and not s.unchanged and not s.fails_one_of)
    rig, after = _as_expected(sc)
    assert mig_bench._ok(rig, sc, {}, after, failed=1, exited=0)
    assert not mig_bench._ok(rig, sc, {}, after, failed=1, exited=1)


def test_a_refusal_is_the_answer_only_where_the_layout_must_be_refused_and_nothing_changed():
    sc = next(s for s in SCENARIOS if s.unchanged)
    rig, after = _as_expected(sc)
    assert mig_bench._ok(rig, sc, after, after, failed=1, exited=1)
    changed = {**after, 99: {"MIG-x": ("1g.10gb", 0, 0)}}
    assert not mig_bench._ok(rig, sc, after, changed, failed=1, exited=1)


def test_rows_name_the_unsourced_rules_they_rest_on():
    assert mig_bench._unsourced(unplaced_creates=3, resets=0) == "P"
    assert mig_bench._unsourced(unplaced_creates=0, resets=2) == "R"
    assert mig_bench._unsourced(unplaced_creates=1, resets=1) == "PR"
    assert mig_bench._unsourced(unplaced_creates=0, resets=0) == ""
    assert set(mig_bench.UNSOURCED) == {"P", "R"}
