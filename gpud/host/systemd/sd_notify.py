"""The service side of systemd's notify and socket-activation protocols, spoken directly (a
datagram on $NOTIFY_SOCKET, fds from $LISTEN_FDS) so the daemon needs no libsystemd binding and
no D-Bus: readiness, status, watchdog pings, the listening socket, and an environment for
children that keeps those variables to the service itself. Nothing here may block the event loop
for long: the watchdog pings come from that loop, so a stuck loop must mean a stuck daemon.
"""

from __future__ import annotations

import array
import logging
import os
import select
import socket
import time
from collections.abc import Iterable, Mapping

log = logging.getLogger("gpud.systemd")

# Variables systemd hands to the service itself; a child that inherited them could send
# notifications or pick up our listening socket.
SERVICE_ONLY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
SD_LISTEN_FDS_START = 3


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment for child processes, without the service-only variables."""
    src = os.environ if env is None else env
    return {k: v for k, v in src.items() if k not in SERVICE_ONLY_ENV and not k.startswith("LISTEN_")}


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec=), or None when no watchdog is
    armed for this process (unset, zero, or WATCHDOG_PID names another process)."""
    src = os.environ if env is None else env
    try:
        usec = int(src.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = src.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2 / 1_000_000


def listen_socket(env: Mapping[str, str] | None = None, *, unset: bool = True) -> socket.socket | None:
    """The socket passed by gpud.socket (fd 3), or None when not socket-activated.

    Like sd_listen_fds(1), the LISTEN_* variables are removed from os.environ by default so
    that nothing started later mistakes fd 3 for its own."""
    src = os.environ if env is None else env
    try:
        pid = int(src.get("LISTEN_PID", ""))
        nfds = int(src.get("LISTEN_FDS", ""))
    except ValueError:
        return None
    if unset and env is None:
        for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(k, None)
    if pid != os.getpid() or nfds < 1:
        return None
    if nfds > 1:
        log.warning("socket activation passed %d fds; using fd %d only", nfds, SD_LISTEN_FDS_START)
    os.set_inheritable(SD_LISTEN_FDS_START, False)
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise OSError(f"fd {SD_LISTEN_FDS_START} from socket activation is not a unix stream socket")
    return sock


class Notifier:
    """sd_notify(3) for gpud; every method is a no-op when not started by systemd.

    A lost notification is logged, never raised: the service manager will act on the missing
    READY/WATCHDOG itself, and crashing the daemon over it would be worse."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        src = os.environ if env is None else env
        addr = src.get("NOTIFY_SOCKET") or None
        if addr is not None and addr.startswith("@"):
            addr = "\0" + addr[1:]
        if addr is not None and not addr.startswith(("/", "\0")):
            log.warning("ignoring NOTIFY_SOCKET=%r: not a unix socket path", addr)
            addr = None
        self.address = addr
        self._watchdog_interval = watchdog_interval(src)
        self._sock: socket.socket | None = None

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings, read at construction (the variables may be
        removed from the environment later)."""
        return self._watchdog_interval

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str, fds: Iterable[int] = ()) -> bool:
        """Send one datagram of KEY=VALUE lines; True when it was handed to the manager."""
        if self.address is None:
            return False
        data = "\n".join(fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            fds = list(fds)
            if fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                self._sock.sendmsg([data], anc, 0, self.address)
            else:
                self._sock.sendto(data, self.address)
            return True
        except OSError as e:
            log.warning("sd_notify %s failed: %s", fields[0].split("=", 1)[0] if fields else "", e)
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *_status(status))

    def status(self, line: str) -> bool:
        return self.notify(*_status(line))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def reloading(self, status: str | None = None) -> bool:
        """Since systemd 253 the timestamp is required to tell this reload from an older one."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", *_status(status))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, usec: int) -> bool:
        """Ask for `usec` more from now (start, reload or stop), for long MIG work at start."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(usec)}")

    def barrier(self, timeout: float = 5.0) -> bool:
        """Wait until the manager has processed every earlier notification (sd_notify_barrier):
        it closes the fd we pass with BARRIER=1 after handling what came before."""
        if self.address is None:
            return False
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            sent = self.notify("BARRIER=1", fds=[w])
            os.close(w)
            w = -1
            if not sent:
                return False
            p = select.poll()
            p.register(r, select.POLLHUP)
            return bool(p.poll(int(timeout * 1000)))
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status(line: str | None) -> tuple[str, ...]:
    if line is None:
        return ()
    return ("STATUS=" + " ".join(line.split("\n")).strip(),)
