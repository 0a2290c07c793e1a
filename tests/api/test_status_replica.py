"""The status replica (gpud/api/status_replica.py, fed by gpud/api/status_feed.py): a process of its
own that answers `status` with the bytes the daemon would send, sees every change the daemon has
told anyone of, refuses what only the daemon answers, and is started again when it dies.

The engine is a real one on a simulated host (tests/support/simrig.py), the replica a real child
process on a real socket. What it answers is compared with msgspec's own encoding of the daemon's
reply and with the simulator's state file, never with the replica's own code."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import tempfile
import time

import msgpack
import msgspec
import pytest

from gpud.api.handlers import RequestHandler
from gpud.api.peers import Peer
from gpud.api.server import serve
from gpud.api.status_replica import Replica
from gpud.cli.transport import Client
from gpud.engine.engine import Engine
from gpud.wire import protocol as wire
from gpud.wire import replies as wire_replies
from tests.scenarios.definitions import layout, mig
from tests.support.api import exchange
from tests.support.simrig import SimRig

GPUD_GID = 4242


@pytest.fixture
def rig(tmp_path):
    r = SimRig(tmp_path / "r", ("h100-80gb:3",))
    yield r
    r.close()


@pytest.fixture
def sockdir():
    path = tempfile.mkdtemp(prefix="gpud-t", dir="/tmp")  # short: sun_path is 108 bytes
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def answered(path: str, limit: float = 30.0) -> bytes:
    """The replica's answer to a status, once one is ok (it is being started)."""
    deadline = time.monotonic() + limit
    while True:
        try:
            frame = await asyncio.to_thread(exchange, path, {"id": 1, "op": "status", "args": {}}, 2.0)
            if msgpack.unpackb(frame[4:])["ok"]:
                return frame
        except OSError:
            pass
        assert time.monotonic() < deadline, "the status replica did not answer"
        await asyncio.sleep(0.05)


async def started_again(feed, first) -> None:
    """The feed's run() started a second replica after `first`, and it answers."""
    await answered(feed.path)
    assert feed.proc is not first and feed.starts == 2


async def ended(feed, runner: asyncio.Task) -> None:
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    await feed.close()


async def test_the_replica_answers_the_bytes_the_daemon_would_send(rig, sockdir):
    assert await rig.apply(layout(mig([0, 1], {"1g.10gb": 3, "3g.40gb": 1}), mig([2], None)))
    handler = RequestHandler(Engine(rig.rec))
    feed = handler.status_feed(f"{sockdir}/gpud-status.sock", None)
    feed.start()
    try:
        frame = await answered(feed.path)
        got = msgspec.msgpack.decode(frame[4:], type=wire.Response)
        reply = wire_replies.decode_result("status", got.result)
        assert isinstance(reply, wire_replies.StatusReply)
        view = handler.engine.view
        # the daemon's own answer with the age the replica stamped: msgspec writes the same frame
        want = wire.encode_frame(wire.Response(id=1, ok=True, result=handler.status_snapshot.encoded(
            view, observed_at=round(handler.engine.observed_at, 3), age=reply.observation_age,
            kubernetes=handler.kubernetes(view.observation.gpus))))
        assert frame == want
        assert 0 < reply.observation_age < handler.engine.observation_age() + 1
        assert sum(len(g.mig.instances) for g in reply.gpus) == 8
        for _ in range(50):  # its count comes back to the stats op (the first report may split)
            if handler.requests["status"] == 1:
                break
            await asyncio.sleep(0.02)
        assert handler.requests["status"] == 1
    finally:
        await feed.close()
    assert not os.path.exists(feed.path) and feed.proc is not None and feed.proc.returncode == 0


