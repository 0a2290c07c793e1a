"""On a host gpud reads MIG profile names from NVML, never from its own table: GB300's names
depend on the driver (NVIDIA's DGX Station GB300 MIG playbook, github.com/NVIDIA/dgx-spark-playbooks
nvidia/station-mig: R59x 1g.35gb, R61x 1g.31gb for the same id 19), and gpud's table holds the R59x
ones. On a simulated R61x host a layout naming 1g.31gb must converge, and gpud must list the R61x
names; the oracle is the simulator's state file (profile ids of the GPU instances made)."""

from __future__ import annotations

import json

import pytest

from gpud.profiles import MODELS
from gpud.sim.state import load
from tests.support.daemon import Daemon

pytestmark = pytest.mark.daemon

R61X = """version: v1
layouts:
  l:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.31gb": 2, "3g.126gb": 1}
"""


def test_gpud_uses_the_drivers_names_not_its_table(tmp_path):
    assert {"1g.31gb", "3g.126gb"}.isdisjoint(p.name for p in MODELS["gb300"].profiles)
    d = Daemon(tmp_path / "d", ["gb300:1"], R61X, driver="610.43.02")
    try:
        r = d.ctl("apply", "--wait")
        assert r.returncode == 0, r.stdout + r.stderr
        gis = sorted(gi.profile_id for g in load(d.host).gpus.values() for gi in g.gis)
        assert gis == [9, 19, 19]
        listed = d.ctl("mig", "profiles", "--json")
        assert listed.returncode == 0, listed.stdout + listed.stderr
        names = set(json.dumps(json.loads(listed.stdout)).replace('"', " ").split())
        assert {"1g.31gb", "3g.126gb", "7g.251gb"} <= names and "1g.35gb" not in names
    finally:
        d.stop()
