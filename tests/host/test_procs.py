"""Procs on the real /proc of this machine, with a child process holding a stand-in device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpud.host.kernel.procs import Procs
from tests.support.present import present
from tests.support.processes import reap

HOLD = "import sys; f = open(sys.argv[1], 'rb'); print('open', flush=True); sys.stdin.read()"


def test_holders_on_real_proc(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia7").write_bytes(b"")
    (dev / "nvidiactl").write_bytes(b"")
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(dev / "nvidia7")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert present(child.stdout).readline() == "open\n"  # the file is open now
        procs = Procs("/proc", str(dev))
        found = procs.holders(["/dev/nvidia7", "/dev/nvidiactl"])
        comm = Path(f"/proc/{child.pid}/comm").read_text().strip()
        assert [(h.pid, h.name, h.device) for h in found] == [(child.pid, comm, "/dev/nvidia7")]
        assert procs.holders(["/dev/nvidiactl"]) == []
    finally:
        present(child.stdin).close()  # it exits
        child.wait(10)
        reap(child)
    assert Procs("/proc", str(dev)).holders(["/dev/nvidia7"]) == []


def test_vanished_and_unreadable_pids_are_skipped(tmp_path):
    proc = tmp_path / "proc"
    (proc / "10/fd").mkdir(parents=True)
    (proc / "10/comm").write_text("ok\n")
    os.symlink(str(tmp_path / "dev/vfio/12"), proc / "10/fd/3")
    (proc / "11").mkdir()  # exited: no fd dir any more
    (proc / "12/fd").mkdir(parents=True)  # fd link but comm gone (exited mid-scan)
    os.symlink(str(tmp_path / "dev/vfio/12"), proc / "12/fd/4")
    (proc / "self").mkdir()
    found = Procs(str(proc), str(tmp_path / "dev")).holders(["/dev/vfio/12"])
    assert [(h.pid, h.name, h.device) for h in found] == [(10, "ok", "/dev/vfio/12")]


def test_minor_and_unbind_lock_without_driver(tmp_path):
    procs = Procs(str(tmp_path), "/dev")
    assert procs.nvidia_minor("0000:3b:00.0") is None
    assert procs.take_unbind_lock("0000:3b:00.0") is False
    gpu = tmp_path / "driver/nvidia/gpus/0000:3b:00.0"
    gpu.mkdir(parents=True)
    (gpu / "information").write_text("Model: \t\t NVIDIA H200\nDevice Minor: \t 5\n")
    assert procs.nvidia_minor("0000:3b:00.0") == 5


def test_unbind_lock_read_only(tmp_path):
    import pytest

    from gpud.host.readonly import ReadOnlyError

    with pytest.raises(ReadOnlyError):
        Procs(str(tmp_path), read_only=True).take_unbind_lock("0000:3b:00.0")
