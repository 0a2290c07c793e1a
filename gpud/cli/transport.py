"""gpudctl's transport: one blocking Unix-socket connection to gpud, requests and replies.

No asyncio and no msgspec: people run gpudctl in loops and scripts, so start-up time matters more
than anything it could share with the daemon. Frames are MessagePack either way: the client reads
and writes them with `msgpack` (the daemon with msgspec's typed structs), and every reply is read
through gpud.cli.view as the `gpud.wire.replies` struct the daemon built.
"""

from __future__ import annotations

import _socket  # the C module `socket` wraps: see Client._connect
import math

import msgpack

from gpud.cli.escape import term
from gpud.cli.view import EVENT, reply
from gpud.wire import frames

TYPE_CHECKING = False
if TYPE_CHECKING:  # the types only: importing `typing` and the structs costs a run time it does not use
    from collections.abc import Iterator
    from typing import Any

    from gpud.wire import protocol as wire
    from gpud.wire import replies as wire_replies

DEFAULT_SOCKET = "/run/gpud/gpud.sock"
DEFAULT_TIMEOUT = 30.0  # seconds for one reply; `apply --wait` and `events -f` wait longer
# Seconds the status replica may take before gpudctl asks the daemon instead: it answers from
# memory in well under a millisecond, so a wait this long means it is stopped or stuck (and the
# daemon kills one that stops reading its frames within a second: gpud.api.status_feed).
REPLICA_TIMEOUT = 0.5
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
        self._escape = escape
        self._reader = frames.FrameReader()
        self._sock: _socket.socket | None = None
        # the status replica's connection: None until asked, False once it could not answer
        self._replica: _socket.socket | None | bool = None
        self._on: _socket.socket | None = None  # the connection of the exchange in progress (_read)
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
        if isinstance(self._replica, _socket.socket):
            self._replica.close()
            self._replica = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a program that keeps no reference closes its connection too
        if getattr(self, "_sock", None) is not None or isinstance(getattr(self, "_replica", None), _socket.socket):
            self.close()

    def _read(self) -> dict[str, Any]:
        """The next frame from gpud: a response `{id, ok, result, error}`, or an event frame `{id, event}`
        (the shapes of gpud.wire.protocol's Response and EventFrame), checked as far as gpudctl relies on."""
        sock = self._on
        assert sock is not None
        try:
            payload = self._reader.read_sync(sock)
        except TimeoutError:
            waited = sock.gettimeout()
            raise WaitTimeout(f"gpud did not answer within {waited:g} s") from None
        except OSError as e:
            raise Unreachable(f"lost the connection to gpud at {self.path}: {e.strerror or e}") from None
        if payload is None:
            raise Unreachable(f"gpud at {self.path} closed the connection")
        return _message(payload)

    def request(self, op: str, args: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        """Send one request, return its result read as the op's wire struct (gpud.cli.view); DaemonError
        on an error response. `timeout`: seconds for this reply (None: the client's; NO_LIMIT: no limit)."""
        rid = self._next_id
        self._next_id += 1
        request = frames.frame(msgpack.packb({"id": rid, "op": op, "args": args or {}}))
        msg = self._from_replica(request, rid) if op == "status" and not (args or {}).get("fresh") else None
        if msg is None:
            sock = self._on = self._connect()
            sock.settimeout(_socket_timeout(self.timeout if timeout is None else timeout))
            try:
                sock.sendall(request)
            except OSError as e:
                raise Unreachable(f"lost the connection to gpud at {self.path}: {e.strerror or e}") from None
            msg = self._read()
            if "ok" not in msg or msg["id"] not in (rid, 0):
                raise frames.FrameError(f"unexpected frame from gpud (waiting for reply {rid})")
            if not msg["ok"]:
                raise _daemon_error(msg, self._escape)
        result = msg.get("result")
        if not isinstance(result, dict):
            raise frames.FrameError(f"malformed {op} result from gpud: expected a map, got {type(result).__name__}")
        return reply(op, result, escape=self._escape)

    def _from_replica(self, request: bytes, rid: int) -> dict[str, Any] | None:
        """The status replica's successful answer to `request` (gpud.api.status_replica: `status`
        from the daemon's last snapshot, in a process of its own), or None: ask the daemon. Any
        failure of the replica (none listening, a refusal, `elsewhere`, silence) leaves it out of
        this client's later requests too; the daemon then answers, or says why not."""
        sock = self._replica
        if sock is False:
            return None
        try:
            if not isinstance(sock, _socket.socket):
                sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
                self._replica = sock
                sock.settimeout(min(REPLICA_TIMEOUT, self.timeout))
                sock.connect(frames.status_socket(self.path))
            sock.sendall(request)
            self._on = sock
            msg = self._read()
        except (OSError, frames.FrameError, Unreachable, WaitTimeout):
            msg = None
        if msg is not None and msg.get("ok") is True and msg["id"] == rid:
            return msg
        if isinstance(self._replica, _socket.socket):
            self._replica.close()
        self._replica = False
        return None

    def events(self) -> Iterator[wire.Event]:
        """Yield the recent history, then every new event until gpud closes the stream."""
        history: wire_replies.EventsReply = self.request("events", {"follow": True}, timeout=NO_LIMIT)
        yield from history.events  # escaped with the reply
        yield from self._frames()

    def follow(self) -> Iterator[wire.Event]:
        """Subscribe now and return the events published from here on (no history): what happens
        after this call returns is not missed, whenever the iterator is read."""
        self.request("events", {"follow": True}, timeout=NO_LIMIT)
        return self._frames()

    def next_event(self, timeout: float) -> wire.Event | None:
        """After `follow()`: the next event if one arrives within `timeout` seconds, else None.
        Waits for the socket to be readable first, so a frame is never cut by the timeout."""
        import select  # only `apply --wait` waits for events with a timeout

        assert self._sock is not None, "follow() first"
        self._on = self._sock
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if not readable:
            return None
        event = self._event(self._read())
        if event is None:
            raise frames.FrameError("unexpected reply on an event stream")
        return event

    def _frames(self) -> Iterator[wire.Event]:
        while True:
            self._on = self._sock
            event = self._event(self._read())
            if event is not None:
                yield event

    def _event(self, msg: dict[str, Any]) -> Any:
        """An event frame's event; None for a response that is no error; DaemonError for one that is."""
        if "ok" not in msg:
            return reply(EVENT, msg["event"], escape=self._escape)
        if not msg["ok"] and msg.get("error") is not None:
            raise _daemon_error(msg, self._escape)
        return None


def _message(payload: bytes) -> dict[str, Any]:
    """A frame's map, with the fields of a Response or an EventFrame that gpudctl reads checked."""
    try:
        msg = msgpack.unpackb(payload)
    except (ValueError, TypeError) as e:  # msgpack's errors are ValueErrors; TypeError: an unhashable key
        raise frames.FrameError(f"malformed message from gpud: {e}") from None
    if not isinstance(msg, dict) or not _is_int(msg.get("id")):
        raise frames.FrameError("malformed message from gpud: not a map with an integer `id`")
    if "event" in msg and "ok" not in msg:
        if not isinstance(msg["event"], dict):
            raise frames.FrameError("malformed message from gpud: `event` is not a map")
        return msg
    if not isinstance(msg.get("ok"), bool):
        raise frames.FrameError("malformed message from gpud: no boolean `ok`")
    error = msg.get("error")
    if error is not None and not (isinstance(error, dict) and isinstance(error.get("code"), str)
                                  and isinstance(error.get("message"), str)):
        raise frames.FrameError("malformed message from gpud: `error` is not a map of a code and a message")
    return msg


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _daemon_error(msg: dict[str, Any], escape: bool) -> DaemonError:
    error = msg.get("error") or {"code": frames.E_INTERNAL, "message": "error without detail"}
    return DaemonError(error["code"], term(error["message"]) if escape else error["message"])


def _socket_timeout(seconds: float) -> float | None:
    """socket.settimeout's spelling: None blocks for ever."""
    return None if math.isinf(seconds) else seconds
