"""A gpud killed between turning persistence off for a reset and on again: the next gpud turns it
on at start, from the intent it wrote to its state directory first. The kill is real (SIGKILL of
the process running gpud's reset, from inside the nvidia-smi it runs); outcomes from the
simulator's state file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from gpud.sim.state import load
from tests.support.daemon import ROOT, wait_until

pytestmark = pytest.mark.daemon

GPU0 = "0000:18:00.0"
EMPTY = "version: v1\nlayouts:\n  hands-off: []\n"

RESET = textwrap.dedent("""
    import sys
    from gpud.host.nvidia.gpu_reset import GpuReset
    GpuReset(sys.argv[1], intent_path=sys.argv[2]).reset(sys.argv[3], "nvidia")
""")


def test_persistence_left_off_by_a_killed_reset_is_restored_at_start(daemon, tmp_path) -> None:
    d = daemon(["a100-80gb"], EMPTY)
    d.stop()
    assert GPU0 in load(d.host).persistent
    # an nvidia-smi that dies with its caller at `-r`: the caller is killed mid-reset
    smi = tmp_path / "nvidia-smi-killer"
    smi.write_text("#!/bin/sh\ncase \" $* \" in *\" -r \"*) kill -9 $PPID; sleep 5; exit 1;; esac\n"
                   f"exec '{d.host}/bin/nvidia-smi' \"$@\"\n")
    smi.chmod(0o755)
    intent = d.state_dir / "persistence-restore.json"
    r = subprocess.run([sys.executable, "-c", RESET, str(smi), str(intent), GPU0], cwd=ROOT, timeout=60)
    assert r.returncode == -9
    assert GPU0 not in load(d.host).persistent and json.loads(intent.read_text()) == [GPU0]
    d.start()
    wait_until(lambda: GPU0 in load(d.host).persistent, 30, "persistence on again")
    assert not intent.exists()
    assert "persistence mode on again for 0000:18:00.0" in d.ctl("events").stdout
