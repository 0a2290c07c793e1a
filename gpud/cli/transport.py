"""gpudctl's transport: one blocking Unix-socket connection to gpud, requests and typed replies.

No asyncio: people run gpudctl in loops and scripts, so start-up time matters more than anything
it could share with the daemon. Every reply is decoded into its `gpud.wire.replies` struct, the same
one the daemon built, so client and daemon cannot disagree on a field.
"""

from __future__ import annotations

import _socket  # the C module `socket` wraps: see Client._connect
import math
import select
from collections.abc import Callable, Iterator
from typing import Any

from gpud.cli.escape import escaped
from gpud.wire import protocol as wire
from gpud.wire import replies as wire_replies

DEFAULT_SOCKET = "/run/gpud/gpud.sock"
DEFAULT_TIMEOUT = 30.0  # seconds for one reply; `apply --wait` and `events -f` wait longer
NO_LIMIT = math.inf  # a timeout that never expires: wait as long as gpud takes


class Unreachable(Exception):
    """No conversation with gpud was possible (exit 3)."""


class DaemonError(Exception):
    """gpud answered with an error response."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[type[DaemonError], tuple[str, str]]:
        """Pickled as made: a process pool sends a worker's exception back to its parent."""
        return (type(self), (self.code, self.message))


class WaitTimeout(Exception):
    """No reply within the client's own deadline."""


class Client:
    """One connection to gpud; requests are answered in order on it."""

    def __init__(self, path: str, *, timeout: float = DEFAULT_TIMEOUT, escape: bool = False) -> None:
        """`timeout`: seconds for each reply unless a request says otherwise (NO_LIMIT: none);
        `escape`: every string of replies, events and errors made safe for a terminal
        (gpud.cli.escape), for display; without it they are exactly as gpud sent them."""
        self.path = path
        self.timeout = timeout
        self._shown: Callable[[Any], Any] = escaped if escape else _exact
        self._reader = wire.FrameReader()
        self._sock: _socket.socket | None = None
        self._next_id = 1

    def _connect(self) -> _socket.socket:
        if self._sock is None:
            # `_socket` is the standard library's socket type itself; `socket` adds makefile, sendfile
            # and enum names for constants (AddressFamily...), built by each import at a cost of
            # ~2 ms: more than a tenth of what a `gpudctl status` may take. Nothing here uses them.
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            sock.settimeout(_socket_timeout(self.timeout))
            try:
                sock.connect(self.path)
            except OSError as e:
                sock.close()
                hint = ""
                if isinstance(e, (FileNotFoundError, ConnectionRefusedError)):
                    hint = " (is gpud running?)"
                elif isinstance(e, PermissionError):
                    hint = " (needs root or membership of the gpud group)"
                raise Unreachable(f"cannot reach gpud at {self.path}: {e.strerror or e}{hint}") from None
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a program that keeps no reference closes its connection too
        if getattr(self, "_sock", None) is not None:
            self.close()

    def _read(self) -> wire.Response | wire.EventFrame:
        assert self._sock is not None
        try:
            payload = self._reader.read_sync(self._sock)
        except TimeoutError:
            waited = self._sock.gettimeout()
            raise WaitTimeout(f"gpud did not answer within {waited:g} s") from None
        except OSError as e:
            raise Unreachable(f"lost the connection to gpud at {self.path}: {e.strerror or e}") from None
        if payload is None:
            raise Unreachable(f"gpud at {self.path} closed the connection")
        return wire.decode_message(payload)

    def request(self, op: str, args: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        """Send one request, return its result as the op's wire struct; DaemonError on an error
        response. `timeout`: seconds for this reply (None: the client's; NO_LIMIT: no limit)."""
        sock = self._connect()
        rid = self._next_id
        self._next_id += 1
        sock.settimeout(_socket_timeout(self.timeout if timeout is None else timeout))
        try:
            sock.sendall(wire.encode_frame(wire.Request(id=rid, op=op, args=args or {})))
        except OSError as e:
            raise Unreachable(f"lost the connection to gpud at {self.path}: {e.strerror or e}") from None
        msg = self._read()
        if not isinstance(msg, wire.Response) or msg.id not in (rid, 0):
            raise wire.FrameError(f"unexpected frame from gpud (waiting for reply {rid})")
        if not msg.ok:
            err = msg.error or wire.ErrorInfo(code=wire.E_INTERNAL, message="error without detail")
            raise DaemonError(err.code, self._shown(err.message))
        return self._shown(wire_replies.decode_result(op, msg.result))

    def events(self) -> Iterator[wire.Event]:
        """Yield the recent history, then every new event until gpud closes the stream."""
        reply: wire_replies.EventsReply = self.request("events", {"follow": True}, timeout=NO_LIMIT)
        yield from reply.events  # escaped with the reply
        yield from self._frames()

    def follow(self) -> Iterator[wire.Event]:
        """Subscribe now and return the events published from here on (no history): what happens
        after this call returns is not missed, whenever the iterator is read."""
        self.request("events", {"follow": True}, timeout=NO_LIMIT)
        return self._frames()

    def next_event(self, timeout: float) -> wire.Event | None:
        """After `follow()`: the next event if one arrives within `timeout` seconds, else None.
        Waits for the socket to be readable first, so a frame is never cut by the timeout."""
        assert self._sock is not None, "follow() first"
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if not readable:
            return None
        msg = self._read()
        if isinstance(msg, wire.EventFrame):
            return self._shown(msg.event)
        if not msg.ok and msg.error is not None:
            raise DaemonError(msg.error.code, self._shown(msg.error.message))
        raise wire.FrameError("unexpected reply on an event stream")

    def _frames(self) -> Iterator[wire.Event]:
        while True:
            msg = self._read()
            if isinstance(msg, wire.EventFrame):
                yield self._shown(msg.event)
            elif not msg.ok and msg.error is not None:
                raise DaemonError(msg.error.code, self._shown(msg.error.message))



def _exact(value: Any) -> Any:
    return value


def _socket_timeout(seconds: float) -> float | None:
    """socket.settimeout's spelling: None blocks for ever."""
    return None if math.isinf(seconds) else seconds
