"""Planning with the suffixed profiles of the RTX PRO 6000 Blackwell (+gfx, +me.all, -me) and the
A30's 4-slice geometry, checked against placements and instance counts read from the real captures
(tests/fixtures/captures/*/nvidia-smi-mig-lgipp.txt), applied to the independent hardware model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpud.layout.desired import DesiredGpu
from gpud.plan.mig import plan_gpu
from tests.plan.hwmodel import apply_steps, gpu_of, make_hw

PCI = "0000:3b:00.0"
CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "captures"


def starts(model: str) -> dict[int, set[int]]:
    """Profile id -> allowed starts, from the capture's -lgipp text."""
    out = {}
    for m in re.finditer(r"Profile ID\s+(\d+) Placements?\s*: \{([\d,]+)\}", (CAPTURES / model / "nvidia-smi-mig-lgipp.txt").read_text()):
        out[int(m[1])] = {int(s) for s in m[2].split(",")}
    return out


@pytest.mark.parametrize(("model", "devices"), [
    ("rtx-pro-6000", {"1g.24gb+gfx": 2, "2g.48gb-me": 1}),
    ("rtx-pro-6000", {"1g.24gb+me.all": 1, "1g.24gb-me": 3}),
    ("rtx-pro-6000", {"2g.48gb+me.all": 1, "2g.48gb+gfx": 1}),
    ("rtx-pro-6000", {"4g.96gb+gfx": 1}),
    ("rtx-pro-6000", {"1c.2g.48gb-me": 2, "1g.24gb": 2}),
    ("a30", {"2g.12gb": 1, "1g.6gb": 1, "1g.6gb+me": 1}),
])
def test_suffixed_layouts_plan_and_apply(model: str, devices: dict[str, int]) -> None:
    hw = make_hw(model, PCI, mode=1)
    plan = plan_gpu(gpu_of(hw, model=model), DesiredGpu(PCI, 0, "e", mig_enabled=True, mig_devices=devices))
    assert plan.infeasible is None, plan.infeasible
    apply_steps(hw, plan.steps)
    allowed = starts(model)
    names = {p.id: p.name for p in hw.profiles}
    got: dict[str, int] = {}
    for gi in hw.gis.values():
        assert gi.placement.start in allowed[gi.profile_id]
        for ci in gi.cis.values() if isinstance(gi.cis, dict) else gi.cis:
            slices = next(c.slices for c in next(p for p in hw.profiles if p.id == gi.profile_id).ci_profiles
                          if c.id == ci.profile_id)
            gi_slices = next(p.slices for p in hw.profiles if p.id == gi.profile_id)
            name = names[gi.profile_id] if slices == gi_slices else f"{slices}c.{names[gi.profile_id]}"
            got[name] = got.get(name, 0) + 1
    assert got == devices


@pytest.mark.parametrize(("model", "devices", "reason"), [
    ("rtx-pro-6000", {"1g.24gb+me.all": 2}, "exceeds the 1 instance"),
    ("rtx-pro-6000", {"2g.48gb": 2, "1g.24gb-me": 1}, "memory slices"),
    ("a30", {"2g.12gb": 2, "1g.6gb": 1}, "memory slices"),
])
def test_infeasible_suffixed_layouts_are_explained(model: str, devices: dict[str, int], reason: str) -> None:
    hw = make_hw(model, PCI, mode=1)
    plan = plan_gpu(gpu_of(hw, model=model), DesiredGpu(PCI, 0, "e", mig_enabled=True, mig_devices=devices))
    assert plan.infeasible is not None and reason in plan.infeasible, plan.infeasible
