"""A mig-parted config (shaped like NVIDIA's default config.yaml) loads unchanged and resolves."""

from __future__ import annotations

import pytest

from gpud.layout import check_text, parse_layout
from tests.support.gpus import host
from tests.support.present import present

# NVIDIA's default mig-parted config, abridged: same keys, same forms (`mig-configs`, unquoted and
# quoted names, device-filter lists in mig-parted's 0xDEVICEVENDOR form, `mig-devices: {}`).
MIG_PARTED = """\
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false

  all-enabled:
    - devices: all
      mig-enabled: true
      mig-devices: {}

  # A100-40GB, A800-40GB
  all-1g.5gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 7

  all-1g.5gb.me:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb+me": 1

  all-1g.10gb:
    # H100-80GB, H800-80GB, A100-80GB, A800-80GB
    - device-filter: ["0x233010DE", "0x233110DE", "0x232210DE", "0x20B210DE", "0x20B510DE", "0x20F310DE", "0x20F510DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 7

    # A100-40GB, A800-40GB
    - device-filter: ["0x20B010DE", "0x20B110DE", "0x20F110DE", "0x20F610DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 4

  all-3g.40gb:
    - device-filter: 0x233010DE
      devices: all
      mig-enabled: true
      mig-devices:
        3g.40gb: 2

  all-balanced:
    # A100-40GB, A800-40GB
    - device-filter: ["0x20B010DE", "0x20B110DE", "0x20F110DE", "0x20F610DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 2
        "2g.10gb": 1
        "3g.20gb": 1

    # H100-80GB, H800-80GB, A100-80GB, A800-80GB
    - device-filter: ["0x233010DE", "0x233110DE", "0x232210DE", "0x20B210DE", "0x20B510DE", "0x20F310DE", "0x20F510DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 2
        "2g.20gb": 1
        "3g.40gb": 1

  custom-config:
    - devices: [0,1,2,3]
      mig-enabled: false
    - devices: [4]
      mig-enabled: true
      mig-devices:
        "1g.10gb": 7
    - devices: [5]
      mig-enabled: true
      mig-devices:
        "2g.20gb": 3
    - devices: [6]
      mig-enabled: true
      mig-devices:
        "3g.40gb": 2
    - devices: [7]
      mig-enabled: true
      mig-devices:
        "1g.10gb": 2
        "2g.20gb": 1
        "3g.40gb": 1
"""

CONFIGS = ["all-disabled", "all-enabled", "all-1g.5gb", "all-1g.5gb.me", "all-1g.10gb", "all-3g.40gb",
           "all-balanced", "custom-config"]


def test_loads_unchanged() -> None:
    p = parse_layout(MIG_PARTED, "config.yaml", select="all-balanced")
    assert p.ok, [str(e) for e in p.errors]
    assert present(p.layout).layouts_key == "mig-configs"
    assert list(present(p.layout).layouts) == CONFIGS
    assert present(p.layout).selected == "all-balanced"
    assert p.line('mig-configs."all-1g.10gb"[1]') == 34
    assert present(p.layout).layouts["all-3g.40gb"][0].mig_devices == {"3g.40gb": 2}


def test_without_a_choice_selected_is_required() -> None:
    p = parse_layout(MIG_PARTED, "config.yaml")
    assert [str(e) for e in p.errors] == [
        'config.yaml:2 selected: missing; mig-configs has 8 layouts, so "selected" must name one of: '
        + ", ".join(CONFIGS)]


def test_choice_not_in_file() -> None:
    p = parse_layout(MIG_PARTED, "config.yaml", select="all-7g")
    assert [str(e) for e in p.errors] == [
        'config.yaml selected: "all-7g" (chosen by the caller) is not a layout in mig-configs; one of: '
        + ", ".join(CONFIGS)]


def test_choice_overrides_the_file() -> None:
    p = parse_layout("version: v1\nselected: a\nlayouts:\n  a: []\n  b: []\n", select="b")
    assert p.ok and present(p.layout).selected == "b"


def test_all_balanced_on_a_mixed_host() -> None:
    gpus = host("a100-40gb", "h100-80gb", "a100-80gb", "h200")
    r = check_text(MIG_PARTED, "config.yaml", gpus, select="all-balanced")
    assert r.ok, [str(e) for e in r.errors]
    assert {p: (d.entry, d.mig_devices) for p, d in r.desired.items()} == {
        "0000:18:00.0": ('mig-configs.all-balanced[0]', {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}),
        "0000:28:00.0": ('mig-configs.all-balanced[1]', {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}),
        "0000:38:00.0": ('mig-configs.all-balanced[1]', {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}),
    }
    # The H200 is in no filter: mig-parted leaves it alone, and so does gpud (with a warning).
    assert [str(w) for w in r.warnings] == [
        "config.yaml:47 mig-configs.all-balanced: GPU 3 (0000:48:00.0, NVIDIA H200) is not in layout "
        "all-balanced; left untouched"]


def test_all_1g_10gb_resolves_against_each_model() -> None:
    """On the A100-40GB `1g.10gb` is its double-memory 1g; on the H100 the single-slice one."""
    gpus = host("a100-40gb", "h100-80gb")
    r = check_text(MIG_PARTED, "config.yaml", gpus, select="all-1g.10gb")
    assert r.ok and {d.mig_devices["1g.10gb"] for d in r.desired.values()} == {4, 7}


def test_custom_config_on_8_h100(h100x8) -> None:
    r = check_text(MIG_PARTED, "config.yaml", h100x8, select="custom-config")
    assert r.ok and r.warnings == []
    assert [d.mig_enabled for d in r.desired.values()] == [False] * 4 + [True] * 4


def test_all_1g_5gb_on_h100_names_the_model() -> None:
    r = check_text(MIG_PARTED, "config.yaml", host("h100-80gb"), select="all-1g.5gb")
    assert [str(e) for e in r.errors] == [
        'config.yaml:17 mig-configs."all-1g.5gb"[0].mig-devices."1g.5gb": 1g.5gb is not a MIG profile of '
        "NVIDIA H100 80GB HBM3 at 0000:18:00.0; valid: 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb"]


@pytest.mark.parametrize("config", CONFIGS)
def test_every_config_parses(config: str) -> None:
    assert parse_layout(MIG_PARTED, select=config).ok


def test_all_enabled_means_mig_on_no_instances(h100x8) -> None:
    r = check_text(MIG_PARTED, "config.yaml", h100x8, select="all-enabled")
    assert r.ok and all(d.mig_enabled is True and d.mig_devices == {} for d in r.desired.values())
