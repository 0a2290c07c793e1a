"""Child processes a test starts."""

from __future__ import annotations

import signal
import subprocess


def reap(p: subprocess.Popen) -> int:
    """End `p` (killed if it still runs), wait for it and close the test's pipes to it; its
    exit status."""
    with p:  # Popen.__exit__ closes stdin, stdout and stderr, then waits
        p.kill()
    return p.returncode


def stop(p: subprocess.Popen, timeout: float = 30) -> int:
    """Ask `p` to stop as systemd would (SIGTERM), kill it if it has not within `timeout` seconds;
    its exit status."""
    p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()
