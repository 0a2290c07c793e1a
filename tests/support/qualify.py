"""Helpers of the qualification tests: run `gpud qualify` as an operator does (a subprocess, so the
simulator's or the replay's NVML library never leaks into other tests) and read the simulator's own
record of the host (DIR/state.json), which shares no code with the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIRM = "--yes-i-understand-this-reconfigures-GPU"
# NVML functions that change hardware state: none may appear in the simulator's call record of a
# read-only run
MUTATING = ("Set", "Create", "Destroy", "Reset")


def qualify(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpud.main", "qualify", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def sim(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "gpud.sim.cli", *args], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout


def state(host: Path) -> dict:
    return json.loads((host / "state.json").read_text())


def hardware_state(host: Path) -> dict:
    """state.json without the simulator's call counters (reads count calls too)."""
    return {k: v for k, v in state(host).items() if k != "calls"}


def checks(report: dict, group_prefix: str) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"] if c["group"].startswith(group_prefix)}
