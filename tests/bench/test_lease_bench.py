"""The lease benchmark's churn at CI scale: both placements stay valid by the simulator's rules,
and gpud's rule refuses no more than first-fit on the same seeded requests."""

from __future__ import annotations

from bench.lease_bench import churn


def test_small_churn_is_valid_and_no_worse_than_first_fit():
    gpud, first_fit = churn("h100-80gb", 600, 27, 16.0)
    assert gpud.invalid == first_fit.invalid == 0
    assert gpud.granted + gpud.refused == first_fit.granted + first_fit.refused == 600
    assert gpud.refused_with_room <= first_fit.refused_with_room
    assert gpud.refused_on_one_gpu <= first_fit.refused_on_one_gpu <= first_fit.refused_with_room
