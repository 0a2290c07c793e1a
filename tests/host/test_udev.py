"""The udev device event source: a real pyudev monitor can be made, and after ENOBUFS the
monitor is rebuilt and RESCAN delivered."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import types

import pytest

from gpud.device_events import RESCAN, SUBSYSTEMS, DeviceEvent
from gpud.host.kernel.udev import UdevEvents

GPU = "0000:17:00.0"


async def _take(q: asyncio.Queue, n: int) -> list[DeviceEvent]:
    return [await asyncio.wait_for(q.get(), 10) for _ in range(n)]


def test_real_pyudev_monitor_can_be_created():
    pyudev = pytest.importorskip("pyudev")
    try:
        mon = pyudev.Monitor.from_netlink(pyudev.Context())
        mon.filter_by("pci")
        mon.filter_by("vfio")
        mon.start()
    except OSError as e:
        pytest.skip(f"netlink uevent socket unavailable in this container: {e}")
    assert mon.fileno() >= 0


class _FakeMonitor:
    """Stands in for pyudev.Monitor: a readable fd, queued devices, then ENOBUFS."""

    made: list[_FakeMonitor] = []

    def __init__(self, fail: bool):
        self.r, self.w = socket.socketpair()
        self.w.send(b"x")  # readable from the start
        self.fail = fail
        self.items = [types.SimpleNamespace(action="bind", subsystem="pci", sys_name=GPU, driver="nvidia"),
                      types.SimpleNamespace(action="add", subsystem="drivers", sys_name="vfio-pci", driver=None)]
        self.filters: list[str] = []
        _FakeMonitor.made.append(self)

    @classmethod
    def from_netlink(cls, context, source="udev"):
        return cls(fail=not cls.made)

    def filter_by(self, subsystem):
        self.filters.append(subsystem)

    def set_receive_buffer_size(self, size):
        raise OSError(errno.EPERM, "needs CAP_NET_ADMIN")

    def start(self):
        pass

    def fileno(self):
        return self.r.fileno()

    def poll(self, timeout=None):
        if self.items:
            return self.items.pop(0)
        if self.fail:
            raise OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))
        self.r.recv(1)
        return None


async def test_udev_source_rebuilds_monitor_and_rescans_after_enobufs(monkeypatch):
    import pyudev

    _FakeMonitor.made = []
    monkeypatch.setattr(pyudev, "Monitor", _FakeMonitor)
    monkeypatch.setattr(pyudev, "Context", lambda: None)
    q: asyncio.Queue = asyncio.Queue()
    src = UdevEvents(q.put_nowait)
    src.start()
    try:
        got = await _take(q, 3)
        assert got == [DeviceEvent("bind", "pci", GPU, "nvidia"), RESCAN, DeviceEvent("bind", "pci", GPU, "nvidia")]
        assert len(_FakeMonitor.made) == 2 and _FakeMonitor.made[1].filters == list(SUBSYSTEMS)
    finally:
        src.stop()
