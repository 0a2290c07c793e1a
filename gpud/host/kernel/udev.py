"""Device events from udev: a pyudev netlink monitor read on the event loop.

netlink drops events when its receive buffer overflows (ENOBUFS): the monitor is then rebuilt and
RESCAN delivered, so the daemon re-reads everything (see gpud.device_events).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gpud.device_events import RESCAN, SUBSYSTEMS, Delivery, DeviceEvent, DeviceEventCallback

log = logging.getLogger(__name__)

RECEIVE_BUFFER = 8 * 1024 * 1024


class UdevEvents:
    """`source="udev"`: events after udev processed them (rules ran, /dev nodes exist);
    `source="kernel"`: the kernel's raw uevents."""

    def __init__(self, callback: DeviceEventCallback, *, subsystems: tuple[str, ...] = SUBSYSTEMS,
                 receive_buffer: int = RECEIVE_BUFFER, source: str = "udev"):
        self.deliver = Delivery(callback)
        self.subsystems = subsystems
        self.receive_buffer = receive_buffer
        self.source = source
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitor: Any = None
        self._fd: int | None = None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = self.deliver.loop = loop or asyncio.get_running_loop()
        self._start_monitor()

    def stop(self) -> None:
        if self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)
        self._fd = None
        self._monitor = None

    def _start_monitor(self) -> None:
        import pyudev

        mon = pyudev.Monitor.from_netlink(pyudev.Context(), source=self.source)
        for s in self.subsystems:
            mon.filter_by(s)
        try:
            mon.set_receive_buffer_size(self.receive_buffer)  # SO_RCVBUFFORCE: needs CAP_NET_ADMIN
        except Exception as e:  # noqa: BLE001 - keep the default buffer
            log.debug("udev receive buffer not enlarged: %s", e)
        mon.start()
        assert self._loop is not None  # start() set it
        self._monitor = mon
        self._fd = mon.fileno()
        self._loop.add_reader(self._fd, self._on_readable)

    def _on_readable(self) -> None:
        mon = self._monitor
        try:
            while True:
                dev = mon.poll(timeout=0)
                if dev is None:
                    return
                if dev.subsystem in self.subsystems:
                    self.deliver(DeviceEvent(dev.action or "change", dev.subsystem, dev.sys_name, dev.driver))
        except OSError as e:  # ENOBUFS (events lost) or POLLERR: rebuild and rescan
            log.warning("udev monitor failed (%s): recreating it and rescanning", e)
            assert self._loop is not None and self._fd is not None  # readable: the monitor runs
            self._loop.remove_reader(self._fd)
            self._fd = None
            self._monitor = None
            try:
                self._start_monitor()
            except OSError:
                log.exception("udev monitor could not be recreated; events stop")
            self.deliver(RESCAN)
