"""Replay of `scripts/gpu-readonly-capture` run on a real H200 host (tests/fixtures/h200-gpud-readonly):
`gpud --read-only` against the real NVML, next to what nvidia-smi said on the same host.

The capture proves three things, and these tests keep them true as the code changes: gpud's view
agrees with nvidia-smi; read-only mode refused every mutation and nothing changed; and the
simulator serves exactly what the real H200 served (so tests on the simulator mean something).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tests.daemon.conftest import Daemon
from tests.scenarios.definitions import layout, mig

CAP = Path(__file__).resolve().parents[1] / "fixtures" / "h200-gpud-readonly"


def _smi_rows(name: str) -> list[dict[str, str]]:
    with open(CAP / name) as f:
        return [{k.strip(): v.strip() for k, v in row.items()} for row in csv.DictReader(f)]


def test_status_agrees_with_nvidia_smi():
    status = json.loads((CAP / "gpudctl-status.json").read_text())
    rows = _smi_rows("nvidia-smi-query.csv")
    assert status["read_only"] is True
    assert len(status["gpus"]) == len(rows) >= 1
    for g, row in zip(status["gpus"], rows):
        assert g["uuid"] == row["uuid"]
        bus = row["pci.bus_id"].lower()  # 00000000:00:06.0
        assert g["pci"] == f"{int(bus.split(':')[0], 16):04x}:{bus.split(':', 1)[1]}"
        assert g["model"] == row["name"]
        assert g["mig"]["mode"] == row["mig.mode.current"].lower()
    smi_l = (CAP / "nvidia-smi-L.txt").read_text()
    assert all(g["uuid"] in smi_l and g["model"] in smi_l for g in status["gpus"])


def test_profile_table_equals_nvidia_smi_lgip_and_lgipp():
    expected = (CAP / "nvidia-smi-mig-lgip.txt").read_text() + (CAP / "nvidia-smi-mig-lgipp.txt").read_text()
    assert (CAP / "gpudctl-mig-profiles.txt").read_text() == expected


def test_read_only_refused_every_mutation_and_nothing_changed():
    lines = (CAP / "readonly-refusals.txt").read_text().splitlines()
    refusals = [ln for ln in lines if not ln.startswith("unchanged")]
    assert len(refusals) == 5 and all(" refused: read-only mode: refusing " in ln for ln in refusals)
    assert "unchanged: True" in lines[-1]
    before, after = _smi_rows("nvidia-smi-query.csv"), _smi_rows("nvidia-smi-query-after.csv")
    assert [(r["uuid"], r["mig.mode.current"], r["mig.mode.pending"]) for r in before] == \
           [(r["uuid"], r["mig.mode.current"], r["mig.mode.pending"]) for r in after]


def test_plan_on_the_real_profile_table():
    plan = json.loads((CAP / "gpudctl-plan.json").read_text())
    steps = plan["gpus"][0]["steps"]
    assert steps[0]["action"] == "set-mig-mode" and steps[0]["enabled"] is True
    gis = sorted((s["profile"], s["placement"]["start"]) for s in steps if s["action"] == "create-gi")
    assert gis == [("1g.18gb", 0), ("1g.18gb", 1), ("1g.18gb", 2), ("1g.18gb", 3), ("3g.71gb", 4)]


def test_simulated_h200_serves_what_the_real_one_did(tmp_path):
    d = Daemon(tmp_path, ["h200"], layout(mig([0], None)))
    try:
        r = d.ctl("mig", "profiles")
        assert r.returncode == 0, r.stderr
        assert r.stdout == (CAP / "gpudctl-mig-profiles.txt").read_text()
    finally:
        d.stop()
