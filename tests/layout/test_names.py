"""MIG device names: syntax, and lookup against each model's own table."""

from __future__ import annotations

import pytest

from gpud.layout.names import (
    MigName,
    ci_names,
    find_profile,
    parse_mig_name,
    sorted_names,
)
from gpud.profiles import MODELS
from tests.support.present import present

H100 = MODELS["h100-80gb"].profiles
H200 = MODELS["h200"].profiles
A100_40 = MODELS["a100-40gb"].profiles


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("1g.10gb", MigName(None, 1, 10, False, "")),
        ("1g.18gb+me", MigName(None, 1, 18, True, "+me")),
        ("1c.3g.40gb", MigName(1, 3, 40, False, "")),
        ("7g.141gb", MigName(None, 7, 141, False, "")),
        ("2c.2g.35gb", MigName(2, 2, 35, False, "")),
        ("1g.24gb+me.all", MigName(None, 1, 24, True, "+me.all")),
        ("1g.24gb-me", MigName(None, 1, 24, False, "-me")),
        ("1g.24gb+gfx", MigName(None, 1, 24, False, "+gfx")),
        ("2g.48gb+gfx", MigName(None, 2, 48, False, "+gfx")),
        ("2g.48gb+me.all", MigName(None, 2, 48, True, "+me.all")),
        ("2g.48gb-me", MigName(None, 2, 48, False, "-me")),
        ("1c.2g.48gb-me", MigName(1, 2, 48, False, "-me")),
        ("2g.12gb+me", MigName(None, 2, 12, True, "+me")),
    ],
)
def test_parse_valid(name: str, expected: MigName) -> None:
    assert parse_mig_name(name) == expected
    assert str(expected) == name


@pytest.mark.parametrize(
    "name",
    ["", "1g", "1g.10", "1g10gb", "g.10gb", "0g.10gb", "1g.0gb", "1G.10GB", "1g.10gb+", "1g.10gb+ME",
     "4c.3g.40gb", "0c.3g.40gb", "c.3g.40gb", "1c3g.40gb", " 1g.10gb", "1g.10gb ", "1g.10gib",
     "MIG 1g.10gb", "1g.10gb++me", "100g.10gb", "1g.10000gb", "1g.24gb+foo", "1g.24gb+me.al",
     "1g.24gb-gfx", "1g.24gb+me.all.x", "1g.24gb.me", "2g.48gb+gfx+me"],
)
def test_parse_invalid(name: str) -> None:
    assert parse_mig_name(name) is None


def test_parse_non_str_is_none() -> None:
    assert parse_mig_name(5) is None  # a non-str, on purpose


def test_gi_name() -> None:
    assert present(parse_mig_name("1c.3g.40gb")).gi_name == "3g.40gb"
    assert present(parse_mig_name("1g.10gb+me")).gi_name == "1g.10gb+me"


def test_find_profile_gi_only() -> None:
    profile, ci = present(find_profile("3g.71gb", H200))
    assert (profile.id, profile.name, ci) == (9, "3g.71gb", None)
    profile, ci = present(find_profile("1g.18gb+me", H200))
    assert (profile.id, ci) == (20, None)
    assert present(find_profile("1g.35gb", H200))[0].id == 15


def test_find_profile_with_ci() -> None:
    profile, ci = present(find_profile("1c.3g.40gb", H100))
    assert profile.id == 9 and ci is not None and (ci.slices, ci.id) == (1, 0)
    profile, ci = present(find_profile("3c.3g.40gb", H100))
    assert ci is not None and ci.slices == 3
    profile, ci = present(find_profile("4c.7g.80gb", H100))
    assert profile.id == 0 and ci is not None and ci.id == 3


def test_find_profile_ci_not_in_gi() -> None:
    assert find_profile("3c.4g.40gb", H100) is None  # a 4g splits into 1c, 2c, 4c
    assert find_profile("2c.4g.40gb", H100) is not None


def test_find_profile_per_model() -> None:
    """mig-parted #157: one name, resolved against each model's own table."""
    assert find_profile("1g.10gb", H100) is not None
    assert find_profile("1g.10gb", H200) is None
    assert present(find_profile("1g.10gb", A100_40))[0].id == 15  # the A100-40GB's double-memory 1g
    assert find_profile("1g.10gb", ()) is None
    assert find_profile("not a name", H100) is None


def test_sorted_names() -> None:
    assert sorted_names(H200) == ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]
    assert sorted_names(tuple(reversed(H200))) == sorted_names(H200)


def test_ci_names() -> None:
    four_g = present(find_profile("4g.40gb", H100))[0]
    assert ci_names(four_g) == ["1c.4g.40gb", "2c.4g.40gb", "4c.4g.40gb"]


@pytest.mark.parametrize(("name", "smaller"), [("1c.3g.40gb", True), ("2c.7g.80gb+me", True), ("3c.3g.40gb", False),
                                               ("3g.40gb", False), ("4c.3g.40gb", False), ("profile-9", False),
                                               ("", False), (None, False)])
def test_a_name_is_subdivided_only_when_its_ci_is_smaller_than_its_gi(name, smaller):
    from gpud.mig_text import subdivided

    assert subdivided(name) is smaller
