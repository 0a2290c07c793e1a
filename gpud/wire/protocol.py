"""The gpud socket protocol: requests, responses, events and the arguments of each op, as msgspec
structs; with gpud/wire/frames.py (framing, limits, error codes, the ops: re-exported here).

One concern, the protocol's envelope: this module, gpud/wire/frames.py and gpud/wire/replies.py
(the typed result of each op) are together the one definition of every message on the socket;
each name has one home.

The daemon encodes and decodes with these structs. `gpudctl` does not import this module on its
paths (msgspec's import is most of a client's start-up): it reads the same MessagePack with
`msgpack` and reads replies through gpud.cli.view, typed against these structs for mypy.

Wire format (protocol 1): each frame is a 4-byte big-endian unsigned payload length followed by
one MessagePack map. Client -> daemon: `Request {id, op, args}`. Daemon -> client: one
`Response {id, ok, result, error}` per request; for `events` with `follow=true` the response (the
recent history) is followed by `EventFrame {id, event}` frames until the client closes.
Replies are msgspec Structs encoded as maps with every field (no omitted defaults, no tags, no
arrays for structs); unknown fields are ignored on decode and every field added later gets a
default, so old clients keep working against newer daemons.
"""

# No `from __future__ import annotations` here: msgspec would then compile every field's annotation
# string when a client first decodes a reply, which costs more than evaluating them once as the
# classes are made. Classes are defined before they are used in annotations.
import math
from typing import Any

import msgspec

# The framing and vocabulary the client shares without msgspec: re-exported, so `protocol` stays the
# one name the daemon imports for the whole protocol.
from gpud.wire.frames import (  # noqa: F401
    E_BAD_ARGS,
    E_BAD_FRAME,
    E_BUSY,
    E_CONFLICT,
    E_ELSEWHERE,
    E_FAILED,
    E_FORBIDDEN,
    E_IN_USE,
    E_INTERNAL,
    E_INVALID_LAYOUT,
    E_NO_ROOM,
    E_NOT_FOUND,
    E_TIMEOUT,
    E_TOO_LARGE,
    E_UNKNOWN_OP,
    HEADER,
    LEASE_OPS,
    MAX_FRAME,
    MAX_LAYOUT_TEXT,
    MAX_LISTED,
    OPS,
    PROTOCOL,
    READ_OPS,
    WRITE_OPS,
    FrameError,
    FrameReader,
    FrameTooLarge,
    frame,
    status_socket,
)

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
    return frame(_encoder.encode(obj), max_frame=max_frame)


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
