"""Programs that are not Python on the simulated host: run one under `gpud-sim exec`, and the Go
probe's JSON answers (tests/nvmlc's fixtures build the library and the probe)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def gpud_sim_exec(host_dir: Path, *argv: str, namespace: bool = True, input: str | None = None,
                  timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gpud.sim.cli", "exec", str(host_dir)]
    if not namespace:
        cmd.append("--no-namespace")
    return subprocess.run([*cmd, "--", *argv], capture_output=True, text=True, input=input, timeout=timeout)


def probe(goprobe: Path, host: Path, *args: str, namespace: bool = True) -> dict:
    res = gpud_sim_exec(host, str(goprobe), *args, namespace=namespace)
    assert res.returncode == 0, f"goprobe {' '.join(args)}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    return json.loads(res.stdout)
