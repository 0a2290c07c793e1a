"""The gpud socket protocol: frames, requests, responses, events, the arguments of each op and errors.

One concern, the protocol's envelope: this module and gpud/wire/replies.py (the typed result of
each op) are together the one definition of every message on the socket; each name has one home.

Shared by the daemon (asyncio) and `gpudctl` (a blocking socket), so this module imports only the
standard library and msgspec: the client's start-up time is a product feature, and every import
here is paid by every `gpudctl` run.

Wire format (protocol 1): each frame is a 4-byte big-endian unsigned payload length followed by
one MessagePack map. Client -> daemon: `Request {id, op, args}`. Daemon -> client: one
`Response {id, ok, result, error}` per request; for `events` with `follow=true` the response (the
recent history) is followed by `EventFrame {id, event}` frames until the client closes.
Replies are msgspec Structs encoded as maps; unknown fields are ignored on decode and every
field added later gets a default, so old clients keep working against newer daemons.
"""

# No `from __future__ import annotations` here: msgspec would then compile every field's annotation
# string when a client first decodes a reply, which costs more than evaluating them once as the
# classes are made. Classes are defined before they are used in annotations.
import math
import struct
from typing import Any

import msgspec

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

READ_OPS = frozenset({"status", "check", "plan", "events", "version", "mig-profiles", "mig-compute-profiles",
                      "passthrough", "stats", "labels", "vgpu-types", "leases"})
WRITE_OPS = frozenset({"apply", "reload", "select"})
LEASE_OPS = frozenset({"lease", "release"})  # root, or members of the layout's policy.lease-group
OPS = READ_OPS | WRITE_OPS | LEASE_OPS


class FrameError(ValueError):
    """A frame that cannot be read: truncated, too large, or not a valid message."""

    code = E_BAD_FRAME

    def __init__(self, message: str, *, request_id: int = 0) -> None:
        super().__init__(message)
        self.request_id = request_id  # best effort, so the error response can name the request


class FrameTooLarge(FrameError):
    code = E_TOO_LARGE


# ---------------------------------------------------------------------------------------------
# Envelope


class Request(msgspec.Struct, kw_only=True):
    id: int
    op: str
    args: dict[str, Any] = {}


class ErrorInfo(msgspec.Struct, kw_only=True):
    code: str
    message: str


class Response(msgspec.Struct, kw_only=True):
    id: int
    ok: bool
    result: Any = None
    error: ErrorInfo | None = None


class Event(msgspec.Struct, kw_only=True):
    time: float  # Unix seconds
    kind: str  # "step", "wait", "converged", "failed", "layout", "overflow", ...
    gpu: str | None = None  # PCI address, None for host-wide events
    message: str = ""
    data: dict[str, Any] = {}


class EventFrame(msgspec.Struct, kw_only=True):
    id: int  # the id of the `events` request this stream answers
    event: Event


# ---------------------------------------------------------------------------------------------
# Arguments of each op (the server validates and fills defaults before calling the handler)


class NoArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class StatusArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    fresh: bool = False  # answer from a read of the host begun after this request arrived


class StatsArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    reset: bool = False  # start a new measurement window after answering


class CheckArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str  # the layout as the client read it
    path: str  # where it was read, so errors name the file
    all_layouts: bool = False  # check every entry of `layouts`, as a node label may select any


class SelectArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str | None = None  # a layout of the file (mig-parted's `apply -c NAME`); None: the file's own


class PlanArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str | None = None  # None: plan against the daemon's current layout
    path: str | None = None


class ApplyArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    wait: bool = False
    timeout: float | None = None  # seconds; only with wait

    def __post_init__(self) -> None:
        # NaN compares false with everything: a wait bounded by it ended at once as `timeout`.
        if self.timeout is not None and not (math.isfinite(self.timeout) and self.timeout >= 0):
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {self.timeout!r}")


class EventsArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    follow: bool = False


class MigProfilesArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    gpu: str | None = None  # selector: index, PCI address or GPU UUID


class LeaseArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    profile: str  # a MIG device name as the layout takes it ("1g.10gb", "1c.3g.40gb"), or "gpu"
    gpu: str | None = None  # selector: index, PCI address or GPU UUID (required for "gpu")
    owner: str = ""  # free text: a job id, a claim
    pid: int | None = None  # holder: the lease is released when it exits and the instance is idle
    start: int | None = None  # exactly this placement (memory slice), as a scheduler chose it


class ReleaseArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    id: str
    wait: bool = True  # busy: wait for the processes (False: refuse at once)


ARGS: dict[str, type[msgspec.Struct]] = {
    "status": StatusArgs,
    "check": CheckArgs,
    "plan": PlanArgs,
    "apply": ApplyArgs,
    "reload": NoArgs,
    "select": SelectArgs,
    "events": EventsArgs,
    "version": NoArgs,
    "mig-profiles": MigProfilesArgs,
    "mig-compute-profiles": MigProfilesArgs,
    "passthrough": NoArgs,
    "stats": StatsArgs,
    "labels": NoArgs,
    "vgpu-types": MigProfilesArgs,
    "lease": LeaseArgs,
    "release": ReleaseArgs,
    "leases": NoArgs,
}


# ---------------------------------------------------------------------------------------------
# Framing

_encoder = msgspec.msgpack.Encoder()
_any_decoder = msgspec.msgpack.Decoder()
_request_decoder: msgspec.msgpack.Decoder | None = None  # the daemon's, made at its first request


def encode_frame(obj: Any, *, max_frame: int = MAX_FRAME) -> bytes:
    """Length-prefixed MessagePack. Refuses to produce a frame the peer would reject."""
    payload = _encoder.encode(obj)
    if len(payload) > max_frame:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds the limit of {max_frame}")
    return HEADER.pack(len(payload)) + payload


def _guess_id(payload: bytes) -> int:
    try:
        raw = _any_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return 0
    rid = raw.get("id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0


def decode_request(payload: bytes) -> Request:
    global _request_decoder
    if _request_decoder is None:  # not at import: the client never decodes a request
        _request_decoder = msgspec.msgpack.Decoder(Request)
    try:
        return _request_decoder.decode(payload)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise FrameError(f"malformed request: {e}", request_id=_guess_id(payload)) from None
    except RecursionError:  # msgspec's bound on nesting (a few hundred levels deep arguments)
        raise FrameError("malformed request: nested too deeply") from None


def decode_message(payload: bytes) -> Response | EventFrame:
    """A frame from the daemon: a Response, or (with "event" and no "ok") an EventFrame."""
    try:
        raw = _any_decoder.decode(payload)
        if isinstance(raw, dict) and "event" in raw and "ok" not in raw:
            return msgspec.convert(raw, EventFrame)
        return msgspec.convert(raw, Response)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise FrameError(f"malformed message from gpud: {e}") from None
    except RecursionError:
        raise FrameError("malformed message from gpud: nested too deeply") from None



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
