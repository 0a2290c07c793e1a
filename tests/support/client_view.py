"""gpudctl's output both ways, for the tests of gpud.cli.view: as it reads replies (msgpack's maps
through the view) and as it read them before, msgspec's typed decode of the same maps into the wire
structs (code the view shares nothing with): `both_ways` runs one command line in this process each
way and returns (exit code, stdout, stderr) of each."""

from __future__ import annotations

import copy
import io
import time
import types
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import msgspec
import pytest

from gpud.cli import commands, gpudctl, render, transport, view
from gpud.cli.escape import MULTILINE, term
from gpud.wire import protocol as wire
from gpud.wire import replies as wire_replies


def _escaped(value: Any, key: str | None = None) -> Any:
    """Every string of a decoded reply through escape.term, as gpudctl escaped them before the view."""
    if isinstance(value, str):
        return term(value, lines=key in MULTILINE)
    if isinstance(value, dict):
        return {term(k): _escaped(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return value


def _typed(root: str, value: Any, *, escape: bool = False) -> Any:
    """How gpudctl read a reply before gpud.cli.view: msgspec's typed decode into the op's struct."""
    if escape:
        value = _escaped(value)
    if root == view.EVENT:
        return msgspec.convert(value, wire.Event)
    return wire_replies.decode_result(root, value)


def _gpudctl(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = gpudctl.main(argv)
    return code, out.getvalue(), err.getvalue()


def both_ways(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """`argv` run through the view, then through the typed decode of the very frames the first run
    read (each connection's in its order: a reply stamped with the time it was sent, an observation's
    age, is the same both ways), at one frozen clock (a lease's age)."""
    frames: dict[int, list[dict[str, Any]]] = {}
    clients: list[transport.Client] = []
    real_init, real_read = transport.Client.__init__, transport.Client._read

    def numbered(self: transport.Client, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        self._number = len(clients)  # type: ignore[attr-defined]
        clients.append(self)

    def recording(self: transport.Client) -> dict[str, Any]:
        msg = real_read(self)
        frames.setdefault(self._number, []).append(copy.deepcopy(msg))  # type: ignore[attr-defined]
        return msg

    def replaying(self: transport.Client) -> dict[str, Any]:
        real_read(self)  # the daemon's answer to this run's request, read to keep the exchange in step
        return frames[self._number].pop(0)  # type: ignore[attr-defined]

    now = time.time()
    with monkeypatch.context() as m:
        m.setattr(render, "time", types.SimpleNamespace(time=lambda: now, strftime=time.strftime, localtime=time.localtime))
        m.setattr(transport.Client, "__init__", numbered)
        m.setattr(transport.Client, "_read", recording)
        viewed = _gpudctl(argv)
        clients.clear()
        m.setattr(transport.Client, "_read", replaying)
        m.setattr(transport, "reply", _typed)
        m.setattr(commands, "reply", _typed)
        typed = _gpudctl(argv)
    assert all(not left for left in frames.values()), "the typed run read fewer frames than the first"
    return viewed, typed
