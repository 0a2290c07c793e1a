"""Issue 29 item 8: `gpudctl check FILE` with no daemon running gives the daemon's verdict: the
offline check (gpud check, gpud/check_offline.py) replies exactly as the running daemon does to the
same file on the same host, and changes nothing: no NVML mutating call (the simulator's own
counters), no file of the daemon's state directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.daemon import ROOT

pytestmark = pytest.mark.daemon

FILES = {
    "feasible": layout(mig([0], {"1g.10gb": 4}), {"devices": [1], "workload": "vm-passthrough"}),
    "infeasible": layout(mig([0], {"1g.10gb": 7})),
    "bad-key": "version: v1\nselected: a\nlayouts:\n  a:\n    - devices: [0]\n      mig-enable: true\n",
    "gone-index": layout(mig([5], None)),
}


def _offline(d, path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpud.main", "check", "--sim", str(d.host), "--state-dir",
                           str(d.state_dir), str(path), *extra], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _state_files(d) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.state_dir.iterdir()) if p.is_file()}


def test_offline_check_replies_as_the_daemon_does_and_changes_nothing(daemon):
    d = daemon(["a100-40gb:2"], layout(mig([0], None)))
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    calls, state = d.mutating_calls(), _state_files(d)
    for name, text in FILES.items():
        f = d.tmp / f"{name}.yaml"
        f.write_text(text)
        online = d.ctl("check", "--json", str(f))
        offline = _offline(d, f)
        assert offline.returncode == online.returncode, (name, offline.stderr)
        assert json.loads(offline.stdout) == json.loads(online.stdout), name
        assert online.returncode == (0 if name == "feasible" else 4), (name, online.stdout)
    assert d.mutating_calls() == calls and _state_files(d) == state
    all_layouts = d.tmp / "all.yaml"
    all_layouts.write_text("version: v1\nmig-configs:\n  a: []\n  b:\n    - devices: [0]\n      mig-enabled: true\n"
                           "      mig-devices: {\"1g.10gb\": 7}\n")
    online = d.ctl("check", "--json", "--all-layouts", str(all_layouts))
    assert json.loads(_offline(d, all_layouts, "--all-layouts").stdout) == json.loads(online.stdout)


def test_gpudctl_checks_offline_when_no_daemon_answers(tmp_path):
    f = tmp_path / "layout.yaml"
    f.write_text(FILES["bad-key"])

    def gpudctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", str(tmp_path / "none.sock"),
                               *args], capture_output=True, text=True, timeout=120, cwd=ROOT)

    r = gpudctl("check", str(f))
    assert r.returncode == 4 and "checking offline" in r.stderr, r.stderr
    assert f"{f}:6 layouts.a[0].mig-enable: unknown key" in r.stdout, r.stdout
    f.write_text("version: v1\nselected: a\nlayouts:\n  a: []\n")
    r = gpudctl("check", str(f))
    assert r.returncode == 0 and f"{f}: valid" in r.stdout, r.stdout + r.stderr
