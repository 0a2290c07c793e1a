"""Simulated kernel uevents: one JSON datagram per event to DIR/run/uevent.sock.

Mirrors netlink's delivery model so the daemon's event code meets the same failure modes on the
simulator as on a host: nobody listening -> the event is gone; receive queue full -> the event is
gone too, and (like ENOBUFS on a netlink socket) the receiver learns that it lost something. The
loss is recorded by appending a byte to DIR/run/uevent.overflow *before* trying to send an
{"action": "overflow"} marker: either the marker gets through, or the queue is still full, in
which case the receiver drains it and then sees the counter grew. Either way it rescans.

`SimEvents` is the receiving end: the daemon's device event source on a simulated host, with the
same callback interface as gpud.host.kernel.udev.UdevEvents (gpud.device_events).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import socket
import stat
from pathlib import Path

import msgspec

from gpud.device_events import RESCAN, SUBSYSTEMS, Delivery, DeviceEvent, DeviceEventCallback

UEVENT_ACTIONS = ("add", "remove", "change", "move", "online", "offline", "bind", "unbind")

class Uevent(msgspec.Struct, frozen=True):
    """One simulated kernel uevent, sent (emit) once the state change that caused it
    is saved, as the kernel sends its uevents after the change is visible in sysfs."""

    action: str  # one of UEVENT_ACTIONS
    subsystem: str  # pci, vfio, module, drivers
    address: str | None = None  # the kernel's name: BDF, group number, module or driver name
    driver: str | None = None  # DRIVER= on bind


SOCKET = "run/uevent.sock"
OVERFLOW = "run/uevent.overflow"
OVERFLOW_ACTION = "overflow"

_seq = itertools.count(1)
_DROPPED = (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTCONN, errno.ENOTSOCK)
_FULL = (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS)


def socket_path(host_dir: str | os.PathLike) -> Path:
    return Path(host_dir) / SOCKET


def overflow_path(host_dir: str | os.PathLike) -> Path:
    return Path(host_dir) / OVERFLOW


def overflow_count(host_dir: str | os.PathLike) -> int:
    try:
        return overflow_path(host_dir).stat().st_size
    except FileNotFoundError:
        return 0


def _send(sock: socket.socket, path: Path, payload: bytes) -> bool | None:
    """True sent, None nobody listening, False queue full."""
    try:
        sock.sendto(payload, os.fspath(path))
        return True
    except OSError as e:
        if e.errno in _FULL:
            return False
        if e.errno in _DROPPED:
            return None
        raise


def emit(host_dir: str | os.PathLike, action: str, subsystem: str, address: str | None = None,
         driver: str | None = None, **props: object) -> bool:
    """Send one event; never blocks. Returns True when it was queued to a listener."""
    path = socket_path(host_dir)
    if not path.exists():
        return False
    event = {"action": action, "subsystem": subsystem, "address": address, "driver": driver,
             "seq": next(_seq), "pid": os.getpid(), **props}
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sent = _send(sock, path, msgspec.json.encode(event))
        if sent is False:
            overflow_path(host_dir).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(overflow_path(host_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, b"x")
            finally:
                os.close(fd)
            _send(sock, path, msgspec.json.encode({"action": OVERFLOW_ACTION, "subsystem": None, "address": None,
                                                    "driver": None, "seq": next(_seq), "pid": os.getpid()}))
        return bool(sent)


class SimEvents:
    """Receives the simulated kernel's datagrams on `socket_path` (DIR/run/uevent.sock, bound here and
    removed on stop) and delivers DeviceEvent; RESCAN after an overflow marker or when the
    overflow counter next to the socket grew."""

    def __init__(self, callback: DeviceEventCallback, socket_path: str | os.PathLike, *,
                 subsystems: tuple[str, ...] = SUBSYSTEMS):
        self.deliver = Delivery(callback)
        self.socket_path = os.fspath(socket_path)
        self.subsystems = subsystems
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None
        self._overflow_seen = 0

    @property
    def _overflow_file(self) -> str:
        return os.path.join(os.path.dirname(self.socket_path), os.path.basename(OVERFLOW))

    def _overflow_count(self) -> int:
        try:
            return os.stat(self._overflow_file).st_size
        except OSError:
            return 0

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = self.deliver.loop = loop or asyncio.get_running_loop()
        path = self.socket_path
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
        self._loop.add_reader(sock.fileno(), self._on_readable)

    def stop(self) -> None:
        if self._sock is None:
            return
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass

    def _on_readable(self) -> None:
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
            if ev.get("action") == OVERFLOW_ACTION:
                rescan = True
            elif ev.get("subsystem") in self.subsystems:
                self.deliver(DeviceEvent(str(ev.get("action")), ev.get("subsystem"), ev.get("address"),
                                         ev.get("driver")))
        n = self._overflow_count()
        if n > self._overflow_seen:
            self._overflow_seen = n
            rescan = True
        if rescan:
            self.deliver(RESCAN)
