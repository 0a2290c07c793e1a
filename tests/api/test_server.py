"""The API server against a fake handler on a real Unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap

import msgspec
import pytest

from gpud.api.peers import Peer, authorize, peer_credentials, read_proc_groups
from gpud.api.server import ApiError, serve
from gpud.api.socket_file import ServerError
from gpud.engine.events import EventBus, EventQueue
from gpud.wire import protocol as wire
from gpud.wire import replies as wire_replies
from tests.api.fakes import FakeHandler, status_reply
from tests.support.api import GUARD, Conn
from tests.support.present import present

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to change uid / chown")


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="gpud-t", dir="/tmp")  # short: sun_path is 108 bytes
    os.chmod(d, 0o755)  # like /run/gpud: the socket's own mode is what keeps others out
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def running(sockdir):
    handler = FakeHandler()
    server = await serve(handler, f"{sockdir}/gpud.sock", group=None)
    yield handler, server
    await Conn.close_all()
    await server.close()


# ---------------------------------------------------------------------------------------------
# Requests and replies


async def test_status_round_trip(running):
    handler, server = running
    c = await Conn.open(server.path)
    resp = await c.call("status")
    assert resp.ok and resp.error is None
    assert wire_replies.decode_result("status", resp.result) == status_reply()
    op, args, peer = handler.calls[0]
    assert (op, args) == ("status", {"fresh": False})  # defaults filled by the server
    assert (peer.pid, peer.uid) == (os.getpid(), os.geteuid())
    c.close()


async def test_requests_are_answered_in_order_on_one_connection(running):
    handler, server = running
    c = await Conn.open(server.path)
    ids = [await c.send("version"), await c.send("check", {"text": "x", "path": "/l.yaml"})]
    first, second = await c.recv(), await c.recv()
    assert [first.id, second.id] == ids
    assert first.result["protocol"] == wire.PROTOCOL  # the struct's default, sent as a field
    assert second.result["valid"] is True
    # args reach the handler validated, with defaults filled in
    handler.replies["apply"] = lambda args: wire_replies.ApplyReply(phase="applying", message=repr(args))
    assert (await c.call("apply")).result["message"] == repr({"wait": False, "timeout": None})
    c.close()


async def test_handler_errors(running):
    handler, server = running
    handler.errors["reload"] = ApiError("invalid-layout", "layout.yaml:3 layouts: expected a map")
    handler.errors["plan"] = RuntimeError("boom")
    handler.replies["status"] = {"phase": "converged"}  # not the StatusReply struct: a handler bug
    c = await Conn.open(server.path)
    resp = await c.call("reload")
    assert (resp.ok, present(resp.error).code, present(resp.error).message) == (False, "invalid-layout",
                                                             "layout.yaml:3 layouts: expected a map")
    resp = await c.call("plan")
    assert present(resp.error).code == wire.E_INTERNAL and "boom" in present(resp.error).message
    resp = await c.call("status")
    assert present(resp.error).code == wire.E_INTERNAL and "StatusReply" in present(resp.error).message
    assert (await c.call("version")).ok  # handler errors do not end the connection
    c.close()


async def test_bad_args_are_answered_and_the_connection_stays(running):
    _, server = running
    c = await Conn.open(server.path)
    resp = await c.call("apply", {"wait": "yes"})
    assert present(resp.error).code == wire.E_BAD_ARGS and "wait" in present(resp.error).message
    assert (await c.call("version")).ok
    c.close()


async def test_unknown_op_is_answered_then_closed(running):
    _, server = running
    c = await Conn.open(server.path)
    resp = await c.call("reboot-everything")
    assert present(resp.error).code == wire.E_UNKNOWN_OP
    assert await c.closed_by_server()


@pytest.mark.parametrize("payload, rid", [
    (b"\xc1\xc1", 0),
    (msgspec.msgpack.encode({"id": 5, "op": 3}), 5),
    (msgspec.msgpack.encode("status"), 0),
    # nested 1,000+ levels deep: once a RecursionError in the log and no answer
    (b"\x83\xa2id\x07\xa2op\xa6status\xa4args\x81\xa1x" + b"\x91" * 1500 + b"\xc0", 0),
    (b"\x91" * 100_000 + b"\xc0", 0),
])
async def test_malformed_frame_is_answered_then_closed(running, payload, rid):
    _, server = running
    c = await Conn.open(server.path)
    c.writer.write(wire.HEADER.pack(len(payload)) + payload)
    resp = await c.recv()
    assert (resp.ok, resp.id, resp.error.code) == (False, rid, wire.E_BAD_FRAME)
    assert await c.closed_by_server()


async def test_truncated_frame_is_answered_then_closed(running):
    _, server = running
    c = await Conn.open(server.path)
    c.writer.write(wire.HEADER.pack(100) + b"\x81")
    c.writer.write_eof()
    resp = await c.recv()
    assert resp.error.code == wire.E_BAD_FRAME
    assert await c.closed_by_server()


async def test_oversize_frame_is_refused_unread_then_closed(sockdir):
    server = await serve(FakeHandler(), f"{sockdir}/s", group=None, max_frame=1024)
    async with server:
        c = await Conn.open(present(server.path))
        c.writer.write(wire.HEADER.pack(1025))  # no body: the server must not wait for it
        resp = await c.recv()
        assert resp.error.code == wire.E_TOO_LARGE
        assert await c.closed_by_server()
        # right at the limit is fine
        c = await Conn.open(present(server.path))
        overhead = len(msgspec.msgpack.encode({"id": 1, "op": "version", "args": {"p": "x" * 1000}})) - 1000
        payload = msgspec.msgpack.encode({"id": 1, "op": "version", "args": {"p": "x" * (1024 - overhead)}})
        assert len(payload) == 1024
        c.writer.write(wire.HEADER.pack(len(payload)) + payload)
        resp = await c.recv()
        assert resp.error.code == wire.E_BAD_ARGS  # read and parsed: `p` is no argument of version
        c.close()


async def test_idle_connection_is_closed(sockdir):
    server = await serve(FakeHandler(), f"{sockdir}/s", group=None, idle_timeout=0.05)
    async with server:
        c = await Conn.open(present(server.path))
        assert (await c.call("version")).ok
        assert await c.closed_by_server()  # no request follows: the server hangs up
        assert server.connections == 0 or await _until(lambda: server.connections == 0)


def _gated_apply() -> tuple[FakeHandler, asyncio.Event, asyncio.Event]:
    """The fake handler with `apply` held until `gate` is set (`started` says it is held)."""
    handler = FakeHandler()
    gate, started = asyncio.Event(), asyncio.Event()

    async def slow_apply(op, args, peer, _orig=handler.handle):
        if op == "apply":
            started.set()
            await gate.wait()
        return await _orig(op, args, peer)

    handler.handle = slow_apply  # type: ignore[method-assign]  # the fake's own handler, slowed for apply
    return handler, gate, started


async def test_a_client_that_stops_mid_frame_is_closed(sockdir):
    server = await serve(FakeHandler(), f"{sockdir}/s", group=None, idle_timeout=0.05)
    async with server:
        c = await Conn.open(present(server.path))
        c.writer.write(wire.HEADER.pack(100) + b"\x81")  # a frame of 100 bytes announced, 1 sent
        assert await c.closed_by_server()
        assert server.connections == 0 or await _until(lambda: server.connections == 0)


async def test_a_request_being_answered_is_not_idle(sockdir):
    """The idle limit is for waiting on the client, never on gpud: an answer that takes longer
    than it is still sent."""
    handler, gate, started = _gated_apply()
    server = await serve(handler, f"{sockdir}/s", group=None, idle_timeout=0.05)
    async with server:
        c = await Conn.open(present(server.path))
        rid = await c.send("apply", {"wait": True})
        await asyncio.wait_for(started.wait(), GUARD)
        idle = await Conn.open(present(server.path))  # sweeps happen meanwhile: it is closed by one
        assert await idle.closed_by_server()
        assert server.connections == 1  # ... and the answering one is kept
        gate.set()
        resp = await c.recv()
        assert resp.id == rid and resp.ok
        c.close()


async def _until(cond) -> bool:
    """Yield to the loop until cond() holds (bounded by the test guard, no timing assumption)."""
    async def poll():
        while not cond():
            await asyncio.sleep(0)
        return True
    return await asyncio.wait_for(poll(), GUARD)


async def test_slow_handler_does_not_block_other_connections(running):
    handler, server = running
    gate = asyncio.Event()

    async def slow_apply(op, args, peer, _orig=handler.handle):
        if op == "apply":
            await gate.wait()
        return await _orig(op, args, peer)

    handler.handle = slow_apply  # the fake's own handler, slowed for apply
    a, b = await Conn.open(server.path), await Conn.open(server.path)
    rid = await a.send("apply", {"wait": True})
    assert (await b.call("status")).ok  # answered while apply is still waiting
    gate.set()
    resp = await a.recv()
    assert resp.id == rid and resp.ok
    a.close()
    b.close()


async def test_when_full_a_busy_connection_is_kept_and_the_new_one_refused(sockdir):
    handler, gate, started = _gated_apply()
    server = await serve(handler, f"{sockdir}/s", group=None, max_connections=1)
    async with server:
        a = await Conn.open(present(server.path))
        rid = await a.send("apply", {"wait": True})  # a is in the middle of a request
        await asyncio.wait_for(started.wait(), GUARD)
        b = await Conn.open(present(server.path))
        resp = await b.recv()
        assert resp.error.code == wire.E_BUSY and resp.error.message == "too many connections to gpud"
        assert await b.closed_by_server()
        gate.set()
        resp = await a.recv()
        assert resp.id == rid and resp.ok
        a.close()


async def test_when_full_the_oldest_idle_connection_makes_room(sockdir):
    server = await serve(FakeHandler(), f"{sockdir}/s", group=None, max_connections=2)
    async with server:
        old, newer = await Conn.open(present(server.path)), await Conn.open(present(server.path))
        assert (await old.call("version")).ok
        assert (await newer.call("version")).ok  # newer was active last
        third = await Conn.open(present(server.path))
        assert (await third.call("status")).ok
        assert await old.closed_by_server()
        assert (await newer.call("version")).ok
        assert server.evicted == 1
        newer.close()
        third.close()


# ---------------------------------------------------------------------------------------------
# Authorisation


GPUD = 990


@pytest.mark.parametrize("peer, op, allowed", [
    (Peer(pid=1, uid=0, gid=0, groups=frozenset({0})), "apply", True),
    (Peer(pid=1, uid=0, gid=0, groups=frozenset({0})), "reload", True),
    (Peer(pid=1, uid=0, gid=0, groups=frozenset({0})), "status", True),
    (Peer(pid=2, uid=1000, gid=GPUD, groups=frozenset({GPUD})), "status", True),
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, GPUD})), "plan", True),
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, GPUD})), "events", True),
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, GPUD})), "passthrough", True),
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, GPUD})), "apply", False),
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, GPUD})), "reload", False),
    (Peer(pid=3, uid=1000, gid=1000, groups=frozenset({1000})), "status", False),
    (Peer(pid=3, uid=1000, gid=1000, groups=frozenset({1000})), "version", False),
    (Peer(pid=4, uid=65534, gid=0, groups=frozenset({0})), "apply", False),  # gid 0 is not uid 0
])
def test_authorize(peer, op, allowed):
    assert authorize(peer, op, GPUD) is allowed


LEASERS = 991


@pytest.mark.parametrize("peer, op, allowed", [
    (Peer(pid=1, uid=0, gid=0, groups=frozenset({0})), "lease", True),
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, LEASERS})), "lease", True),
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, LEASERS})), "release", True),
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, LEASERS})), "leases", True),
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, LEASERS})), "apply", False),
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, GPUD})), "leases", True),  # gpud: read-only
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, GPUD})), "lease", False),
    (Peer(pid=2, uid=1000, gid=1000, groups=frozenset({1000, GPUD})), "release", False),
    (Peer(pid=3, uid=1000, gid=1000, groups=frozenset({1000})), "lease", False),
])
def test_authorize_leases(peer, op, allowed):
    assert authorize(peer, op, GPUD, LEASERS) is allowed


def test_no_lease_group_means_root_only_leases():
    assert not authorize(Peer(pid=2, uid=1000, gid=GPUD, groups=frozenset({GPUD, LEASERS})), "lease", GPUD, None)


def test_authorize_without_the_group_is_root_only():
    assert not authorize(Peer(pid=2, uid=1000, gid=GPUD, groups=frozenset({GPUD})), "status", None)
    assert authorize(Peer(pid=1, uid=0, gid=0), "apply", None)


def test_read_proc_groups(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text(
        "Name:\tpython\nUid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\nGroups:\t27 990 1000 \n")
    assert read_proc_groups(42, 1000, str(tmp_path)) == {27, 990, 1000}
    assert read_proc_groups(42, 1001, str(tmp_path)) is None  # pid reused by someone else
    assert read_proc_groups(43, 1000, str(tmp_path)) is None


def test_peer_credentials_of_a_real_socket():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = peer_credentials(a)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert set(os.getgroups()) | {os.getegid()} <= peer.groups


# A real non-root client: a child started as root (so it can import from /root's Python), which
# drops to uid/gid 65534 and the given groups before it connects.
CHILD = textwrap.dedent("""
    import json, os, socket, sys
    from gpud.wire import protocol as wire
    path, groups, ops = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    os.setgroups(groups); os.setgid(65534); os.setuid(65534)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except OSError as e:
        print(json.dumps({"connect": e.errno})); sys.exit(0)
    out, reader = [], wire.FrameReader()
    for n, op in enumerate(ops, 1):
        try:
            s.sendall(wire.encode_frame(wire.Request(id=n, op=op)))
            payload = reader.read_sync(s)
        except OSError:
            payload = None
        if payload is None:
            out.append("closed"); break
        r = wire.decode_message(payload)
        out.append("ok" if r.ok else r.error.code)
    print(json.dumps({"replies": out}))