async def test_a_change_the_daemon_told_of_is_in_the_replicas_next_answer(rig, sockdir):
    assert await rig.apply(layout(mig([0], {"7g.80gb": 1})))
    handler = RequestHandler(Engine(rig.rec))
    feed = handler.status_feed(f"{sockdir}/gpud-status.sock", None)
    feed.start()
    try:
        await answered(feed.path)
        assert await rig.apply(layout(mig([0], {"1g.10gb": 7}), mig([1], {"2g.20gb": 3})))
        handler.before_send()  # what the API server does before the apply's reply or any event
        frame = await asyncio.to_thread(exchange, feed.path, {"id": 2, "op": "status", "args": {}})
        reply = wire_replies.decode_result("status", msgspec.msgpack.decode(frame[4:], type=wire.Response).result)
        held = rig.mig_devices()  # the simulator's own state file
        for g in reply.gpus:
            assert sorted(i.uuid for i in g.mig.instances if i.uuid) == sorted(held[g.index]), g.index
        assert len(held[0]) == 7 and len(held[1]) == 3
    finally:
        await feed.close()


async def test_gpudctl_asks_the_daemon_while_the_replica_is_dead_and_it_is_started_again(rig, sockdir):
    assert await rig.apply(layout(mig([0], {"7g.80gb": 1})))
    handler = RequestHandler(Engine(rig.rec))
    server = await serve(handler, f"{sockdir}/gpud.sock", group=None)
    feed = handler.status_feed(wire.status_socket(f"{sockdir}/gpud.sock"), None)
    feed.start()
    runner = asyncio.create_task(feed.run())
    try:
        await answered(feed.path)
        first = feed.proc
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)
        await asyncio.to_thread(first.wait)
        before = handler.requests["status"]
        # nothing listens on its socket now: the client asks the daemon at once
        reply = await asyncio.to_thread(lambda: Client(server.path or "", timeout=10).request("status"))
        assert reply.phase == "converged" and handler.requests["status"] == before + 1
        await started_again(feed, first)
    finally:
        await ended(feed, runner)
        await server.close()


async def test_what_the_replica_answers_and_refuses(rig):
    """Its rules, on a replica in this process: the daemon's snapshot frames on a socket pair,
    the peer and the clock chosen."""
    assert await rig.apply(layout(mig([0], {"7g.80gb": 1})))
    handler = RequestHandler(Engine(rig.rec))
    feed = handler.status_feed("/nonexistent/gpud-status.sock", GPUD_GID)
    ours, theirs = socket.socketpair()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    now = [time.monotonic()]
    replica = Replica(listener, theirs, stale_after=5.0, peer_lookup=lambda s: Peer(0, 0, 0), clock=lambda: now[0])
    root, member = Peer(1, 0, 0, frozenset({0})), Peer(2, 1000, 1000, frozenset({1000, GPUD_GID}))
    stranger = Peer(3, 1001, 1001, frozenset({1001}))

    def ask(peer: Peer, request: object) -> tuple[dict, bool]:
        pieces, close = replica.respond(peer, msgpack.packb(request))
        frame = b"".join(pieces)
        assert int.from_bytes(frame[:4], "big") == len(frame) - 4
        return msgpack.unpackb(frame[4:]), close

    status = {"id": 5, "op": "status", "args": {}}
    try:
        msg, close = ask(root, status)  # nothing fed yet
        assert msg["error"]["code"] == wire.E_ELSEWHERE and not close
        ours.setblocking(False)
        feed.attach(ours)
        assert replica.read_feed()
        for peer in (root, member):
            msg, close = ask(peer, status)
            assert msg["ok"] and msg["id"] == 5 and not close
        assert ask(member, {"id": 6, "op": "status", "args": {"fresh": False}})[0]["ok"]
        msg, close = ask(stranger, status)
        assert msg["error"]["code"] == wire.E_FORBIDDEN and close
        for request in ({"id": 7, "op": "status", "args": {"fresh": True}}, {"id": 8, "op": "apply", "args": {}},
                        {"id": 9, "op": "status", "args": {"bogus": 1}}):
            msg, close = ask(root, request)
            assert msg["id"] == request["id"] and msg["error"]["code"] == wire.E_ELSEWHERE and not close
        pieces, close = replica.respond(root, b"\xc1")
        assert msgpack.unpackb(b"".join(pieces)[4:])["error"]["code"] == wire.E_BAD_FRAME and close
        # the daemon silent for longer than stale_after: its loop may be stuck; ask it instead
        now[0] += 5.5
        assert ask(root, status)[0]["error"]["code"] == wire.E_ELSEWHERE
        feed.push(beat=True)
        assert replica.read_feed() and ask(root, status)[0]["ok"]
        # the answer's age runs on the replica's clock from the observation's start
        started = handler.engine.observation_started
        assert ask(root, status)[0]["result"]["observation_age"] == round(now[0] - started, 4)
        await feed.close()
        assert not replica.read_feed()  # the daemon closed its end: the replica ends
    finally:
        await feed.close()
        for s in (ours, theirs, listener):
            s.close()


