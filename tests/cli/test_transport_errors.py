"""gpudctl's transport errors. A malformed frame from gpud is a FrameError. DaemonError crosses a
process boundary intact: a process pool (bench/reliability.py runs its simulated hosts in one)
pickles a worker's exception back to the parent; one that does not unpickle kills the pool's result
thread and every worker's result is lost."""

from __future__ import annotations

import pickle
import re

import msgpack
import pytest

from gpud.cli import transport
from gpud.cli.transport import DaemonError
from gpud.wire import frames


def test_daemon_error_survives_pickling():
    e = pickle.loads(pickle.dumps(DaemonError("busy", "gpud is full")))
    assert isinstance(e, DaemonError) and (e.code, e.message, str(e)) == ("busy", "gpud is full", "gpud is full [busy]")


@pytest.mark.parametrize(("payload", "why"), [
    (b"\xc1", "malformed message from gpud"),  # 0xc1: never used in MessagePack
    (msgpack.packb([1, True]), "not a map with an integer `id`"),
    (msgpack.packb({"id": "1", "ok": True}), "not a map with an integer `id`"),
    (msgpack.packb({"id": 1, "ok": "yes"}), "no boolean `ok`"),
    (msgpack.packb({"id": 1, "ok": False, "error": {"code": 3}}), "`error` is not a map of a code and a message"),
    (msgpack.packb({"id": 1, "event": [1]}), "`event` is not a map"),
    (msgpack.packb({"id": 1, "ok": True}) + b"\x00", "malformed message from gpud"),  # a second object after the map
])
def test_a_malformed_frame_from_gpud_is_a_frame_error(payload, why):
    """What gpudctl relies on in a frame is checked as msgspec's decode into Response/EventFrame
    checked it: anything else is a FrameError ("protocol error", exit 1), never a traceback."""
    with pytest.raises(frames.FrameError, match=re.escape(why)):
        transport._message(payload)
    assert transport._message(msgpack.packb({"id": 1, "ok": True, "result": {}}))["ok"] is True
