"""The daemon settles a pending MIG mode through the simulated host's nvidia-smi (DIR/bin/nvidia-smi,
written by gpud-sim create): the reset shows in the simulator's own counters per method, and an
NVSwitch host's refusal, and its plan, name the other GPUs."""

from __future__ import annotations

import json

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.daemon import wait_until

pytestmark = pytest.mark.daemon

EMPTY = "version: v1\nlayouts:\n  hands-off: []\n"
GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"
MIG_ON = layout(mig([0], {"7g.80gb": 1}))


def resets(d) -> dict:
    return json.loads(d.sim("stats", "--json").stdout)["resets"]


def test_daemon_resets_an_ampere_gpu_with_nvidia_smi(daemon):
    d = daemon(["a100-80gb:2"], MIG_ON)
    assert d.ctl("apply", "--wait").returncode == 0
    g0 = d.status()["gpus"][0]
    assert g0["state"] == "converged", g0
    assert resets(d) == {GPU0: {"nvidia-smi": 1}}
    st = d.sim_state()
    assert st["gpus"][GPU0]["mig_mode"] == 1 and st["gpus"][GPU1]["mig_mode"] == 0
    done = [e for e in d.events() if e["kind"] == "reset" and e["gpu"] == GPU0]
    assert [e["message"] for e in done] == ["done (nvidia-smi): nvidia-smi exit 0: GPU 00000000:18:00.0 was successfully reset."]


def test_daemon_on_an_nvswitch_host_plans_and_reports_the_refused_reset(daemon, tmp_path):
    """Ampere with Fabric Manager stopped: nvidia-smi(1) resets all NVLink peers together or none."""
    d = daemon(["a100-80gb:2"], EMPTY, nvswitch=True, fabric_manager="stopped")
    assert d.ctl("apply", "--wait").returncode == 0
    cand = tmp_path / "candidate.yaml"
    cand.write_text(MIG_ON)
    plan = json.loads(d.ctl("plan", "--json", str(cand)).stdout)
    assert plan["disruption"]["resets"] == [GPU0] and plan["disruption"]["reset_with"] == [GPU1]
    text = d.ctl("plan", str(cand)).stdout
    assert f"a reset takes these GPUs with it: {GPU1}" in text
    d.config.write_text(MIG_ON)
    wait_until(lambda: d.status()["gpus"][0]["state"] == "reset-required", what="reset-required")
    g0 = d.status()["gpus"][0]
    assert "NVSwitch" in g0["message"] and "00000000:2A:00.0" in g0["message"], g0
    assert resets(d) == {} and d.sim_state()["gpus"][GPU0]["mig_pending"] == 1


def test_nvswitch_host_resets_one_gpu_alone_with_fabric_manager_running(daemon, tmp_path):
    """HGX A100 with Fabric Manager running: the plan takes no other GPU along, Fabric Manager is
    neither stopped nor waited on, one GPU is reset (Hopper's rule: tests/plan/test_reset_scope.py)."""
    d = daemon(["a100-80gb:2"], EMPTY, nvswitch=True, fabric_manager="running")
    assert d.ctl("apply", "--wait").returncode == 0
    cand = tmp_path / "candidate.yaml"
    cand.write_text(MIG_ON)
    plan = json.loads(d.ctl("plan", "--json", str(cand)).stdout)
    assert plan["disruption"]["resets"] == [GPU0] and plan["disruption"]["reset_with"] == []
    d.config.write_text(MIG_ON)
    wait_until(lambda: d.status()["gpus"][0]["state"] == "converged", 60, what="converged")
    assert resets(d) == {GPU0: {"nvidia-smi": 1}} and d.sim_state()["gpus"][GPU1]["mig_mode"] == 0
    assert (d.host / "proc" / "871" / "comm").read_text() == "nv-fabricmanage\n"  # still running
