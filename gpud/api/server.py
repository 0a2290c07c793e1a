"""The daemon's Unix-socket API server: connections, framing, limits (one concern: serving the socket).

A root daemon that takes commands over a socket is a privilege boundary, so the socket is never
world-writable (0660 root:gpud, or 0600 without the group), every connection is authorised from
the kernel's SO_PEERCRED record rather than anything the client says, and each connection is
bounded (frame size, idle time, event queue) so no local user can stall the daemon or other clients.

Who may do what is decided in `gpud.api.peers` (uid 0 everything, the `gpud` group the read
ops, nobody else anything). A refused request gets a `forbidden` error and the connection is closed, as
after a malformed or oversized frame or an unknown op.

Root must always be served, whatever other users do (`systemctl reload gpud` runs `gpudctl
reload` as root): each non-root uid may hold at most `max_per_uid` connections, non-root users
together at most `max_connections - root_reserve`, and when a limit is reached the oldest
*evictable* connection (waiting for a request, or following events) of the same class is closed
to make room; a connection in the middle of a request is never evicted, nor one of a process
with a request in progress on another connection (`apply --wait` follows events beside its apply). A follower that does not
read is dropped once its queue overflows or a write to it stalls for `idle_timeout`, so a stalled
client never holds more than one bounded queue and one frame of buffered output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, Protocol

import msgspec

from gpud.api.peers import Peer, authorize, group_id, may_connect, peer_credentials
from gpud.api.socket_file import ServerError, bind_socket, unlink_own
from gpud.engine.events import EventQueue, overflow_event
from gpud.py_compat import timeout
from gpud.wire import protocol as wire
from gpud.wire import replies as wire_replies

log = logging.getLogger("gpud.api")


class ApiError(Exception):
    """Raised by a handler to answer with an error of its own code ("invalid-layout", "busy"...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Handler(Protocol):
    """What the daemon gives the server.

    `handle` answers every op but `events` with the op's reply struct (`wire_replies.RESULTS`).
    `subscribe` returns an `EventQueue` (the engine's bounded queue, sent from as it is), an
    asyncio.Queue or an async iterator of events (wire.Event or dicts of its shape) that starts
    collecting immediately; `recent_events` the history, oldest first. If the handler has
    `unsubscribe(source)`, it is called when the subscriber goes away. If it has `lease_group()`,
    members of the group it names (the layout's policy.lease-group) may use the lease ops. If it
    has `encoded(op, args, peer)`, that is asked first: a msgspec.Raw holding the op's reply
    struct as MessagePack, sent as it is (one encoding shared by many clients), or None. If it has
    `before_send()`, that is called before every reply and event is sent.
    """

    async def handle(self, op: str, args: dict[str, Any], peer: Peer) -> Any: ...

    def subscribe(self) -> EventQueue | asyncio.Queue | AsyncIterator[Any]: ...

    def recent_events(self) -> list[Any]: ...


# ---------------------------------------------------------------------------------------------
# Events


def _as_event(ev: Any) -> wire.Event:
    if isinstance(ev, wire.Event):
        return ev
    if isinstance(ev, msgspec.Struct):
        ev = msgspec.structs.asdict(ev)
    return msgspec.convert(ev, wire.Event)


# ---------------------------------------------------------------------------------------------
# Server


class _Conn:
    """Book-keeping of one connection, for the limits: who, in which state, since when."""

    __slots__ = ("task", "writer", "peer", "state", "since")

    def __init__(self, task: asyncio.Task, writer: asyncio.StreamWriter) -> None:
        self.task = task
        self.writer = writer
        self.peer: Peer | None = None
        # idle: waiting for a request (or not yet sent one); busy: a request is being answered;
        # following: streaming events. Only idle and following connections may be evicted.
        self.state: Literal["idle", "busy", "following"] = "idle"
        self.since = time.monotonic()  # last activity: accepted, a reply sent, an event delivered

    def mark(self, state: Literal["idle", "busy", "following"]) -> None:
        self.state = state
        self.since = time.monotonic()

    @property
    def evictable(self) -> bool:
        return self.state != "busy"


class ApiServer:
    """A running API server. `close()` stops listening, ends every connection (followers too)
    and removes the socket file if this server created it."""

    def __init__(self, handler: Handler, *, path: str | None, gpud_gid: int | None, max_frame: int,
                 idle_timeout: float | None, max_connections: int, event_queue: int,
                 max_per_uid: int = 16, root_reserve: int = 32,
                 peer_lookup: Callable[[socket.socket], Peer] = peer_credentials) -> None:
        self.handler = handler
        self.path = path
        self.gpud_gid = gpud_gid
        self.max_frame = max_frame
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.max_per_uid = max_per_uid
        self.root_reserve = min(root_reserve, max_connections - 1) if max_connections > 1 else 0
        self.event_queue = event_queue
        self.peer_lookup = peer_lookup
        self.evicted = 0  # connections closed to make room (for tests and the log)
        self._reader = wire.FrameReader(max_frame)
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self._tasks: dict[asyncio.Task, _Conn] = {}
        self._owned: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound
        self._closing = False

    @property
    def connections(self) -> int:
        return len(self._tasks)

    async def _start(self, sock: socket.socket | None) -> None:
        if sock is None:
            if not self.path:
                raise ServerError("either a socket path or an inherited socket is required")
            sock, self._owned = bind_socket(self.path, self.gpud_gid)
        self._server = await asyncio.start_unix_server(self._connection, sock=sock)
        if self.idle_timeout is not None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(self.idle_timeout), name="api-idle")

    async def _sweep(self, limit: float) -> None:
        """Close the connections that have waited for a request longer than `limit` seconds (or
        for the rest of one: a client that stops mid-frame). One task for all of them, a few times
        per `limit`, rather than a timer armed and cancelled around every request's read: at
        2,000 requests/s those were a sixth of the loop's work per answer."""
        period = min(limit / 4, 1.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in [c for c in self._tasks.values() if c.state == "idle" and now - c.since > limit]:
                peer = conn.peer
                log.debug("closing idle connection of pid %s", peer.pid if peer else "?")
                conn.task.cancel()

    async def close(self) -> None:
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        # Abort the transports as well as cancelling: a cancellation can be lost (a task woken by
        # its I/O at the same moment), a dead transport cannot, and abort() does not wait for a
        # client that stopped reading.
        for t, conn in list(self._tasks.items()):
            conn.writer.transport.abort()
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self._owned and self.path:
            unlink_own(self.path, self._owned)
            self._owned = None

    async def __aenter__(self) -> ApiServer:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- one connection ---------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        conn = _Conn(task, writer)
        self._tasks[task] = conn
        if self._closing:  # accepted just before close(): close() did not see this task
            self._tasks.pop(task)
            writer.transport.abort()
            return
        try:
            await self._serve_connection(conn, reader, writer)
        except (ConnectionError, TimeoutError, asyncio.CancelledError):
            pass  # client gone, too slow to take its reply, or server closing
        except Exception:
            log.exception("API connection failed")
        finally:
            self._tasks.pop(task, None)
            writer.close()  # flushes what is buffered (the last error reply) ...
            try:
                async with timeout(self.idle_timeout or 10.0):
                    await writer.wait_closed()
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - any failure to flush ends the connection the hard way
                writer.transport.abort()  # ... unless the client does not read it

    def _before_send(self) -> None:
        before = getattr(self.handler, "before_send", None)
        if before is not None:
            before()

    async def _send(self, writer: asyncio.StreamWriter, msg: Any) -> None:
        self._before_send()
        try:
            frame = wire.encode_frame(msg, max_frame=self.max_frame)
        except (wire.FrameTooLarge, TypeError, msgspec.EncodeError) as e:
            log.error("cannot encode reply to request %s: %s", getattr(msg, "id", "?"), e)
            frame = wire.encode_frame(self._error(getattr(msg, "id", 0), wire.E_INTERNAL,
                                                  f"cannot encode the reply: {e}"))
        writer.write(frame)
        if not writer.transport.get_write_buffer_size():
            return  # the kernel took it all: nothing to wait for (most replies)
        # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
        async with timeout(self.idle_timeout):
            await writer.drain()

    @staticmethod
    def _error(rid: int, code: str, message: str) -> wire.Response:
        return wire.Response(id=rid, ok=False, error=wire.ErrorInfo(code=code, message=message))

    # -- limits ---------------------------------------------------------------------------------

    def _evict_oldest(self, among: list[_Conn], why: str) -> bool:
        """Close the least recently active evictable connection of `among`; False if none is.
        A connection of a process that has a request in progress on another connection (the
        event stream of `gpudctl apply --wait`) is part of that request: it is not evicted."""
        waiting = {c.peer.pid for c in self._tasks.values() if c.state == "busy" and c.peer is not None}
        candidates = [c for c in among if c.evictable and (c.peer is None or c.peer.pid not in waiting)]
        if not candidates:
            return False
        victim = min(candidates, key=lambda c: c.since)
        self._tasks.pop(victim.task, None)
        self.evicted += 1
        peer = victim.peer
        log.info("closing the %s connection of pid %s uid %s to make room: %s", victim.state,
                 peer.pid if peer else "?", peer.uid if peer else "?", why)
        victim.writer.transport.abort()
        victim.task.cancel()
        return True

    def _admit(self, conn: _Conn) -> str | None:
        """Make room for a new connection under the limits; the refusal message if there is none."""
        peer = conn.peer
        assert peer is not None
        others = [c for c in self._tasks.values() if c is not conn and c.peer is not None]
        if peer.uid != 0:
            same = [c for c in others if c.peer is not None and c.peer.uid == peer.uid]
            if len(same) >= self.max_per_uid and not self._evict_oldest(same, f"uid {peer.uid} reached its limit"):
                return f"too many connections to gpud from uid {peer.uid} (at most {self.max_per_uid})"
            non_root = [c for c in self._tasks.values() if c is not conn and c.peer is not None and c.peer.uid != 0]
            cap = self.max_connections - self.root_reserve
            if len(non_root) >= cap and not self._evict_oldest(non_root, "non-root connections reached their limit"):
                return f"too many connections to gpud from users other than root (at most {cap})"
        while len(self._tasks) > self.max_connections:
            rest = [c for c in self._tasks.values() if c is not conn]
            # non-root connections go first: root's capacity is the reserved part
            non_root = [c for c in rest if c.peer is None or c.peer.uid != 0]
            if self._evict_oldest(non_root, "gpud is full"):
                continue
            if peer.uid != 0 or not self._evict_oldest(rest, "gpud is full"):  # only root may displace root
                return "too many connections to gpud"
        return None

    async def _serve_connection(self, conn: _Conn, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        peer = conn.peer = self.peer_lookup(writer.get_extra_info("socket"))
        refusal = self._admit(conn)
        if refusal is not None:
            log.warning("refused a connection of pid %d uid %d: %s", peer.pid, peer.uid, refusal)
            await self._send(writer, self._error(0, wire.E_BUSY, refusal))
            return
        while True:
            conn.mark("idle")  # closed by _sweep once idle for longer than idle_timeout
            try:
                payload = await self._reader.read_async(reader)
            except wire.FrameError as e:
                await self._send(writer, self._error(e.request_id, e.code, str(e)))
                return
            if payload is None:
                return
            conn.mark("busy")
            try:
                req = wire.decode_request(payload)
            except wire.FrameError as e:
                await self._send(writer, self._error(e.request_id, e.code, str(e)))
                return
            lease_gid = self._lease_gid()
            if not may_connect(peer, self.gpud_gid, lease_gid):
                await self._refuse(writer, req, peer)
                return
            if req.op not in wire.OPS:
                await self._send(writer, self._error(req.id, wire.E_UNKNOWN_OP, f"unknown op {req.op!r}"))
                return
            if not authorize(peer, req.op, self.gpud_gid, lease_gid):
                await self._refuse(writer, req, peer)
                return
            try:
                args = msgspec.to_builtins(msgspec.convert(req.args, wire.ARGS[req.op]))
            except msgspec.ValidationError as e:
                await self._send(writer, self._error(req.id, wire.E_BAD_ARGS, f"{req.op}: {e}"))
                continue
            if req.op == "events":
                if args.get("follow"):
                    await self._follow(conn, req.id, reader, writer)
                    return
                await self._send(writer, self._history(req.id, self._recent(), following=False))
                continue
            await self._send(writer, await self._call(req, args, peer))

    def _lease_gid(self) -> int | None:
        """The gid of the layout's policy.lease-group (None: none named, or no such group)."""
        lease_group = getattr(self.handler, "lease_group", None)
        return group_id(lease_group()) if lease_group is not None else None

    async def _refuse(self, writer: asyncio.StreamWriter, req: wire.Request, peer: Peer) -> None:
        log.warning("refused %r from pid %d uid %d", req.op, peer.pid, peer.uid)
        need = ("root" if req.op in wire.WRITE_OPS else
                "root or membership of the layout's policy.lease-group" if req.op in wire.LEASE_OPS else
                "root or membership of the gpud group")
        await self._send(writer, self._error(req.id, wire.E_FORBIDDEN, f"{req.op} needs {need}"))

    async def _call(self, req: wire.Request, args: dict[str, Any], peer: Peer) -> wire.Response:
        encoded = getattr(self.handler, "encoded", None)
        try:
            raw = await encoded(req.op, args, peer) if encoded is not None else None
            if raw is not None:  # the handler's own encoding of the op's reply struct
                return wire.Response(id=req.id, ok=True, result=raw)
            result = await self.handler.handle(req.op, args, peer)
        except ApiError as e:
            return self._error(req.id, e.code, e.message)
        except Exception as e:
            log.exception("handler failed on %s", req.op)
            return self._error(req.id, wire.E_INTERNAL, f"{type(e).__name__}: {e}")
        typ = wire_replies.RESULTS[req.op]
        if not isinstance(result, typ):  # a handler bug: the client would misread anything else
            log.error("handler answered %s with %s, not %s", req.op, type(result).__name__, typ.__name__)
            return self._error(req.id, wire.E_INTERNAL,
                               f"malformed {req.op} reply: {type(result).__name__}, not {typ.__name__}")
        return wire.Response(id=req.id, ok=True, result=result)

    def _history(self, rid: int, recent: list[Any], *, following: bool) -> wire.Response:
        """The history reply, its oldest events left out until it fits in one frame (how many in
        `omitted`)."""
        events = [_as_event(e) for e in recent]
        total = len(events)
        while True:
            resp = wire.Response(id=rid, ok=True, result=wire_replies.EventsReply(events=events, following=following,
                                                                         omitted=total - len(events)))
            try:
                wire.encode_frame(resp, max_frame=self.max_frame)
                return resp
            except wire.FrameTooLarge:
                if not events:
                    raise
                events = events[len(events) // 2 + 1:] if len(events) > 1 else []

    def _recent(self) -> list[Any]:
        recent = getattr(self.handler, "recent_events", None)
        return list(recent()) if recent else []

    async def _follow(self, conn: _Conn, rid: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        """Stream events until the client closes. A follower that falls behind (its queue overflows)
        gets the overflow event as its last frame and is closed; one whose writes stall for
        `idle_timeout` is closed too: a client that does not read holds no more than its bounded
        queue and one frame of output, and frees them when it goes."""
        # subscribe and snapshot the history with no await in between: no event is lost or doubled
        source = self.handler.subscribe()
        history = self._recent()
        if isinstance(source, EventQueue):  # already bounded, with its overflow marker
            outbox, pump = source, None
        else:
            outbox = EventQueue(self.event_queue)
            pump = asyncio.create_task(self._pump(source, outbox))
        conn.mark("following")
        eof = asyncio.create_task(reader.read(1))  # the client never sends more; data or EOF ends it
        overflow = asyncio.create_task(outbox.overflowed.wait())
        try:
            await self._send(writer, self._history(rid, history, following=True))
            conn.mark("following")
            while True:
                get = asyncio.ensure_future(outbox.get())
                await asyncio.wait({get, eof}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return
                item = get.result()
                if item is None:
                    return
                self._before_send()
                try:
                    frame = wire.encode_frame(wire.EventFrame(id=rid, event=_as_event(item)),
                                              max_frame=self.max_frame)
                except (msgspec.ValidationError, msgspec.EncodeError, TypeError, wire.FrameError) as e:
                    log.error("dropping an event that cannot be sent: %s", e)
                    continue
                writer.write(frame)
                if isinstance(item, dict) and item.get("kind") == "overflow":
                    return  # it fell behind: the marker is its last frame, flushed on close
                drain = asyncio.ensure_future(writer.drain())
                await asyncio.wait({drain, eof, overflow}, return_when=asyncio.FIRST_COMPLETED,
                                   timeout=self.idle_timeout)
                if not drain.done():
                    drain.cancel()
                    if not eof.done():  # stalled: not reading while its queue filled, or for too long
                        log.info("closing a follower (pid %d) that does not read", conn.peer.pid if conn.peer else 0)
                        if outbox.dropped:
                            self._before_send()
                            writer.write(wire.encode_frame(wire.EventFrame(
                                id=rid, event=_as_event(overflow_event(outbox.dropped)))))
                    return
                drain.result()
                conn.mark("following")
        finally:
            if pump is not None:
                pump.cancel()
            eof.cancel()
            overflow.cancel()
            await asyncio.gather(*(t for t in (pump, eof, overflow) if t is not None), return_exceptions=True)
            unsubscribe = getattr(self.handler, "unsubscribe", None)
            if unsubscribe is not None:
                unsubscribe(source)
            elif hasattr(source, "aclose"):
                with contextlib.suppress(Exception):
                    await source.aclose()

    @staticmethod
    async def _pump(source: Any, outbox: EventQueue) -> None:
        try:
            if isinstance(source, asyncio.Queue):
                while True:
                    outbox.put(await source.get())
            else:
                async for ev in source:
                    outbox.put(ev)
        finally:
            outbox.close()


async def serve(
    handler: Handler,
    path: str | None,
    *,
    sock: socket.socket | None = None,
    group: str | None = "gpud",
    max_frame: int = wire.MAX_FRAME,
    idle_timeout: float | None = 60.0,
    max_connections: int = 128,
    max_per_uid: int = 16,
    root_reserve: int = 32,
    event_queue: int = 1000,
    peer_lookup: Callable[[socket.socket], Peer] = peer_credentials,
) -> ApiServer:
    """Start serving `handler` on a Unix socket and return the running server.

    `sock`: an inherited listening socket (systemd activation, LISTEN_FDS) used as is; its mode is
    the .socket unit's business (SocketMode=0660, SocketGroup=gpud). Otherwise the socket is
    created at `path` (a live one there makes this raise ServerError; a dead one is replaced).
    `group` is the group whose members may use the read ops; missing group: root only.
    `idle_timeout`: seconds a connection may stay silent between requests, or a follower may not
    take a frame (None: forever). `max_per_uid`: connections of one non-root uid; `root_reserve`:
    connections only root may use. `peer_lookup`: who is at the other end (SO_PEERCRED).
    """
    server = ApiServer(handler, path=path, gpud_gid=group_id(group), max_frame=max_frame,
                       idle_timeout=idle_timeout, max_connections=max_connections,
                       max_per_uid=max_per_uid, root_reserve=root_reserve, event_queue=event_queue,
                       peer_lookup=peer_lookup)
    await server._start(sock)
    return server


__all__ = [
    "ApiError",
    "ApiServer",
    "Handler",
    "serve",
]
