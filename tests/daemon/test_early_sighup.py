"""Issue 33 item 9: a SIGHUP in gpud's first half second (a `systemctl reload` or a config tool's
`kill -HUP` while it starts) killed it with rc 129, as the reload handler came only with the event
loop. The SIGHUP here arrives at a known point of the slow start-up work: the child sends it to
itself as the daemon is being built (before NVML, the layout, the state files and the socket), so
the test does not depend on timing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpud.sim import cli as simcli
from tests.scenarios.definitions import layout, mig
from tests.support.daemon import ROOT, wait_until
from tests.support.processes import stop

pytestmark = pytest.mark.daemon

CHILD = """
import os, signal, sys
import gpud.daemon as daemon

built = daemon.Daemon.__init__

def hup_then_build(self, args):
    os.kill(os.getpid(), signal.SIGHUP)  # delivered at once: the process is running Python code
    built(self, args)

daemon.Daemon.__init__ = hup_then_build
from gpud.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_sighup_during_start_up_is_a_reload_not_a_death(tmp_path):
    host = tmp_path / "host"
    simcli.create(host, ["h100-80gb:1"])
    config = tmp_path / "layout.yaml"
    config.write_text(layout(mig("all", None)))
    sock, log = tmp_path / "gpud.sock", tmp_path / "gpud.log"
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-c", CHILD, "--sim", str(host), "--config", str(config),
                                 "--socket", str(sock), "--state-dir", str(tmp_path / "state")],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        def answered() -> bool:
            return proc.poll() is not None or subprocess.run(
                [sys.executable, "-m", "gpud.cli.gpudctl", "--socket", str(sock), "version"],
                capture_output=True, timeout=60, cwd=ROOT).returncode == 0
        wait_until(answered, timeout=60, what="gpud to answer or exit")
        assert proc.poll() is None, f"gpud exited with {proc.returncode}:\n{log.read_text()}"
        wait_until(lambda: "SIGHUP during start-up: re-reading the layout" in log.read_text(), what="the reload")
    finally:
        stop(proc)