""")


async def _as_nobody(path: str, groups: list[int], *ops: str) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, path, json.dumps(groups), *ops,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(wire.__file__)) + "/..")
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


@root_only
async def test_real_group_member_may_read_but_not_apply(sockdir):
    # nogroup (65534) plays `gpud`; the child's primary gid is 65534
    server = await serve(FakeHandler(), f"{sockdir}/s", group=grp.getgrgid(65534).gr_name)
    async with server:
        assert await _as_nobody(present(server.path), [], "status", "version") == {"replies": ["ok", "ok"]}
        assert await _as_nobody(present(server.path), [], "apply", "status") == {"replies": ["forbidden", "closed"]}
        assert await _as_nobody(present(server.path), [], "reload") == {"replies": ["forbidden"]}


@root_only
async def test_real_supplementary_group_member_may_read(sockdir):
    group = grp.getgrgid(1).gr_name  # "daemon" plays `gpud`, held only as a supplementary group
    server = await serve(FakeHandler(), f"{sockdir}/s", group=group)
    async with server:
        assert await _as_nobody(present(server.path), [1], "status") == {"replies": ["ok"]}
        assert await _as_nobody(present(server.path), [1], "apply") == {"replies": ["forbidden"]}


@root_only
async def test_real_stranger_is_kept_out_by_mode_and_by_credentials(sockdir):
    server = await serve(FakeHandler(), f"{sockdir}/s", group=grp.getgrgid(1).gr_name)
    async with server:
        # 0660 root:daemon: the file system refuses the connection
        import errno
        assert await _as_nobody(present(server.path), [], "status") == {"connect": errno.EACCES}
        # even with a careless 0666 socket (SocketMode's default), SO_PEERCRED refuses the request
        os.chmod(present(server.path), 0o666)
        assert await _as_nobody(present(server.path), [], "status") == {"replies": ["forbidden"]}


# ---------------------------------------------------------------------------------------------
# The socket file


@root_only
async def test_socket_is_0660_with_the_group(sockdir):
    path = f"{sockdir}/run/gpud/gpud.sock"  # parent directories are created
    server = await serve(FakeHandler(), path, group=grp.getgrgid(1).gr_name)
    async with server:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert (st.st_uid, st.st_gid) == (os.geteuid(), 1)
    assert not os.path.exists(path)  # removed on close


@pytest.mark.parametrize("group", ["no-such-group-gpud-test", None])
async def test_socket_is_0600_without_the_group(sockdir, group):
    old = os.umask(0)  # a permissive umask must not leak into the socket's mode
    try:
        server = await serve(FakeHandler(), f"{sockdir}/s", group=group)
    finally:
        os.umask(old)
    async with server:
        assert stat.S_IMODE(os.stat(present(server.path)).st_mode) == 0o600
        assert server.gpud_gid is None
    assert os.umask(old) == old  # restored


async def test_stale_socket_is_replaced(sockdir):
    path = f"{sockdir}/s"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()  # file left behind, nobody listening: connect() is refused
    server = await serve(FakeHandler(), path, group=None)
    async with server:
        c = await Conn.open(path)
        assert (await c.call("version")).ok
        c.close()


async def test_live_socket_is_not_stolen(running):
    _, first = running
    with pytest.raises(ServerError, match="in use"):
        await serve(FakeHandler(), first.path, group=None)
    c = await Conn.open(first.path)  # the first server is untouched
    assert (await c.call("version")).ok
    c.close()


async def test_non_socket_file_is_not_removed(sockdir):
    path = f"{sockdir}/s"
    with open(path, "w") as f:
        f.write("important")
    with pytest.raises(ServerError, match="not a socket"):
        await serve(FakeHandler(), path, group=None)
    with open(path) as f:
        assert f.read() == "important"


async def test_activated_socket_is_used_as_is_and_left_in_place(sockdir):
    path = f"{sockdir}/activated.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    os.chmod(path, 0o640)
    listener.listen()
    server = await serve(FakeHandler(), None, sock=listener, group=None)
    async with server:
        c = await Conn.open(path)
        assert (await c.call("version")).ok
        c.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert os.path.exists(path)  # the .socket unit owns it


# ---------------------------------------------------------------------------------------------
# Events


async def test_events_history_without_follow(running):
    handler, server = running
    handler.publish("step", "created 1g.18gb at {0}:1", gpu="0000:3b:00.0", gi=7)
    handler.publish("converged", "all GPUs converged")
    c = await Conn.open(server.path)
    reply = wire_replies.decode_result("events", (await c.call("events")).result)
    assert [e.kind for e in reply.events] == ["step", "converged"]
    assert reply.events[0].data == {"gi": 7} and reply.following is False
    assert (await c.call("version")).ok  # the connection is still usable
    c.close()


async def test_events_stream_to_two_followers(running):
    handler, server = running
    handler.publish("layout", "loaded /etc/gpud/layout.yaml")
    a, b = await Conn.open(server.path), await Conn.open(server.path)
    for c in (a, b):
        first = await c.call("events", {"follow": True})
        reply = wire_replies.decode_result("events", first.result)
        assert reply.following and [e.kind for e in reply.events] == ["layout"]
    for i in range(3):
        handler.publish("step", f"step {i}", gpu="0000:3b:00.0")
    for c in (a, b):
        got = [await c.recv() for _ in range(3)]
        assert all(isinstance(f, wire.EventFrame) and f.id == 1 for f in got)
        assert [f.event.message for f in got] == ["step 0", "step 1", "step 2"]
    a.close()
    await asyncio.wait_for(handler.gone.wait(), GUARD)  # closing unsubscribes
    assert len(handler.subscribers) == 1
    handler.publish("step", "step 3")
    assert (await b.recv()).event.message == "step 3"
    b.close()


async def test_events_from_an_async_iterator_source(sockdir):
    class IterHandler(FakeHandler):
        def __init__(self):
            super().__init__()
            self.queue: asyncio.Queue = asyncio.Queue()
            self.closed = asyncio.Event()

        def subscribe(self):
            async def gen():
                try:
                    while True:
                        yield await self.queue.get()
                finally:
                    self.closed.set()
            return gen()

    handler = IterHandler()
    handler.unsubscribe = None  # type: ignore[assignment]  # no unsubscribe: aclose() the iterator
    server = await serve(handler, f"{sockdir}/s", group=None)
    async with server:
        c = await Conn.open(present(server.path))
        await c.call("events", {"follow": True})
        handler.queue.put_nowait(wire.Event(time=1.0, kind="wait", gpu="0000:5c:00.0", message="pid 4121"))
        frame = await c.recv()
        assert frame.event == wire.Event(time=1.0, kind="wait", gpu="0000:5c:00.0", message="pid 4121")
        c.close()
        await asyncio.wait_for(handler.closed.wait(), GUARD)


async def test_slow_follower_loses_events_with_a_marker_and_does_not_stall_others(sockdir):
    handler = FakeHandler()
    server = await serve(handler, f"{sockdir}/s", group=None, event_queue=8)
    async with server:
        slow, fast = await Conn.open(present(server.path)), await Conn.open(present(server.path))
        await slow.call("events", {"follow": True})
        await fast.call("events", {"follow": True})
        blob = "x" * 65536
        n = 200  # 13 MB: far beyond socket buffers + transport buffer + 8 queued events
        for i in range(n):
            handler.publish("step", str(i), blob=blob)
            frame = await fast.recv()  # the fast follower gets every event, in order
            assert frame.event.message == str(i)
        got: list[int] = []
        while True:
            ev = (await slow.recv()).event
            if ev.kind == "overflow":
                break
            got.append(int(ev.message))
        assert got == list(range(len(got))) and len(got) < n  # an unbroken prefix, then the gap
        assert ev.data["dropped"] >= 1 and "dropped" in ev.message
        slow.close()
        fast.close()


class BusHandler(FakeHandler):
    """Events from the engine's own EventBus: the server sends from the bus's bounded queue."""

    def __init__(self, queue_size: int) -> None:
        super().__init__()
        self.bus = EventBus(queue_size=queue_size)

    def subscribe(self) -> EventQueue:  # type: ignore[override]  # the engine's own queue where the fake hands a plain one
        return self.bus.subscribe()

    def unsubscribe(self, queue: EventQueue) -> None:  # type: ignore[override]  # as subscribe
        self.bus.unsubscribe(queue)
        self.unsubscribed += 1
        self.gone.set()

    def recent_events(self) -> list[dict]:
        return self.bus.recent()

    def publish(self, kind: str, message: str, gpu: str | None = None, **data):
        return self.bus.publish(kind, message, gpu, **data)


async def test_engine_bus_queue_is_the_one_bound_between_engine_and_client(sockdir):
    handler = BusHandler(queue_size=8)
    server = await serve(handler, f"{sockdir}/s", group=None, event_queue=10_000)  # not the bound used
    async with server:
        slow, fast = await Conn.open(present(server.path)), await Conn.open(present(server.path))
        await slow.call("events", {"follow": True})
        await fast.call("events", {"follow": True})
        blob = "x" * 65536
        n = 200
        for i in range(n):
            handler.publish("step", str(i), blob=blob)
            assert (await fast.recv()).event.message == str(i)
        got: list[int] = []
        while True:
            ev = (await slow.recv()).event
            if ev.kind == "overflow":
                break
            got.append(int(ev.message))
        assert got == list(range(len(got))) and len(got) < n
        assert ev.data["dropped"] >= 1 and f"{ev.data['dropped']} events dropped" in ev.message
        slow.close()
        fast.close()
        await asyncio.wait_for(handler.gone.wait(), GUARD)


async def test_event_queue_marks_the_gap_where_events_were_lost():
    box = EventQueue(2)
    for x in "abc":
        box.put(x)
    assert await box.get() == "a"
    box.put("d")  # still full (b + marker): counted in the marker
    assert await box.get() == "b"
    marker = await box.get()
    assert (marker["kind"], marker["data"]) == ("overflow", {"dropped": 2})
    box.put("e")
    assert await box.get() == "e"
    box.close()
    assert await box.get() is None


async def test_close_ends_followers(sockdir):
    handler = FakeHandler()
    server = await serve(handler, f"{sockdir}/s", group=None)
    c = await Conn.open(present(server.path))
    await c.call("events", {"follow": True})
    await server.close()
    assert await c.closed_by_server()
    assert handler.subscribers == set()
    with contextlib.suppress(Exception):
        c.close()


async def test_history_is_trimmed_to_fit_one_frame(sockdir):
    handler = FakeHandler()
    server = await serve(handler, f"{sockdir}/s", group=None, max_frame=4096)
    async with server:
        for i in range(40):
            handler.publish("step", str(i), blob="x" * 200)
        c = await Conn.open(present(server.path))
        for follow in (False, True):
            reply = wire_replies.decode_result("events", (await c.call("events", {"follow": follow})).result)
            kept = [int(e.message) for e in reply.events]
            assert kept and kept == list(range(40 - len(kept), 40))  # the newest, in order
        c.close()


async def test_close_does_not_wait_for_a_follower_that_stopped_reading(sockdir):
    handler = FakeHandler()
    server = await serve(handler, f"{sockdir}/s", group=None, event_queue=4)
    stuck = await Conn.open(present(server.path))
    await stuck.call("events", {"follow": True})
    for i in range(100):  # 6.5 MB nobody reads: the server's writes to it block
        handler.publish("step", str(i), blob="x" * 65536)
        for _ in range(5):
            await asyncio.sleep(0)  # let the server move the event into the socket
    await asyncio.wait_for(server.close(), GUARD)
    assert server.connections == 0 and handler.subscribers == set()
    stuck.close()


# ---------------------------------------------------------------------------------------------
# Root is always served (issue 13.3)

FOLLOWERS = textwrap.dedent("""
    import os, socket, sys, time
    sys.path.insert(0, os.getcwd())
    from gpud.wire import protocol as wire
    path, n = sys.argv[1], int(sys.argv[2])
    os.setgroups([]); os.setgid(65534); os.setuid(65534)   # nobody, in nogroup (which plays gpud)
    held, refused = [], 0
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # and never read: a stalled follower
        s.connect(path)
        s.sendall(wire.encode_frame(wire.Request(id=1, op="events", args={"follow": True})))
        held.append(s)
    print("connected", len(held), flush=True)
    sys.stdin.read()      # hold them all until the test lets go
