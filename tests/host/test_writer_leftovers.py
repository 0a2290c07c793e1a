"""Writer helpers never outlive a killed daemon, and a restart ends any left from before it
writes. Real processes: a "daemon" child that starts a helper blocked in the kernel (open of a
FIFO nobody reads, as an unbind waits), then SIGKILL; the helper's fate is read from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from gpud.host.kernel import deadline_write, writer_leftovers
from tests.support.present import present
from tests.support.processes import reap

PCI = "0000:fc:00.0"  # an address no other test uses: the stuck registry is per process
REL = "bus/pci/drivers/nvidia/unbind"


def _wait_for(cond, what: str, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _root(tmp_path):
    root = tmp_path / "sys"
    (root / REL).parent.mkdir(parents=True)
    os.mkfifo(root / REL)  # a write here blocks in the kernel until a reader comes
    return str(root)


def _helpers(root):
    return writer_leftovers._helpers(root, "/proc")


def test_a_helper_dies_with_a_daemon_killed_by_sigkill(tmp_path):
    root = _root(tmp_path)
    daemon = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import threading
        from gpud.host.kernel.deadline_write import write_with_deadline
        from gpud.host.kernel.sysfs import Sysfs
        def work():  # from a worker thread that ends: the helper must not die with the thread
            try:
                write_with_deadline(Sysfs({root!r}), {REL!r}, {PCI!r}, {PCI!r}, timeout=0.5, kmsg="/nonexistent")
            except Exception as e:
                print("stuck", e, flush=True)
        t = threading.Thread(target=work); t.start(); t.join()
        threading.Event().wait()
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert present(daemon.stdout).readline().startswith("stuck")
        helpers = _helpers(root)
        assert len(helpers) == 1  # alive after its starting thread ended
        pid = helpers[0][0]
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        _wait_for(lambda: not writer_leftovers._running(pid, "/proc"), "the helper to die with its daemon")
    finally:
        reap(daemon)
        for pid, _, _ in _helpers(root):
            os.kill(pid, signal.SIGKILL)


def _orphan(root):
    """A helper as an older gpud left it: no parent-death signal, writing under `root`."""
    return subprocess.Popen([sys.executable, "-m", "gpud.host.kernel.sysfs_writer", "--root", root, "--", REL, PCI],
                            stdout=subprocess.PIPE, start_new_session=True)


def test_a_restart_ends_the_helpers_left_from_before(tmp_path):
    root = _root(tmp_path)
    other_root = _root(tmp_path / "other")
    left, other = _orphan(root), _orphan(other_root)
    try:
        _wait_for(lambda: _helpers(root) and left.stdout.read(1) == b"R", "the leftover to begin its write")
        found = writer_leftovers.end_leftovers(root, timeout=10)
        assert [(f.pid, f.pci, f.ended) for f in found] == [(left.pid, PCI, True)]
        assert left.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None  # another host's helper is not ours to end
        assert deadline_write.stuck_write_for(PCI) is None
    finally:
        for p in (left, other):
            reap(p)


def test_a_leftover_that_cannot_be_ended_keeps_its_device_waiting(tmp_path, monkeypatch):
    root = _root(tmp_path)
    left = _orphan(root)
    try:
        _wait_for(lambda: bool(_helpers(root)), "the leftover")
        monkeypatch.setattr(writer_leftovers.os, "kill", lambda pid, sig: None)  # as in D state: it stays
        found = writer_leftovers.end_leftovers(root, timeout=0.2)
        assert [(f.pid, f.ended) for f in found] == [(left.pid, False)]
        stuck = deadline_write.stuck_write_for(PCI)
        assert stuck is not None and stuck.pid == left.pid and "earlier gpud" in stuck.reason
        monkeypatch.undo()
        left.kill()
        left.wait()
        _wait_for(lambda: deadline_write.stuck_write_for(PCI) is None, "the registry to let the device go")
    finally:
        reap(left)