def _status_on(sock: socket.socket, rid: int) -> wire_replies.StatusReply:
    """A status on an open connection to the replica (each answer is whole before the next is asked)."""
    sock.sendall(wire.frame(msgpack.packb({"id": rid, "op": "status", "args": {}})))
    reader = wire.FrameReader()
    payload = reader.read_sync(sock)
    assert payload is not None
    msg = msgspec.msgpack.decode(payload, type=wire.Response)
    assert msg.ok and msg.id == rid, msg
    reply = wire_replies.decode_result("status", msg.result)
    assert isinstance(reply, wire_replies.StatusReply)
    return reply


def _instances(reply: wire_replies.StatusReply) -> int:
    return sum(len(g.mig.instances) for g in reply.gpus)


async def test_what_the_daemon_replied_after_a_change_the_replica_answers_with_it(rig, sockdir):
    """The server pushes before every reply: a client that got any reply from the daemon after a
    change, then asks the replica, sees the change, however late the replica reads (it is
    stopped until the daemon's reply has gone out)."""
    assert await rig.apply(layout(mig([0], {"7g.80gb": 1})))
    handler = RequestHandler(Engine(rig.rec))
    server = await serve(handler, f"{sockdir}/gpud.sock", group=None)
    feed = handler.status_feed(wire.status_socket(f"{sockdir}/gpud.sock"), None)
    feed.start()  # the engine's change listener is not subscribed: only the server's pushes feed it
    proc = feed.proc
    assert proc is not None
    try:
        await answered(feed.path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(feed.path)
            assert _instances(await asyncio.to_thread(_status_on, s, 1)) == 1
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                assert await rig.apply(layout(mig([0], {"1g.10gb": 7}), mig([1], {"2g.20gb": 3})))
                version = await asyncio.to_thread(lambda: Client(server.path or "", timeout=10).request("version"))
                assert version.version
                s.sendall(wire.frame(msgpack.packb({"id": 2, "op": "status", "args": {}})))
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            reader = wire.FrameReader()
            payload = await asyncio.to_thread(reader.read_sync, s)
            assert payload is not None
            reply = wire_replies.decode_result("status", msgspec.msgpack.decode(payload, type=wire.Response).result)
            assert isinstance(reply, wire_replies.StatusReply)
            assert _instances(reply) == sum(len(v) for v in rig.mig_devices().values()) == 10
    finally:
        await feed.close()
        await server.close()


async def test_a_frame_that_cannot_be_made_stops_the_replica_and_never_a_reply(rig, sockdir, monkeypatch):
    assert await rig.apply(layout(mig([0], {"7g.80gb": 1})))
    handler = RequestHandler(Engine(rig.rec))
    server = await serve(handler, f"{sockdir}/gpud.sock", group=None)
    feed = handler.status_feed(wire.status_socket(f"{sockdir}/gpud.sock"), None)
    feed.start()
    proc = feed.proc
    assert proc is not None
    try:
        await answered(feed.path)

        def broken(gpus):
            raise RuntimeError("the Kubernetes part cannot be built")

        monkeypatch.setattr(feed, "kubernetes", broken)
        monkeypatch.setattr(handler, "kubernetes", broken)
        with Client(server.path or "", timeout=10) as c:  # the daemon's own answers go on
            assert (await asyncio.to_thread(c.request, "version")).version
        assert await asyncio.to_thread(proc.wait, 10) == -signal.SIGKILL
        monkeypatch.undo()
        reply = await asyncio.to_thread(lambda: Client(server.path or "", timeout=10).request("status"))
        assert reply.phase == "converged"  # from the daemon: nothing listens on the replica's socket
    finally:
        await feed.close()
        await server.close()


async def test_a_stopped_replica_is_killed_and_started_again(rig, sockdir):
    assert await rig.apply(layout(mig([0], {"7g.80gb": 1})))
    handler = RequestHandler(Engine(rig.rec))
    feed = handler.status_feed(f"{sockdir}/gpud-status.sock", None)
    runner = asyncio.create_task(feed.run())
    try:
        await answered(feed.path)
        first = feed.proc
        assert first is not None
        for _ in range(100):  # its first word: the kill limit is a second from then on
            if feed._heard_any:
                break
            await asyncio.sleep(0.05)
        os.kill(first.pid, signal.SIGSTOP)
        assert await asyncio.to_thread(first.wait, 30) == -signal.SIGKILL
        await started_again(feed, first)
    finally:
        await ended(feed, runner)


def test_the_replicas_limits(sockdir):
    """Connections per uid, an oversized frame, and a client that trickles a request or never takes
    its reply: each as the daemon's socket treats it (gpud.api.server), on a replica in this
    process with the peer and the clock chosen."""
    from gpud.api import status_replica

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{sockdir}/r.sock")
    listener.listen(64)
    ours, theirs = socket.socketpair()
    now = [1000.0]
    peers = iter([Peer(10 + i, 1000, 1000, frozenset({1000, GPUD_GID})) for i in range(40)])
    replica = Replica(listener, theirs, stale_after=5.0, peer_lookup=lambda s: next(peers), clock=lambda: now[0])
    clients: list[socket.socket] = []

    def connect() -> socket.socket:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(5)
        c.connect(f"{sockdir}/r.sock")
        clients.append(c)
        replica._accept()
        return c

    try:
        for _ in range(status_replica.MAX_PER_UID):
            connect()
        assert len(replica.conns) == status_replica.MAX_PER_UID
        over = connect()
        refusal = msgpack.unpackb(wire.FrameReader().read_sync(over))
        assert refusal["error"]["code"] == wire.E_BUSY and over.recv(1) == b""
        assert len(replica.conns) == status_replica.MAX_PER_UID
        first, second, third = clients[:3]
        first.sendall(wire.HEADER.pack(wire.MAX_FRAME + 1))
        second.sendall(wire.HEADER.pack(100) + b"\x81")  # a request's first byte, the rest trickling
        for conn in list(replica.conns.values()):
            replica._readable(conn) if conn.sock.fileno() != -1 else None
        assert msgpack.unpackb(wire.FrameReader().read_sync(first))["error"]["code"] == wire.E_TOO_LARGE
        assert first.recv(1) == b""
        now[0] += status_replica.IDLE_TIMEOUT / 2
        second.sendall(b"\xa2")  # more of it: still not a whole request
        for conn in list(replica.conns.values()):
            if conn.sock.fileno() != -1:
                replica._readable(conn)
        now[0] += status_replica.IDLE_TIMEOUT / 2 + 1
        replica._sweep(now[0])
        assert second.recv(1) == b"" and third.recv(1) == b""  # both idle past the limit: closed
        assert len(replica.conns) == 0
    finally:
        for s in (*clients, ours, theirs, listener):
            s.close()
