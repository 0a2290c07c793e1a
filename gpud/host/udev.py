"""Device events for the event loop: udev (pyudev netlink monitor) on a host, the simulator's
datagram socket otherwise; one callback interface for both.

Events are hints that make the daemon re-read sysfs/NVML, never state: netlink drops events when
its buffer overflows (ENOBUFS), and in containers often none arrive at all. So after any loss the
source delivers DeviceEvent("rescan") and the receiver re-reads everything.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import socket
import stat
from collections.abc import Callable
from typing import Any

import msgspec

log = logging.getLogger(__name__)

SUBSYSTEMS = ("pci", "vfio")
RECEIVE_BUFFER = 8 * 1024 * 1024
SIM_OVERFLOW = "uevent.overflow"  # next to the simulator's socket; see gpud.sim.uevents


class DeviceEvent(msgspec.Struct, frozen=True):
    action: str  # add remove bind unbind change ... or "rescan" after lost events
    subsystem: str | None = None  # pci | vfio
    address: str | None = None  # kernel name: BDF for pci, group number for vfio
    driver: str | None = None  # DRIVER= on bind


RESCAN = DeviceEvent("rescan")


class DeviceEvents:
    def __init__(self, callback: Callable[[DeviceEvent], Any], *, sim_socket: str | os.PathLike | None = None,
                 subsystems: tuple[str, ...] = SUBSYSTEMS, receive_buffer: int = RECEIVE_BUFFER,
                 source: str = "udev"):
        self.callback = callback
        self.sim_socket = os.fspath(sim_socket) if sim_socket is not None else None
        self.subsystems = subsystems
        self.receive_buffer = receive_buffer
        self.source = source
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitor: Any = None
        self._sock: socket.socket | None = None
        self._fd: int | None = None
        self._overflow_seen = 0
        self._tasks: set[asyncio.Task] = set()

    # ---- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        if self.sim_socket is not None:
            self._start_sim()
        else:
            self._start_udev()

    def stop(self) -> None:
        if self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)
        self._fd = None
        self._monitor = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.sim_socket)
            except OSError:
                pass

    def _deliver(self, event: DeviceEvent) -> None:
        try:
            res = self.callback(event)
            if inspect.isawaitable(res):
                task = asyncio.ensure_future(res, loop=self._loop)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except Exception:
            log.exception("device event callback failed for %s", event)

    # ---- real host: pyudev
    def _start_udev(self) -> None:
        import pyudev

        mon = pyudev.Monitor.from_netlink(pyudev.Context(), source=self.source)
        for s in self.subsystems:
            mon.filter_by(s)
        try:
            mon.set_receive_buffer_size(self.receive_buffer)  # SO_RCVBUFFORCE: needs CAP_NET_ADMIN
        except Exception as e:  # keep the default buffer
            log.debug("udev receive buffer not enlarged: %s", e)
        mon.start()
        self._monitor = mon
        self._fd = mon.fileno()
        self._loop.add_reader(self._fd, self._on_udev)

    def _on_udev(self) -> None:
        mon = self._monitor
        try:
            while True:
                dev = mon.poll(timeout=0)
                if dev is None:
                    return
                if dev.subsystem in self.subsystems:
                    self._deliver(DeviceEvent(dev.action or "change", dev.subsystem, dev.sys_name, dev.driver))
        except OSError as e:  # ENOBUFS (events lost) or POLLERR: rebuild and rescan
            log.warning("udev monitor failed (%s): recreating it and rescanning", e)
            self._loop.remove_reader(self._fd)
            self._fd = None
            self._monitor = None
            try:
                self._start_udev()
            except OSError:
                log.exception("udev monitor could not be recreated; events stop")
            self._deliver(RESCAN)

    # ---- simulator: datagram socket
    def _overflow_count(self) -> int:
        try:
            return os.stat(os.path.join(os.path.dirname(self.sim_socket), SIM_OVERFLOW)).st_size
        except OSError:
            return 0

    def _start_sim(self) -> None:
        path = self.sim_socket
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # stale: datagram sockets have no listener to detect
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        sock.bind(path)
        sock.setblocking(False)
        self._sock = sock
        self._overflow_seen = self._overflow_count()
        self._fd = sock.fileno()
        self._loop.add_reader(self._fd, self._on_sim)

    def _on_sim(self) -> None:
        rescan = False
        while self._sock is not None:
            try:
                data = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                rescan = True
                break
            try:
                ev = msgspec.json.decode(data)
            except msgspec.DecodeError:
                continue
            if not isinstance(ev, dict):
                continue
            if ev.get("action") == "overflow":
                rescan = True
            elif ev.get("subsystem") in self.subsystems:
                self._deliver(DeviceEvent(str(ev.get("action")), ev.get("subsystem"), ev.get("address"),
                                          ev.get("driver")))
        n = self._overflow_count()
        if n > self._overflow_seen:
            self._overflow_seen = n
            rescan = True
        if rescan:
            self._deliver(RESCAN)
