"""The MIG planner on B200, GB200 and GH200 144G: on a real GPU it gets NVML's own table, so here it
gets the profiles of those models' published `nvidia-smi mig -lgip` rows (tests/fixtures/captures/
<model>/, read by this file's own parser), applied to the independent hardware model.

What the captures do not show is stated, not invented as a table gpud would serve: their placements
are the 7-slice geometry every published `-lgipp` shows for these profile ids (the H200's own,
tests/fixtures/h200/nvidia-smi-mig-lgipp.txt, equal to the A100 guide's, H100's and H100 NVL's), and
each GPU instance's one compute instance spans it (what `nvidia-smi mig -cgi ... -C` creates). Only
the captured rows exist here: 3g, 4g and 7g profiles of these models have no published row.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpud.layout.desired import DesiredGpu
from gpud.model import CiProfile, MigProfile, Placement
from gpud.plan.mig import plan_gpu
from gpud.profiles import MODELS
from tests.plan.hwmodel import HwGpu, apply_steps, gpu_of
from tests.support.smi_mig_tables import by_id, read_lgip

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PCI = "0000:3b:00.0"


def seven_slice_placements() -> dict[int, tuple[tuple[int, ...], int]]:
    """Profile id -> (starts, size) from the H200 capture's -lgipp."""
    out = {}
    for m in re.finditer(r"Profile ID\s+(\d+) Placements?\s*: \{([\d,]+)\}:(\d+)",
                         (FIXTURES / "h200" / "nvidia-smi-mig-lgipp.txt").read_text()):
        out[int(m[1])] = (tuple(int(s) for s in m[2].split(",")), int(m[3]))
    return out


def captured_profiles(model: str) -> tuple[MigProfile, ...]:
    rows = by_id(read_lgip((FIXTURES / "captures" / model / "nvidia-smi-mig-lgip.txt").read_text()))
    places = seven_slice_placements()
    out = []
    for pid, r in rows.items():
        slices = int(r["name"].split("g.", 1)[0])
        starts, size = places[pid]
        out.append(MigProfile(
            id=pid, name=r["name"], slices=slices, memory_mb=round(float(r["gib"]) * 1024), sms=r["sm"],
            instance_count=r["total"], placements=tuple(Placement(s, size) for s in starts),
            ci_profiles=(CiProfile({1: 0, 2: 1}[slices], slices, 1, r["sm"], (0,)),)))
    return tuple(out)


def hw_of(model: str) -> HwGpu:
    return HwGpu(PCI, MODELS[model].name, captured_profiles(model), MODELS[model].arch, mode=1, pending=1)


@pytest.mark.parametrize(("model", "devices"), [
    ("b200", {"1g.23gb": 3, "1g.45gb": 2}),
    ("b200", {"2g.45gb": 3, "1g.23gb+me": 1}),
    ("b200", {"1g.23gb": 7}),
    ("gb200", {"1g.47gb": 4}),
    ("gb200", {"2g.47gb": 2, "1g.23gb": 3}),
    ("gh200-144gb", {"1g.18gb+me": 1, "1g.18gb": 6}),
    ("gh200-144gb", {"2g.36gb": 1, "1g.36gb": 3}),
])
def test_layouts_of_the_captured_profiles_plan_and_apply(model: str, devices: dict[str, int]) -> None:
    hw = hw_of(model)
    plan = plan_gpu(gpu_of(hw, model=model), DesiredGpu(PCI, 0, "e", mig_enabled=True, mig_devices=devices))
    assert plan.infeasible is None, plan.infeasible
    apply_steps(hw, plan.steps)
    names = {p.id: p.name for p in hw.profiles}
    got: dict[str, int] = {}
    for gi in hw.gis.values():
        got[names[gi.profile_id]] = got.get(names[gi.profile_id], 0) + 1
        assert len(gi.cis) == 1
    assert got == devices
    # every profile's names are ones gpud's table of the model knows, so layouts validate on vfio-pci too
    assert set(devices) <= {p.name for p in MODELS[model].profiles}


@pytest.mark.parametrize(("model", "devices", "reason"), [
    ("b200", {"1g.45gb": 4, "1g.23gb": 1}, "memory slices"),
    ("b200", {"1g.23gb+me": 2}, "exceeds the 1 instance"),
    ("gb200", {"1g.23gb": 8}, "exceeds the 7 instance"),
    ("gh200-144gb", {"2g.36gb": 3, "1g.36gb": 2}, "memory slices"),
])
def test_infeasible_layouts_are_explained_and_change_nothing(model: str, devices: dict[str, int], reason: str) -> None:
    hw = hw_of(model)
    plan = plan_gpu(gpu_of(hw, model=model), DesiredGpu(PCI, 0, "e", mig_enabled=True, mig_devices=devices))
    assert plan.infeasible is not None and reason in plan.infeasible, plan.infeasible
    assert plan.steps == [] and hw.gis == {}
