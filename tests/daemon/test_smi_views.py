"""Issue 29 item 9: nvidia-smi's listings in gpudctl, compared with the simulator's own state file:
`gpudctl list` (nvidia-smi -L: whole GPUs with UUIDs, a vfio-pci one too, and their MIG devices),
`gpudctl mig instances` (-lgi) and `gpudctl mig compute` (-lci); `gpudctl --version` without a daemon."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpud import VERSION
from gpud.api import wire
from tests.scenarios.definitions import layout, mig
from tests.support.daemon import ROOT

pytestmark = pytest.mark.daemon

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"


def test_list_and_mig_views_match_the_simulator(daemon):
    d = daemon(["h100-80gb:2"], layout(mig([0], {"1g.10gb": 2, "1c.3g.40gb": 2}),
                                       {"devices": [1], "workload": "vm-passthrough"}))
    uuid1 = d.sim_state()["gpus"][GPU1]["uuid"]
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    truth = d.sim_state()["gpus"][GPU0]
    cis = [(gi["id"], ci["id"], ci["uuid"]) for gi in truth["gis"] for ci in gi["cis"]]
    listing = d.ctl("list").stdout.splitlines()
    assert listing[0] == f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {truth['uuid']}) [{GPU0}]"
    gpu1 = next(ln for ln in listing if ln.startswith("GPU 1: "))
    assert gpu1 == f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {uuid1}) [{GPU1}, vfio-pci]", gpu1
    mig_lines = [ln for ln in listing if ln.startswith("  MIG ")]
    assert sorted(ln.split("(UUID: ")[1].rstrip(")") for ln in mig_lines) == sorted(u for _, _, u in cis)
    gis = d.ctl("mig", "instances").stdout.splitlines()
    assert gis[0].split() == ["GPU", "GI", "PROFILE", "PLACEMENT", "COMPUTE", "INSTANCES"]
    rows = sorted((int(r.split()[1]), r.split()[2], int(r.split()[4])) for r in gis[1:])
    assert rows == sorted((gi["id"], "1g.10gb" if len(gi["cis"]) == 1 and gi["size"] == 1 else "3g.40gb", len(gi["cis"]))
                          for gi in truth["gis"])
    compute = d.ctl("mig", "compute", "--gpu", "0").stdout.splitlines()
    assert sorted((int(r.split()[1]), int(r.split()[2]), r.split()[-1]) for r in compute[1:]) == sorted(cis)


def test_version_flag_needs_no_daemon(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", str(tmp_path / "none"), "--version"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == f"gpudctl {VERSION} (protocol {wire.PROTOCOL})", r