""")


@root_only
async def test_non_reading_followers_of_another_user_never_lock_root_out(sockdir):
    """135 `events -f` of a gpud-group member that never read, against a 128-connection daemon:
    root's status, apply and reload are still answered, the user keeps at most its share, and
    the events nobody reads are not buffered without bound."""
    handler = BusHandler(queue_size=50)
    server = await serve(handler, f"{sockdir}/s", group=grp.getgrgid(65534).gr_name, idle_timeout=600)
    async with server:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", FOLLOWERS, present(present(server.path)), "135", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(os.path.dirname(wire.__file__))))
        try:
            line = await asyncio.wait_for(present(child.stdout).readline(), 120)
            assert line.decode().strip() == "connected 135", (line, await present(child.stderr).read())
            await _until(lambda: len(handler.bus._subscribers) >= 16)  # its share is subscribed
            blob = "x" * 4096
            for i in range(200):  # 800 KB of events nobody reads
                handler.publish("step", str(i), blob=blob)
                await asyncio.sleep(0)
            for op, args in (("status", {}), ("apply", {"wait": False}), ("reload", {})):
                c = await Conn.open(present(server.path))
                resp = await c.call(op, args)
                assert resp.ok, (op, resp.error)
                c.close()
            nobody = [c for c in server._tasks.values() if c.peer is not None and c.peer.uid == 65534]
            assert len(nobody) <= 16
            # every subscription left is bounded: the queue of a stalled follower was dropped
            await _until(lambda: all(len(q._items) <= 51 for q in handler.bus._subscribers))
        finally:
            present(child.stdin).close()
            await child.wait()
        await _until(lambda: not handler.bus._subscribers)  # gone with their connections


async def test_per_uid_limit_and_root_reserve_with_injected_peers(sockdir):
    """Peers decided at the server's seam: the client's abstract address names its uid."""
    def lookup(sock: socket.socket) -> Peer:
        uid = int(sock.getpeername().split(b"-")[-1] if isinstance(sock.getpeername(), bytes)
                  else sock.getpeername().split("-")[-1])
        return Peer(pid=1, uid=uid, gid=GPUD, groups=frozenset({GPUD}))

    counter = iter(range(10_000))
    token = secrets.token_hex(8)  # abstract names are shared across a network namespace

    async def open_as(uid: int) -> Conn:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(f"\0gpud-test-{token}-{next(counter)}-{uid}")
        s.setblocking(False)
        await asyncio.get_running_loop().sock_connect(s, present(present(server.path)))
        return Conn(*await asyncio.open_unix_connection(sock=s))

    server = await serve(FakeHandler(), f"{sockdir}/s", group=None, max_connections=8, max_per_uid=3,
                         root_reserve=2, peer_lookup=lookup)
    server.gpud_gid = GPUD
    async with server:
        first = [await open_as(1000) for _ in range(3)]
        for c in first:
            assert (await c.call("status")).ok
        fourth = await open_as(1000)  # over its limit: its own oldest idle connection goes
        assert (await fourth.call("status")).ok
        assert await first[0].closed_by_server()
        others = [await open_as(2000 + i) for i in range(3)]
        for c in others:
            assert (await c.call("status")).ok
        # 6 non-root connections = 8 - 2 reserved: the next non-root one displaces the oldest non-root
        late = await open_as(3000)
        assert (await late.call("status")).ok
        assert await first[1].closed_by_server()
        roots = [await open_as(0) for _ in range(2)]
        for c in roots:
            assert (await c.call("apply", {"wait": False})).ok
        assert server.connections == 8
        # full: root's next connection displaces the oldest non-root one, never another root's
        extra_root = await open_as(0)
        assert (await extra_root.call("reload")).ok
        assert await first[2].closed_by_server()
        for c in roots:
            assert (await c.call("status")).ok
