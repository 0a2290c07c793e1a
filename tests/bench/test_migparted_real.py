"""The bench's translation of gpud layouts into mig-parted configs (bench/migparted_real.py): checked
by hand for the device-filter form and by mig-parted's own parser (`assert --valid-config`, which
reads no GPU) for every scenario's target, where the real tool is installed (that parser accepts any device-filter
string, so the filter's form is checked only by hand here and, in the bench, by the mixed-host scenario
ending as asked)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from bench import migparted_real
from tests.scenarios.definitions import SCENARIOS, layout, mig


def test_device_filter_and_policy_translate_to_mig_parteds_form():
    text, label = migparted_real.config(layout(mig("all", {"3g.71gb": 2}, **{"device-filter": "10de:2335"}),
                                               mig([1], None, **{"device-filter": ["0x233010DE"]}),
                                               policy={"on-busy": "fail"}, name="x"))
    assert label == "x"
    assert yaml.safe_load(text) == {"version": "v1", "mig-configs": {"x": [
        {"devices": "all", "mig-enabled": True, "device-filter": "0x233510DE", "mig-devices": {"3g.71gb": 2}},
        {"devices": [1], "mig-enabled": False, "device-filter": ["0x233010DE"]},
    ]}}


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
@pytest.mark.tools
def test_mig_parted_accepts_every_translated_target(sc, tmp_path):
    tool, why = migparted_real.binary()
    if tool is None:
        pytest.skip(why)
    text, label = migparted_real.config(sc.after)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    res = subprocess.run([str(tool), "assert", "--valid-config", "-f", str(cfg), "-c", label],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "is valid" in res.stdout, res.stdout + res.stderr
