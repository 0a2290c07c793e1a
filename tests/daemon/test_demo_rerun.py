"""Issue 29 item 5: `make demo` run again after `GPUD_DEMO_KEEP=1` stops the daemon the first run
kept (it ran on in a deleted directory before) and starts afresh; the pid file says which."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.support.daemon import ROOT, wait_until

pytestmark = pytest.mark.daemon


def _demo(d) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "scripts" / "demo")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, GPUD_DEMO_DIR=str(d), GPUD_DEMO_KEEP="1"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_second_demo_stops_the_kept_daemon_first(tmp_path):
    d = tmp_path / "demo"
    first = _demo(d)
    assert first.returncode == 0, first.stdout + first.stderr
    pid1 = int((d / "gpud.pid").read_text())
    second = pid2 = None
    try:
        assert _alive(pid1)
        second = _demo(d)
        assert second.returncode == 0, second.stdout + second.stderr
        assert f"stopping the gpud an earlier demo kept running (pid {pid1})" in second.stdout
        wait_until(lambda: not _alive(pid1), what="the first daemon gone")
        pid2 = int((d / "gpud.pid").read_text())
        assert pid2 != pid1 and _alive(pid2)
    finally:
        for pid in (pid1, pid2):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGTERM)
