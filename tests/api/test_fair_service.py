"""Fair service over the real socket, on a simulated host: root's control ops never queue behind
a member's heavy reads, members share the evaluation turns, applies that arrive together share one
read of the file and one pass, and a process waiting on a request keeps its event stream.

Peers are decided at the server's seam (the client's abstract address names its pid and uid).
Outcomes, not timings: a member's check is held inside the parser (a hook on the keeper) while
root's reload must be answered; GUARD only bounds a hung test."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gpud.api.handlers import RequestHandler
from gpud.api.peers import Peer
from gpud.api.server import ApiServer, serve
from gpud.engine import layout_keeper
from gpud.engine.engine import Engine
from gpud.wire import protocol as wire
from tests.support.api import Conn
from tests.support.present import present
from tests.support.simrig import SimRig

GUARD = 20.0
GPUD = 4242  # the gpud group's id, as the server is told
MEMBER, OTHER = 1000, 2000
FILE = "version: v1\nlayouts:\n  a:\n    - {devices: all, mig-enabled: false}\n"
TWO = ("version: v1\nselected: a\nlayouts:\n  a:\n    - {devices: all, mig-enabled: false}\n"
       "  b:\n    - {devices: all, mig-enabled: false}\n")


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="gpud-f", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


class _Rig(SimRig):
    """The rig with an API server over its engine, and connections to it as any uid."""

    open_as: Callable[..., Awaitable[Conn]]
    handler: RequestHandler
    server: ApiServer


@pytest.fixture
async def daemon(tmp_path, sockdir):
    rig = _Rig(tmp_path, ("h100-80gb:2",))
    rig.config.write_text(FILE)
    assert rig.rec.load_config()
    rig.rec.refresh()
    handler = RequestHandler(Engine(rig.rec))

    def lookup(sock: socket.socket) -> Peer:
        name = sock.getpeername()
        name = name.decode() if isinstance(name, bytes) else name
        _, pid, uid = name.rsplit("-", 2)
        return Peer(pid=int(pid), uid=int(uid), gid=GPUD, groups=frozenset({GPUD}))

    server = await serve(handler, f"{sockdir}/s", group=None, peer_lookup=lookup, max_connections=128)
    server.gpud_gid = GPUD
    passes = asyncio.create_task(rig.rec.run(debounce=0.0))
    counter = iter(range(100_000))
    token = secrets.token_hex(8)

    async def open_as(uid: int, pid: int | None = None) -> Conn:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The abstract namespace belongs to the network namespace, which another run of this
        # suite (a container sharing the host's network) may share: a random part keeps names apart.
        s.bind(f"\0gpud-fair-{token}-{next(counter)}-{pid if pid is not None else next(counter) + 10}-{uid}")
        s.setblocking(False)
        await asyncio.get_running_loop().sock_connect(s, present(server.path))
        return Conn(*await asyncio.open_unix_connection(sock=s))

    rig.open_as, rig.handler, rig.server = open_as, handler, server
    try:
        yield rig
    finally:
        passes.cancel()
        await asyncio.gather(passes, return_exceptions=True)
        await Conn.close_all()
        await server.close()
        rig.close()


def _hold_parses(keeper, release: threading.Event, order: list[str], held: str | None = None):
    """Candidate texts (not the daemon's file) wait inside the parser until `release` (only the
    one whose path is `held`, when given); the order texts reach the parser is kept."""
    parse = keeper._parse
    entered = threading.Event()

    def held_parse(text, path, select=None):
        if path != keeper.path:
            order.append(path)
            if held is None or path == held:
                entered.set()
                release.wait(GUARD * 3)
        return parse(text, path, select)
    keeper._parse = held_parse
    return entered


async def _until(cond, what: str):
    async with asyncio.timeout(GUARD):
        while not cond():
            await asyncio.sleep(0.01)


async def test_roots_reload_is_answered_while_members_checks_fill_the_queue(daemon):
    rig = daemon
    release, order = threading.Event(), list[str]()
    entered = _hold_parses(rig.rec.layout_file, release, order)
    members = [await rig.open_as(MEMBER + i % 4) for i in range(16)]
    try:
        sent = [await c.send("check", {"text": TWO, "path": f"m{i}.yaml", "all_layouts": True})
                for i, c in enumerate(members)]
        await asyncio.to_thread(entered.wait, GUARD)
        assert entered.is_set()
        root = await rig.open_as(0)
        reload = await root.call("reload")  # Conn.recv has its own GUARD: fails fast if queued
        assert reload.ok and reload.result["valid"]
        assert not release.is_set() and rig.handler.requests["check"] == 16  # the checks still wait
        root.close()
    finally:
        release.set()
    for c, rid in zip(members, sent, strict=True):
        resp = await c.recv()
        assert resp.id == rid and resp.ok and resp.result["valid"]
        c.close()


async def test_a_member_flooding_checks_does_not_hold_back_another_members(daemon):
    rig = daemon
    release, order = threading.Event(), list[str]()
    _hold_parses(rig.rec.layout_file, release, order, held="flood-0.yaml")
    flood = [await rig.open_as(MEMBER) for _ in range(8)]
    sent = []
    try:
        for i, c in enumerate(flood):
            sent.append(await c.send("check", {"text": FILE, "path": f"flood-{i}.yaml"}))
        await _until(lambda: order, "the first check parsing")
        other = await rig.open_as(OTHER)
        other_rid = await other.send("check", {"text": FILE, "path": "other.yaml"})
        await _until(lambda: rig.handler.requests["check"] == 9, "all checks received")
    finally:
        release.set()
    resp = await other.recv()
    assert resp.id == other_rid and resp.ok
    for c, rid in zip(flood, sent, strict=True):
        assert (await c.recv()).id == rid
    assert order[0] == "flood-0.yaml" and order[1] == "other.yaml", order


async def test_a_check_whose_cost_is_unbounded_is_refused(daemon):
    rig = daemon
    many = "version: v1\nselected: l0\nlayouts:\n" + "".join(
        f"  l{i}:\n    - {{devices: all, mig-enabled: false}}\n" + "    # " + "x" * 2000 + "\n" for i in range(80))
    many = many * 1  # ~165 KB, 80 layouts: 13 MB of parsing asked for by one request
    c = await rig.open_as(MEMBER)
    resp = await c.call("check", {"text": many, "path": "many.yaml", "all_layouts": True})
    assert not resp.ok and resp.error.code == wire.E_BAD_ARGS and "at most 8 MiB" in resp.error.message
    c.close()


async def test_applies_that_arrive_together_share_one_read_and_one_pass(daemon, monkeypatch):
    rig = daemon
    reads: list[str] = []
    real = layout_keeper.read_layout

    def read_layout(p: str, *a: Any, **k: Any) -> Any:
        reads.append(p)
        return real(p, *a, **k)

    monkeypatch.setattr(layout_keeper, "read_layout", read_layout)
    rig.config.write_text("version: v1\nlayouts:\n  a:\n    - {devices: [0], mig-enabled: true, mig-devices: {7g.80gb: 1}}\n"
                          "    - {devices: [1], mig-enabled: false}\n")
    passes_before = rig.rec.passes
    clients = [await rig.open_as(0) for _ in range(40)]
    rids = [await c.send("apply", {"wait": True, "timeout": 60}) for c in clients]
    for c, rid in zip(clients, rids, strict=True):
        resp = await c.recv()
        assert resp.id == rid and resp.ok and resp.result["converged"], resp
        c.close()
    assert len(reads) <= 2, f"{len(reads)} reads of the layout file for 40 applies sent together"
    assert rig.rec.passes - passes_before <= 2
    assert rig.mig_devices()[0]  # the layout took effect on the simulated GPU


async def test_the_event_stream_of_a_waiting_apply_is_never_evicted(daemon):
    rig = daemon
    server = rig.server
    server.max_connections = 10
    server.root_reserve = 2
    release, order = threading.Event(), list[str]()
    _hold_parses(rig.rec.layout_file, release, order)
    pid = 777
    follower = await rig.open_as(0, pid)
    rid = await follower.send("events", {"follow": True})
    history = await follower.recv()
    assert history.id == rid and history.result["following"]
    waiter = await rig.open_as(0, pid)  # the same process: a check in progress (held in the parser)
    wrid = await waiter.send("check", {"text": FILE, "path": "w.yaml"})
    await _until(lambda: order, "the check parsing")
    try:
        crowd = [await rig.open_as(0) for _ in range(12)]  # root fills the server: the oldest idle go
        for c in crowd[-3:]:
            assert (await c.call("status")).ok
        assert server.evicted >= 4
        rig.rec.bus.publish("layout", "still following")
        frame = await follower.recv()
        assert isinstance(frame, wire.EventFrame) and frame.event.message == "still following"
    finally:
        release.set()
    assert (await waiter.recv()).id == wrid
