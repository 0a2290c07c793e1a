"""Issue 33 item 5 (last part): a second gpud on the same state dir (and apply lock) started
without refusal, and the two would each trust files the other rewrites. It must refuse to start,
naming the first one's pid, and leave the first serving."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.daemon import ROOT

pytestmark = pytest.mark.daemon


def test_a_second_gpud_on_the_same_state_dir_refuses_naming_the_first(daemon, tmp_path):
    d = daemon(["h100-80gb:1"], layout(mig("all", None)))
    second = subprocess.run(
        [sys.executable, "-m", "gpud.daemon", "--sim", str(d.host), "--config", str(d.config),
         "--socket", str(tmp_path / "second.sock"), "--state-dir", str(d.state_dir)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert second.returncode == 1, second.stderr
    assert f"another gpud (pid {d.proc.pid}) is running on the state dir {d.state_dir}" in second.stderr
    assert not (tmp_path / "second.sock").exists()
    assert d.proc.poll() is None and d.ctl("version").returncode == 0
