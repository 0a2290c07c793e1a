"""etc/gpud/layout.yaml: changes nothing as shipped, and each commented example is valid."""

from __future__ import annotations

import pytest

from gpud.layout import check_text, parse_layout
from tests.support.example_layout import EXAMPLE, uncommented
from tests.support.gpus import host
from tests.support.present import present


def test_as_shipped_changes_nothing() -> None:
    gpus = host("h200", "h100-80gb", "l40s")
    r = check_text(EXAMPLE.read_text(), str(EXAMPLE), gpus)
    assert r.ok and r.desired == {} and r.selected == "as-is"
    assert [w.message for w in r.warnings] == [
        f"GPU {g.index} ({g.pci}, {present(g.nvml).name}) is not in layout as-is; left untouched" for g in gpus]
    assert r.layout is not None and r.layout.hooks.apply_exit == ()


@pytest.mark.parametrize("layout", ["partial-mig", "vms-and-containers", "vgpu", "all-1g"])
def test_commented_examples_are_valid(layout: str) -> None:
    text = uncommented()
    parsed = parse_layout(text, select=layout)
    assert parsed.ok, [str(e) for e in parsed.errors]
    assert set(present(parsed.layout).layouts) == {"as-is", "partial-mig", "vms-and-containers", "vgpu", "all-1g"}
    assert len(present(parsed.layout).match) == 2
    assert present(parsed.layout).hooks.apply_start and present(parsed.layout).hooks.apply_exit


def test_partial_mig_example_on_h100_host(h100x8) -> None:
    r = check_text(uncommented(), gpus=h100x8, select="partial-mig")
    assert r.ok and r.desired[h100x8[0].pci].mig_devices == {"1g.10gb": 4, "3g.40gb": 1}


def test_all_1g_example_on_mixed_host() -> None:
    gpus = host("h100-80gb", "h200")
    r = check_text(uncommented(), gpus=gpus, select="all-1g")
    assert r.ok and [d.mig_devices for d in r.desired.values()] == [{"1g.10gb": 7}, {"1g.18gb": 7}]
