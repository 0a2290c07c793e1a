"""Child processes a test starts."""

from __future__ import annotations

import subprocess


def reap(p: subprocess.Popen) -> int:
    """End `p` (killed if it still runs), wait for it and close the test's pipes to it; its
    exit status."""
    with p:  # Popen.__exit__ closes stdin, stdout and stderr, then waits
        p.kill()
    return p.returncode
