"""The status replica: `status` answered from the daemon's last snapshot, in a process of its own.

Why a process: the daemon is one Python interpreter, and while an apply's worker threads run
Python (reading 64 GPUs, planning) they hold the interpreter's lock as the event loop would;
every answer waits for it, several times (after epoll, recv, send), and on a busy host that put
the tail of `status` at 4-7 ms (docs/internals.md, the status section). This process holds no
lock the apply wants: it keeps the bytes of the daemon's status reply and answers from them.

What it answers: `status` without `fresh`, exactly as the daemon would at that moment (the same
bytes; only the observation's age is its own, from the same monotonic clock). Anything else, a
request before the first snapshot, or one while the daemon has been silent for longer than
`stale_after` (its loop stuck), gets the `elsewhere` error, and gpudctl asks the daemon's own
socket instead (gpud.cli.transport). Who may ask is decided as the daemon decides it
(gpud.api.peers, from SO_PEERCRED), with the groups the daemon sends.

How it is fed (gpud.api.status_feed, in the daemon): one socket pair; the daemon writes a
snapshot frame after every change it makes and hears of, before it sends anything else to anyone,
so a client that has seen a change (an apply's reply, an event) and then asks here finds it. The
replica reads every frame waiting on that socket before it answers what came after them. The
daemon writes at least every quarter second (status_feed.BEAT); the replica exits when the socket closes.

Frames are those of the API (gpud.wire.frames); their payloads MessagePack arrays:
  daemon -> replica  ["snapshot", [part0, part1, part2], tail, observed_at, started, kubernetes,
                      gpud_gid, lease_gid]   (bytes but the two floats and the gids; `started`:
                                              when the observation began to be read, on the
                                              host's monotonic clock, which both processes share)
                     ["beat"]
  replica -> daemon  ["heard", answers]      (after a round that read the daemon's frames or
                                              answered, REPORT seconds apart at most: the daemon
                                              kills a replica that leaves its frames unheard for a
                                              second; it counts the answers, and re-reads the host
                                              when its observation is older than its bound, as for
                                              a status it answers itself)
A snapshot's parts are the reply's MessagePack bytes around its per-answer fields, in declaration
order: observed_at, observation_age, kubernetes (gpud.api.status_snapshot._Encoded).

Standard library, msgpack and two small modules of gpud (frames, peers): about 12 MB resident,
where a process with asyncio and msgspec would be 22.

    python -m gpud.api.status_replica LISTEN_FD FEED_FD STALE_AFTER
"""

from __future__ import annotations

import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable

import msgpack

from gpud.api.peers import Peer, authorize, peer_credentials
from gpud.wire import frames

TICK = 0.25  # seconds the loop waits at most between its own rounds (the idle sweep, a report)
REPORT = 0.05  # seconds between two reports to the daemon at least (each wakes the daemon's loop)
IDLE_TIMEOUT = 60.0  # a connection silent between requests, or not taking its reply, for longer is closed
MAX_CONNECTIONS = 128
MAX_PER_UID = 16
ROOT_RESERVE = 32  # connections only root may use, as on the daemon's socket
_READ = 1 << 16
_PACK = msgpack.Packer()
# The envelope of gpud.wire.protocol.Response as msgspec writes it (a map of its 4 fields in
# declaration order): id, ok, result, error.
_OK_HEAD = b"\x84" + _PACK.pack("id")
_OK_MID = _PACK.pack("ok") + _PACK.pack(True) + _PACK.pack("result")
_OK_TAIL = _PACK.pack("error") + _PACK.pack(None)


class _Snapshot:
    __slots__ = ("parts", "tail", "observed_at", "started", "kubernetes", "gpud_gid", "lease_gid")

    def __init__(self, msg: list) -> None:
        _, parts, self.tail, observed_at, started, self.kubernetes, self.gpud_gid, self.lease_gid = msg
        if len(parts) != 3:
            raise ValueError(f"a snapshot has 3 parts, not {len(parts)}")
        self.parts = parts
        self.observed_at = _PACK.pack(float(observed_at))
        self.started = float(started)  # 0: nothing read yet (the daemon's age is 0 then too)

    def answer(self, rid: int, now: float) -> list[bytes]:
        """The frame of the `status` response to request `rid` as of `now`, in pieces (sent as
        they are, with one sendmsg: 80 KB copied into one string three times was most of an
        answer's cost)."""
        age = round(now - self.started, 4) if self.started else 0.0
        p0, p1, p2 = self.parts
        pieces = [b"", _OK_HEAD, _PACK.pack(rid), _OK_MID, p0, self.observed_at, p1, _PACK.pack(age), p2,
                  self.kubernetes, self.tail, _OK_TAIL]
        pieces[0] = frames.HEADER.pack(sum(map(len, pieces)))
        return pieces


