"""Simulated kernel uevents: one JSON datagram per event to DIR/run/uevent.sock.

Mirrors netlink's delivery model so the daemon's event code meets the same failure modes on the
simulator as on a host: nobody listening -> the event is gone; receive queue full -> the event is
gone too, and (like ENOBUFS on a netlink socket) the receiver learns that it lost something. The
loss is recorded by appending a byte to DIR/run/uevent.overflow *before* trying to send an
{"action": "overflow"} marker: either the marker gets through, or the queue is still full, in
which case the receiver drains it and then sees the counter grew. Either way it rescans.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
from pathlib import Path

import msgspec

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
         driver: str | None = None, **props) -> bool:
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
