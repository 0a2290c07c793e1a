"""`gpud qualify` on simulated hosts reports persistence mode and its kind, Fabric Manager's state
and the VF enabling tool, each compared with what the simulator's state file says."""

from __future__ import annotations

import json

import pytest

from tests.support.qualify import checks, qualify, sim, state

pytestmark = pytest.mark.daemon


def test_persistence_kind_vf_tool_and_fabric_manager(tmp_path):
    host = tmp_path / "vgpu"
    sim("create", str(host), "--gpu", "l40s", "--vgpu", "vfio", "--persistence", "daemon")
    r = qualify("--sim", str(host), "--json")
    report = json.loads(r.stdout)
    gpu = checks(report, "GPU 0")
    assert state(host)["persistence"] == "daemon"
    assert gpu["persistence mode"]["reason"] == "nvidia-smi: Enabled (nvidia-persistenced)", gpu["persistence mode"]
    assert "nvidia-smi -pm 0" in gpu["persistence mode"]["action"]
    tool = checks(report, "host")["VF enabling tool"]
    assert tool["status"] == "ok" and tool["reason"] == f"{host}/bin/sriov-manage; SR-IOV GPUs: 0000:18:00.0"
    assert checks(report, "host")["Fabric Manager"]["status"] == "ok"
    services = checks(report, "services")
    assert "nv-fabricmanager" not in services and "drain" not in services["nvidia-persistenced"]["reason"]

    hgx = tmp_path / "hgx"
    sim("create", str(hgx), "--gpu", "a100-80gb:2", "--nvswitch", "--fabric-manager", "stopped")
    fm = checks(json.loads(qualify("--sim", str(hgx), "--json").stdout), "host")["Fabric Manager"]
    assert state(hgx)["fabric_manager"] == "stopped"
    assert fm["status"] == "warn" and fm["reason"].startswith("not running on an Ampere NVSwitch host")
    (tmp_path / "h").mkdir()
    hopper = tmp_path / "h" / "hgx"
    sim("create", str(hopper), "--gpu", "h100-80gb:2", "--nvswitch")
    report = json.loads(qualify("--sim", str(hopper), "--json").stdout)
    fm = checks(report, "host")["Fabric Manager"]
    assert fm["status"] == "ok" and fm["reason"].startswith("running (pid 871)")
    assert "it resets alone" in checks(report, "GPU 0")["reset"]["reason"]
    assert checks(report, "host")["VF enabling tool"]["reason"] == f"{hopper}/bin/sriov-manage"
