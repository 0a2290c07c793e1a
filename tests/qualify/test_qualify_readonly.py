"""`gpud qualify` read-only: it changes nothing, and what it reports is what the host holds.

Compared with sources that share no code with the report: the simulator's own state file
(DIR/state.json: MIG modes, IOMMU groups, processes, and its record of every NVML call made),
real `nvidia-smi mig -lgipp` captures (placements), and for the H200 replay the real probe's JSON
and the real `nvidia-smi -q` text of the same host.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.qualify.capture_oracle import placements
from tests.support.qualify import MUTATING, ROOT, checks, hardware_state, qualify, sim, state

pytestmark = pytest.mark.daemon

CAPTURES = ROOT / "tests" / "fixtures" / "captures"
H200 = ROOT / "tests" / "fixtures" / "h200"
PROBE = H200 / "nvml-sysfs-readonly.json"
SMI_Q = ROOT / "tests" / "fixtures" / "h200-qualify" / "nvidia-smi-q-2026-12-01.txt"
_REPORTED = re.compile(r"\(id (\d+)\) x\d+ at ([\d:,]+)")


def _reported_placements(reason: str) -> dict[int, list[str]]:
    return {int(pid): at.split(",") for pid, at in _REPORTED.findall(reason)}


def _pend_mig_on(host: Path, pci: str) -> None:
    """Ask the simulated A100 for MIG on through NVML, as a user's nvidia-smi -mig 1 would: Ampere
    leaves it pending until a reset."""
    code = ("import sys; from gpud import sim; sim.install(sys.argv[1]); from gpud.host.nvidia.nvml import Nvml; "
            "n = Nvml(); n.open(); n.set_mig_mode(sys.argv[2], True); n.close()")
    subprocess.run([sys.executable, "-c", code, str(host), pci], check=True, cwd=ROOT, timeout=120)


def test_read_only_run_changes_nothing_and_reports_the_simulated_host(tmp_path):
    host = tmp_path / "host"
    sim("create", str(host), "--gpu", "a100-40gb:2")
    gpus = sorted(state(host)["gpus"])
    _pend_mig_on(host, gpus[1])
    sim("hold", str(host), gpus[0], "--pid", "4242", "--name", "nv-hostengine")
    before = hardware_state(host)
    calls_before = dict(state(host)["calls"])

    r = qualify("--sim", str(host), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)

    # nothing changed: the hardware state is the same, and the simulator recorded no mutating call
    assert hardware_state(host) == before
    new_calls = {k: v - calls_before.get(k, 0) for k, v in state(host)["calls"].items()}
    assert [k for k, v in new_calls.items() if v and any(m in k for m in MUTATING)] == []

    truth = state(host)
    for i, pci in enumerate(gpus):
        got = checks(report, f"GPU {i} {pci}")
        g = truth["gpus"][pci]
        on = {0: "off", 1: "on"}
        assert got["MIG mode"]["reason"] == f"current {on[g['mig_mode']]}, pending {on[g['mig_pending']]}"
        assert got["MIG mode"]["status"] == ("warn" if g["mig_mode"] != g["mig_pending"] else "ok")
        group = truth["functions"][pci]["iommu_group"]
        assert got["IOMMU group"]["reason"].startswith(f"group {group}")
        assert _reported_placements(got["GI placements"]["reason"]) == placements(
            CAPTURES / "a100-40gb" / "nvidia-smi-mig-lgipp.txt")
    held = checks(report, f"GPU 0 {gpus[0]}")["holders"]
    assert held["status"] == "warn" and "pid 4242 nv-hostengine" in held["reason"]
    assert checks(report, f"GPU 1 {gpus[1]}")["holders"]["status"] == "ok"
    service = checks(report, "services")["nv-hostengine"]
    assert service["status"] == "warn" and "pid 4242" in service["reason"]
    assert report["verdict"]["status"] == "warn"
    assert report["counts"]["fail"] == 0


def test_text_report_is_one_line_per_check_with_a_verdict(tmp_path):
    host = tmp_path / "host"
    sim("create", str(host), "--gpu", "h100-80gb:1")
    out = tmp_path / "report.txt"
    r = qualify("--sim", str(host), "--output", str(out))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    data = json.loads((tmp_path / "report.txt.json").read_text())
    assert out.read_text() == r.stdout
    check_lines = [ln for ln in lines if re.match(r"^  (ok  |WARN|FAIL|\?\? ) ", ln)]
    assert len(check_lines) == len(data["checks"])
    assert lines[-1] == f"verdict: {data['verdict']['status'].upper()}: {data['verdict']['summary']}"


def _replay_host(tmp_path: Path) -> tuple[Path, Path]:
    from gpud.sim import replay_nvml

    host = replay_nvml.host(PROBE, tmp_path / "replay")
    smi = tmp_path / "nvidia-smi"  # stands in for the real tool: prints what it printed on that host
    smi.write_text(f'#!/bin/sh\n[ "$1" = "-q" ] || exit 2\nexec cat "{SMI_Q}"\n')
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return host, smi


def test_replay_of_the_real_h200_reports_what_the_capture_says(tmp_path):
    host, smi = _replay_host(tmp_path)
    probe = json.loads(PROBE.read_text())
    r = qualify("--sim", str(host), "--replay", str(PROBE), "--nvidia-smi", str(smi), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    driver = checks(report, "driver")
    assert driver["NVML driver version"]["reason"] == f"driver {probe['driver']}"
    assert driver["NVML library version"]["reason"] == f"NVML {probe['nvml_version']}"
    assert driver["kernel module"]["status"] == "ok"
    assert driver["nvidia-smi"]["status"] == "ok"
    assert driver["nvidia-smi"]["reason"] == f"{smi}: driver 580.159.04, CUDA 13.0"  # nvidia-smi -q's header
    pci = "0000:00:06.0"
    gpu = checks(report, f"GPU 0 {pci}")
    assert gpu["driver"]["reason"] == f"{probe['device']['name']} on nvidia, uuid {probe['device']['uuid']}"
    current, pending = probe["device"]["mig_mode"]
    assert gpu["MIG mode"]["reason"] == f"current {'on' if current else 'off'}, pending {'on' if pending else 'off'}"
    want = {int(pid): [f"{p['start']}:{p['size']}" for p in pls]
            for pid, pls in probe["gpu_instance_possible_placements"].items()}
    assert _reported_placements(gpu["GI placements"]["reason"]) == want
    assert want == placements(H200 / "nvidia-smi-mig-lgipp.txt")  # the probe and nvidia-smi agree
    # nvidia-smi -q says "Persistence Mode : Enabled" on that host with no nvidia-persistenced (legacy):
    # not a daemon to drain; and it prints no GPU Reset Status
    assert gpu["persistence mode"]["status"] == "ok"
    assert gpu["persistence mode"]["reason"] == "nvidia-smi: Enabled (legacy: no nvidia-persistenced runs (nvidia-smi -pm 1))"
    assert "drain" not in gpu["persistence mode"]["action"] and "nvidia-smi -pm 0" in gpu["persistence mode"]["action"]
    assert "nvidia-smi -q prints no GPU Reset Status" in gpu["reset"]["reason"]
    # the probe found no IOMMU group (the GPU is passed through to a VM without a virtual IOMMU)
    assert probe["iommu_groups"] == []
    assert gpu["IOMMU group"]["status"] == "warn" and gpu["IOMMU group"]["reason"] == "none"
    assert report["verdict"]["status"] == "warn" and report["counts"]["fail"] == 0


def test_replay_refuses_mutate(tmp_path):
    host, _smi = _replay_host(tmp_path)
    r = qualify("--sim", str(host), "--replay", str(PROBE), "--mutate", "0",
                "--yes-i-understand-this-reconfigures-GPU")
    assert r.returncode == 2 and "cannot run on a replay" in r.stderr
