"""The gpud socket protocol's framing and vocabulary, without msgspec: frame limits, error codes, the
ops, FrameError and the frame reader, and `frame` (a payload with its length prefix).

Why a module of its own: gpudctl reads and writes frames with `msgpack` (gpud.cli.transport) and
never imports msgspec, whose import is most of a client's start-up; the daemon encodes and decodes
the same frames with msgspec's typed structs (gpud.wire.protocol, which re-exports every name here).
Standard library only.

Wire format (protocol 1): each frame is a 4-byte big-endian unsigned payload length followed by
one MessagePack map (gpud.wire.protocol says which).
"""

from __future__ import annotations

import struct

TYPE_CHECKING = False
if TYPE_CHECKING:  # `typing` is a cost every gpudctl run would pay
    from collections.abc import Iterator
    from typing import Any

PROTOCOL = 1
MAX_FRAME = 1 << 20  # 1 MiB: a status of a 16-GPU host with every instance is ~40 KiB
# The most entries a reply carries in a list that grows with its input (layout errors, warnings):
# the rest are counted in the reply's `*_omitted` field and a last entry "... and N more".
MAX_LISTED = 100
# The largest layout text gpud reads or checks (gpud.host.files.layout_source.MAX_LAYOUT_BYTES): half a
# frame, so `check` of any acceptable layout fits in one request. gpudctl refuses more before sending.
MAX_LAYOUT_TEXT = 512 * 1024
HEADER = struct.Struct(">I")

# Error codes the server itself produces; handlers add their own (e.g. "invalid-layout").
E_BAD_FRAME = "bad-frame"  # not MessagePack, not a map, or missing id/op
E_TOO_LARGE = "too-large"  # frame above the limit; the connection is closed unread
E_UNKNOWN_OP = "unknown-op"
E_BAD_ARGS = "bad-args"
E_FORBIDDEN = "forbidden"
E_BUSY = "busy"  # too many connections
E_INTERNAL = "internal"
E_INVALID_LAYOUT = "invalid-layout"
E_TIMEOUT = "timeout"
# Lease refusals (gpud.engine.leases): gpudctl exits 4 for no-room / not-found / conflict, 5 for in-use.
E_NO_ROOM = "no-room"  # no dynamic GPU has room; the message names the shortfall
E_NOT_FOUND = "not-found"
E_IN_USE = "in-use"  # a release of an instance processes use, under on-busy: fail
E_CONFLICT = "conflict"  # whole-GPU and MIG leases exclude each other; a lease still being made
E_FAILED = "failed"  # NVML or the state directory refused; nothing leased
E_ELSEWHERE = "elsewhere"  # the status replica cannot answer this: ask the daemon's own socket

READ_OPS = frozenset({"status", "check", "plan", "events", "version", "mig-profiles", "mig-compute-profiles",
                      "passthrough", "stats", "labels", "vgpu-types", "leases"})
WRITE_OPS = frozenset({"apply", "reload", "select"})
LEASE_OPS = frozenset({"lease", "release"})  # root, or members of the layout's policy.lease-group
OPS = READ_OPS | WRITE_OPS | LEASE_OPS


def whole_frames(buf: bytearray) -> Iterator[bytes]:
    """The payloads of the whole frames at the start of `buf`, each taken out of it as it is
    yielded; a frame still arriving stays (for a stream read in pieces, as the status replica's
    feed is on both of its ends)."""
    while len(buf) >= HEADER.size:
        (n,) = HEADER.unpack_from(buf)
        if len(buf) < HEADER.size + n:
            return
        payload = bytes(buf[HEADER.size:HEADER.size + n])
        del buf[:HEADER.size + n]
        yield payload


def status_socket(path: str) -> str:
    """The status replica's socket beside the daemon's at `path` (gpud.api.status_replica):
    /run/gpud/gpud.sock -> /run/gpud/gpud-status.sock."""
    stem = path[:-5] if path.endswith(".sock") else path
    return stem + "-status.sock"


class FrameError(ValueError):
    """A frame that cannot be read: truncated, too large, or not a valid message."""

    code = E_BAD_FRAME

    def __init__(self, message: str, *, request_id: int = 0) -> None:
        super().__init__(message)
        self.request_id = request_id  # best effort, so the error response can name the request


class FrameTooLarge(FrameError):
    code = E_TOO_LARGE



def frame(payload: bytes, *, max_frame: int = MAX_FRAME) -> bytes:
    """`payload` with its length prefix. Refuses to produce a frame the peer would reject."""
    if len(payload) > max_frame:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds the limit of {max_frame}")
    return HEADER.pack(len(payload)) + payload


class FrameReader:
    """Reads length-prefixed frames from a blocking socket (client) or a StreamReader (server).

    Both return the payload bytes, or None on a clean end of stream between frames; a stream that
    ends inside a frame, or a length above `max_frame`, raises FrameError/FrameTooLarge without
    reading the oversized body.
    """

    __slots__ = ("max_frame",)

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame

    def _check(self, header: bytes) -> int:
        (n,) = HEADER.unpack(header)
        if n > self.max_frame:
            raise FrameTooLarge(f"frame of {n} bytes exceeds the limit of {self.max_frame}")
        return n

    def read_sync(self, sock: Any) -> bytes | None:
        header = _recv_exactly(sock, HEADER.size, eof_ok=True)
        if header is None:
            return None
        n = self._check(header)
        return _recv_exactly(sock, n, eof_ok=False) if n else b""

    async def read_async(self, reader: Any) -> bytes | None:
        # asyncio.IncompleteReadError subclasses EOFError: no asyncio import needed here
        try:
            header = await reader.readexactly(HEADER.size)
        except EOFError as e:
            if not getattr(e, "partial", b""):
                return None
            raise FrameError("connection closed inside a frame header") from None
        n = self._check(header)
        try:
            return await reader.readexactly(n) if n else b""
        except EOFError:
            raise FrameError("connection closed inside a frame") from None


def _recv_exactly(sock: Any, n: int, *, eof_ok: bool) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0 and eof_ok:
                return None
            raise FrameError("connection closed inside a frame")
        got += k
    return bytes(buf)
