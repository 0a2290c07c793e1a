"""The simulator's device event source end to end: the simulated kernel's events arrive as
DeviceEvent in order, overflow leads to RESCAN, a stale socket is replaced."""

from __future__ import annotations

import asyncio
import socket

from gpud.device_events import RESCAN, DeviceEvent
from gpud.sim import uevents
from gpud.sim.uevents import SimEvents
from tests.support.sim_kernel_host import AUDIO, GPU, adapter, make_host, to_vfio


async def _take(q: asyncio.Queue, n: int) -> list[DeviceEvent]:
    return [await asyncio.wait_for(q.get(), 10) for _ in range(n)]


async def test_sim_source_sees_kernel_events(tmp_path):
    d = make_host(tmp_path)
    q: asyncio.Queue = asyncio.Queue()
    src = SimEvents(q.put_nowait, uevents.socket_path(d))
    src.start()
    try:
        s = adapter(d)

        def rebind():
            s.load_module("vfio-pci")  # "drivers"/"module" events: filtered out
            to_vfio(s, GPU)
            to_vfio(s, AUDIO)

        await asyncio.to_thread(rebind)
        got = await _take(q, 5)
        assert got == [
            DeviceEvent("unbind", "pci", GPU, None),
            DeviceEvent("bind", "pci", GPU, "vfio-pci"),
            DeviceEvent("add", "vfio", "20", None),
            DeviceEvent("unbind", "pci", AUDIO, None),
            DeviceEvent("bind", "pci", AUDIO, "vfio-pci"),
        ]
        await asyncio.to_thread(s.write, f"bus/pci/devices/{AUDIO}/remove", "1")
        # the group keeps its /dev/vfio/20: the GPU is still on vfio-pci
        assert await _take(q, 2) == [DeviceEvent("unbind", "pci", AUDIO), DeviceEvent("remove", "pci", AUDIO)]
        await asyncio.to_thread(s.write, "bus/pci/drivers/vfio-pci/unbind", GPU)
        assert await _take(q, 2) == [DeviceEvent("remove", "vfio", "20"), DeviceEvent("unbind", "pci", GPU)]
        assert q.empty()
    finally:
        src.stop()
    assert not uevents.socket_path(d).exists()


async def test_sim_overflow_leads_to_rescan(tmp_path):
    d = str(tmp_path)
    q: asyncio.Queue = asyncio.Queue()
    src = SimEvents(q.put_nowait, uevents.socket_path(d))
    src.start()
    try:
        sent = 0
        # the loop does not run while we emit: the receive queue fills up, then events are lost
        while uevents.emit(d, "change", "pci", f"0000:00:{sent % 32:02x}.0"):
            sent += 1
            assert sent < 100_000
        assert uevents.overflow_count(d) == 1
        got = await _take(q, sent + 1)
        assert got[-1] == RESCAN and all(e.action == "change" for e in got[:-1])
    finally:
        src.stop()


def test_emit_without_listener_is_silent(tmp_path):
    assert uevents.emit(tmp_path, "add", "pci", GPU) is False  # no socket at all
    path = uevents.socket_path(tmp_path)
    path.parent.mkdir()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.close()  # stale socket file: ECONNREFUSED
    assert uevents.emit(tmp_path, "add", "pci", GPU) is False
    assert uevents.overflow_count(tmp_path) == 0


async def test_stale_socket_is_replaced(tmp_path):
    path = tmp_path / "run/uevent.sock"
    path.parent.mkdir()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.close()
    q: asyncio.Queue = asyncio.Queue()
    src = SimEvents(q.put_nowait, path)
    src.start()
    try:
        assert uevents.emit(tmp_path, "bind", "pci", GPU, "nvidia")
        assert await _take(q, 1) == [DeviceEvent("bind", "pci", GPU, "nvidia")]
    finally:
        src.stop()