def error(rid: int, code: str, message: str) -> list[bytes]:
    return [frames.frame(_PACK.pack({"id": rid, "ok": False, "result": None,
                                     "error": {"code": code, "message": message}}))]


class _Conn:
    __slots__ = ("sock", "peer", "inbuf", "out", "since", "closing")

    def __init__(self, sock: socket.socket, peer: Peer, since: float) -> None:
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()
        self.out: memoryview | None = None  # what is left of the reply being sent
        self.since = since  # last activity: accepted, a whole request read, a whole reply sent
        self.closing = False  # close once `out` is sent


class Replica:
    """The serving loop. `peer_lookup` says who is at the other end (SO_PEERCRED; tests may
    substitute), `clock` is time.monotonic."""

    def __init__(self, listener: socket.socket, feed: socket.socket, *, stale_after: float,
                 peer_lookup: Callable[[socket.socket], Peer] = peer_credentials,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.listener = listener
        self.feed = feed
        self.stale_after = stale_after
        self.peer_lookup = peer_lookup
        self.clock = clock
        self.snapshot: _Snapshot | None = None
        self.heard = clock()  # the daemon's last frame
        self.answered = 0  # answers not yet reported to the daemon
        self.unreported = False  # frames read since the last report
        self.reported = -REPORT  # self.clock() of the last report
        self.conns: dict[int, _Conn] = {}
        self._feed_in = bytearray()
        self._sel = selectors.DefaultSelector()
        for s in (listener, feed):
            s.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        self._sel.register(feed, selectors.EVENT_READ, "feed")

    # -- the daemon's side ---------------------------------------------------------------------
    def read_feed(self) -> bool:
        """Take in every frame the daemon has written; False when it closed the socket."""
        while True:
            try:
                data = self.feed.recv(_READ)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError:  # reset by a daemon that closed it with our words unread: closed all the same
                return False
            if not data:
                return False
            self._feed_in += data
        for payload in frames.whole_frames(self._feed_in):
            msg = msgpack.unpackb(payload)
            self.heard = self.clock()
            self.unreported = True
            if msg[0] == "snapshot":
                self.snapshot = _Snapshot(msg)
        return True

    def _report(self) -> None:
        """Tell the daemon its frames were read and how many answers were given since the last
        report, REPORT seconds apart at most."""
        now = self.clock()
        if not (self.answered or self.unreported) or now - self.reported < REPORT:
            return
        try:
            self.feed.send(frames.frame(_PACK.pack(["heard", self.answered])))
        except (BlockingIOError, InterruptedError):
            return  # the daemon is behind: reported with the next round
        except OSError:
            return  # the daemon closed the feed: read_feed says so in the next round
        self.answered, self.unreported, self.reported = 0, False, now

    # -- clients -------------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            try:
                peer = self.peer_lookup(sock)
            except OSError:
                sock.close()
                continue
            conn = _Conn(sock, peer, self.clock())
            refusal = self._admit(peer)
            self.conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            if refusal is not None:
                self._send(conn, error(0, frames.E_BUSY, refusal), close=True)

    def _admit(self, peer: Peer) -> str | None:
        """The daemon's limits without its evictions: a client refused here asks the daemon,
        whose socket evicts for root (gpud.api.server)."""
        if len(self.conns) >= MAX_CONNECTIONS:
            return "too many connections to the status replica"
        if peer.uid == 0:
            return None
        same = sum(1 for c in self.conns.values() if c.peer.uid == peer.uid)
        if same >= MAX_PER_UID:
            return f"too many connections from uid {peer.uid} (at most {MAX_PER_UID})"
        others = sum(1 for c in self.conns.values() if c.peer.uid != 0)
        if others >= MAX_CONNECTIONS - ROOT_RESERVE:
            return "too many connections from users other than root"
        return None

    def _close(self, conn: _Conn) -> None:
        self.conns.pop(conn.sock.fileno(), None)
        self._sel.unregister(conn.sock)
        conn.sock.close()

    def _send(self, conn: _Conn, pieces: list[bytes], *, close: bool = False) -> None:
        conn.closing = conn.closing or close
        try:
            sent = conn.sock.sendmsg(pieces)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn)
            return
        if sent < sum(map(len, pieces)):  # the client reads slower than it asks: the rest when it can
            conn.out = memoryview(b"".join(pieces))[sent:]
            self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
            return
        conn.since = self.clock()
        if conn.closing:
            self._close(conn)

    def _flush(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[sent:] if sent < len(conn.out) else None
        if conn.out is None:
            conn.since = self.clock()
            if conn.closing:
                self._close(conn)
                return
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
            self._serve_buffered(conn)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbuf += data  # (a part of a request is no activity: a trickle is swept as idle)
        self._serve_buffered(conn)

    def _serve_buffered(self, conn: _Conn) -> None:
        """Answer the whole requests `conn` has sent, one at a time: the next waits until the
        previous answer is sent (a client that does not read holds one reply, no more)."""
        buf = conn.inbuf
        while conn.out is None and not conn.closing and len(buf) >= frames.HEADER.size:
            (n,) = frames.HEADER.unpack_from(buf)
            if n > frames.MAX_FRAME:
                self._send(conn, error(0, frames.E_TOO_LARGE, f"frame of {n} bytes exceeds the limit of "
                                                              f"{frames.MAX_FRAME}"), close=True)
                return
            if len(buf) < frames.HEADER.size + n:
                return
            payload = bytes(buf[frames.HEADER.size:frames.HEADER.size + n])
            del buf[:frames.HEADER.size + n]
            conn.since = self.clock()
            pieces, close = self.respond(conn.peer, payload)
            self._send(conn, pieces, close=close)
            if conn.sock.fileno() not in self.conns:
                return

    def respond(self, peer: Peer, payload: bytes) -> tuple[list[bytes], bool]:
        """(the frame answering one request, in pieces; whether to close the connection after it): the
        daemon's answers and refusals (gpud.api.server), or `elsewhere` for what only it answers."""
        try:
            msg = msgpack.unpackb(payload)
        except (ValueError, TypeError) as e:
            return error(0, frames.E_BAD_FRAME, f"malformed request: {e}"), True
        if not isinstance(msg, dict) or not isinstance(msg.get("id"), int) or not isinstance(msg.get("op"), str):
            return error(0, frames.E_BAD_FRAME, "malformed request: not a map with an integer id and an op"), True
        rid, op, args = msg["id"], msg["op"], msg.get("args") or {}
        snap = self.snapshot
        silent = self.clock() - self.heard
        if snap is None or silent > self.stale_after:
            why = "no snapshot yet" if snap is None else f"gpud has not updated it for {silent:.1f} s"
            return error(rid, frames.E_ELSEWHERE, f"the status replica cannot answer ({why}): ask gpud"), False
        if not authorize(peer, "status", snap.gpud_gid, snap.lease_gid):  # a read op: root or either group
            return error(rid, frames.E_FORBIDDEN, "status needs root or membership of the gpud group"), True
        if op != "status" or args not in ({}, {"fresh": False}):
            return error(rid, frames.E_ELSEWHERE, "the status replica answers `status` only: ask gpud"), False
        pieces = snap.answer(rid, self.clock())
        if int.from_bytes(pieces[0], "big") > frames.MAX_FRAME:
            return error(rid, frames.E_ELSEWHERE, "the status is larger than a frame: ask gpud"), False
        self.answered += 1
        return pieces, False

    def _sweep(self, now: float) -> None:
        for conn in [c for c in self.conns.values() if now - c.since > IDLE_TIMEOUT]:
            self._close(conn)

    # -- the loop -------------------------------------------------------------------------------
    def serve(self) -> None:
        """Until the daemon closes the feed."""
        last_sweep = self.clock()
        while True:
            events = self._sel.select(timeout=TICK)
            # The daemon's frames first: a request that came after a change the daemon told anyone
            # of came after the frame that carries it (gpud.api.status_feed writes that first).
            if not self.read_feed():
                return
            for key, mask in events:
                if key.data == "listen":
                    self._accept()
                elif key.data == "feed":
                    continue
                elif (conn := self.conns.get(key.fd)) is key.data and conn is not None:  # not closed this round
                    if mask & selectors.EVENT_WRITE:
                        self._flush(conn)
                    else:
                        self._readable(conn)
            self._report()
            now = self.clock()
            if now - last_sweep > 1.0:
                self._sweep(now)
                last_sweep = now


def main(argv: list[str]) -> int:
    # A terminal's Ctrl-C or hang-up is the daemon's to act on: the replica ends when the daemon
    # closes its feed (or dies), so it never outlives it nor leaves before it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    listen_fd, feed_fd, stale_after = int(argv[0]), int(argv[1]), float(argv[2])
    listener = socket.socket(fileno=listen_fd)
    feed = socket.socket(fileno=feed_fd)
    Replica(listener, feed, stale_after=stale_after).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
