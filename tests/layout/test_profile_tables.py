"""gpud's table of known models presents no figure it has no source for.

A field a model lists as unknown must hold the placeholder (0, (), a negative id) so that nothing
can read an invented number as fact, and a model with unknowns must not be simulated. The figures
themselves are compared with real captures in tests/sim/test_fidelity_captures.py.
"""

from __future__ import annotations

import pytest

from gpud.profiles import MODELS, PROFILE_FIELDS, WHOLE_GPU
from gpud.sim import catalog

PLACEHOLDER = {"memory_mb": 0, "sms": 0, "placements": (), "ci_profiles": (), "copy_engines": 0,
               "decoders": 0, "encoders": 0, "jpegs": 0, "ofas": 0, "instance_count": 0}


@pytest.mark.parametrize("key", sorted(MODELS))
def test_unknown_fields_hold_placeholders_only(key: str) -> None:
    m = MODELS[key]
    names = {p.name for p in m.profiles}
    for name, fields in m.unknown:
        assert fields and set(fields) <= set(PROFILE_FIELDS), (name, fields)
        if name == WHOLE_GPU:
            assert fields == ("memory_mb",) and m.memory_mb == 0
            continue
        assert name in names, name
        p = next(p for p in m.profiles if p.name == name)
        for f in fields:
            if f == "id":
                assert p.id < 0, name
            else:
                assert getattr(p, f) == PLACEHOLDER[f], (name, f)


@pytest.mark.parametrize("key", sorted(MODELS))
def test_known_ids_are_real_and_distinct(key: str) -> None:
    m = MODELS[key]
    ids = [p.id for p in m.profiles]
    assert len(set(ids)) == len(ids)
    assert len(set(m.gi_index.values())) == len(m.gi_index), "two profiles answer one NVML index"
    for p in m.profiles:
        assert (p.id < 0) == ("id" in m.unknown_fields(p.name)), p.name


def test_only_complete_models_are_simulated() -> None:
    partial = {k for k, m in MODELS.items() if m.unknown}
    assert {"b200", "gb200", "gh200-144gb"} <= partial  # gpud's own table keeps what no source gives unknown
    # the simulator serves them with its inferred cells, and says which (gpud/sim/inferred.py)
    assert set(catalog.offered()) == set(MODELS)
    for key in partial | {"gh200-96gb"}:
        assert catalog.model(key).inferred and not catalog.model(key).unknown, key
    assert {"a30", "rtx-pro-6000", "h200", "h100-80gb"} <= set(catalog.offered())
