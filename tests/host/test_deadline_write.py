"""The deadline writer on real files (no simulator): the helper process does the one write(2),
a refused write keeps its errno, and a write the kernel keeps blocked (open of a FIFO nobody
reads) is reported stuck, kept in the registry and reaped once the kernel lets it finish."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from gpud.host.kernel import deadline_write
from gpud.host.kernel.deadline_write import WriteFailed, WriteStuck, write_with_deadline
from gpud.host.kernel.sysfs import Sysfs


def _wait_for(cond, *, what: str, limit: float = 20.0) -> None:
    """Bounded wait on a condition (fails only if it never happens)."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_the_helper_writes_the_value_with_one_write(tmp_path):
    attr = tmp_path / "bus/pci/devices/0000:01:00.0/driver_override"
    attr.parent.mkdir(parents=True)
    attr.write_text("")
    write_with_deadline(Sysfs(str(tmp_path)), "bus/pci/devices/0000:01:00.0/driver_override", "vfio-pci",
                        "0000:01:00.0", timeout=10)
    assert attr.read_text() == "vfio-pci"


def test_a_refused_write_keeps_errno_and_meaning(tmp_path):
    with pytest.raises(WriteFailed) as e:
        write_with_deadline(Sysfs(str(tmp_path)), "bus/pci/drivers/vfio-pci/bind", "0000:01:00.0",
                            "0000:01:00.0", timeout=10)
    assert e.value.errno == errno.ENOENT
    assert e.value.path == str(tmp_path / "bus/pci/drivers/vfio-pci/bind")


def test_a_blocked_write_is_stuck_then_reaped_when_the_kernel_lets_go(tmp_path):
    pci = "0000:fd:00.0"  # an address no other test uses: the registry is per process
    fifo = tmp_path / "unbind"
    os.mkfifo(fifo)  # open(O_WRONLY) blocks in the kernel until a reader opens it
    result: dict[str, BaseException] = {}

    def from_a_worker_thread() -> None:
        try:
            write_with_deadline(Sysfs(str(tmp_path)), "unbind", pci, pci, timeout=0.5,
                                kmsg=str(tmp_path / "no-kmsg"))
        except BaseException as e:  # noqa: BLE001 - examined below
            result["error"] = e

    t = threading.Thread(target=from_a_worker_thread)
    t.start()
    t.join(60)
    assert not t.is_alive()
    stuck = result["error"]
    assert isinstance(stuck, WriteStuck), stuck
    assert stuck.path == str(fifo) and "state" in stuck.reason
    record = deadline_write.stuck_write_for(pci)
    assert record is not None and record.pid == stuck.pid and record.value == pci
    assert os.path.exists(f"/proc/{stuck.pid}")  # abandoned, not killed
    fd = os.open(fifo, os.O_RDONLY)  # the kernel lets the open return; the helper writes and exits
    try:
        _wait_for(lambda: deadline_write.stuck_write_for(pci) is None, what="the reaper")
        assert os.read(fd, 100) == pci.encode()
    finally:
        os.close(fd)
    assert record.exit_status == 0


def test_a_store_that_cannot_be_rebuilt_in_the_helper_is_refused(tmp_path):
    def store(path: str, data: bytes) -> int:
        return len(data)

    with pytest.raises(TypeError, match="child_spec"):
        write_with_deadline(Sysfs(str(tmp_path), store=store), "reset", "1", "0000:01:00.0", timeout=5)


def test_abandoned_helpers_are_killed_and_reaped_when_gpud_stops(tmp_path):
    pci = "0000:fc:00.0"  # an address no other test uses: the registry is per process
    fifo = tmp_path / "unbind"
    os.mkfifo(fifo)  # nobody ever opens it for reading: the helper would block forever
    with pytest.raises(WriteStuck) as stuck:
        write_with_deadline(Sysfs(str(tmp_path)), "unbind", pci, pci, timeout=0.5, kmsg=str(tmp_path / "no-kmsg"))
    record = deadline_write.stuck_write_for(pci)
    assert record is not None and os.path.exists(f"/proc/{stuck.value.pid}")
    assert deadline_write.end_stuck_writes(timeout=30) == []
    assert deadline_write.stuck_write_for(pci) is None
    assert record.exit_status == -9  # SIGKILL, and reaped (waited for): no zombie is left
    assert not os.path.exists(f"/proc/{stuck.value.pid}")
