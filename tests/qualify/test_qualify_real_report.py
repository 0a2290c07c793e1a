"""The report `scripts/gpu-qualify-capture` saved on the lent H200 host, compared with what was
captured beside it on that host (its nvidia-smi -q, the before/after snapshots) and with the H200
replay's report."""

from __future__ import annotations

import json
import re

from tests.qualify.capture_oracle import placements
from tests.support.qualify import ROOT, checks

FIX = ROOT / "tests" / "fixtures" / "h200-qualify"
REPORT = FIX / "report.txt.json"


def test_real_run_changed_nothing_and_agrees_with_nvidia_smi():
    from gpud.host.nvidia.smi_query import parse_query

    assert (FIX / "before.txt").read_text() == (FIX / "after.txt").read_text()
    report = json.loads(REPORT.read_text())
    assert report["mode"] == "read-only"
    top, smi_gpus = parse_query((FIX / "nvidia-smi-q.txt").read_text())
    assert checks(report, "driver")["NVML driver version"]["reason"] == f"driver {top['Driver Version']}"
    for pci, section in smi_gpus.items():
        got = next(v for k, v in ((c["group"], c) for c in report["checks"])
                   if k.endswith(pci) and v["name"] == "MIG mode")
        mode = section["MIG Mode"]
        on = {"Enabled": "on", "Disabled": "off"}
        assert got["reason"] == f"current {on[mode['Current']]}, pending {on[mode['Pending']]}"


def test_real_h200_placements_equal_the_h200_lgipp_capture():
    report = json.loads(REPORT.read_text())
    h200_groups = {c["group"] for c in report["checks"]
                   if c["name"] == "driver" and c["reason"].startswith("NVIDIA H200 on nvidia")}
    assert h200_groups, "the lent host's report names no H200 on nvidia"
    real = placements(ROOT / "tests" / "fixtures" / "h200" / "nvidia-smi-mig-lgipp.txt")
    for c in report["checks"]:
        if c["group"] in h200_groups and c["name"] == "GI placements":
            got = {int(pid): at.split(",") for pid, at in re.findall(r"\(id (\d+)\) x\d+ at ([\d:,]+)", c["reason"])}
            assert got == real
