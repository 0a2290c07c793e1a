"""The daemon's side of the status replica (gpud/api/status_replica.py): start it, feed it each
change, count its answers, and start it again when it dies.

The replica's socket is made here with the daemon's own (gpud.api.socket_file: 0660 root:gpud,
bound under a 0600 umask) and handed to the child, which is then its only holder: when the child
dies nothing listens there, a client's connect is refused at once and gpudctl asks the daemon
(gpud.cli.transport). The daemon never waits for the child: frames go out with non-blocking
sends into a socket buffer sized for many snapshots, and a child that stops reading them is killed
(a frame half-written would leave its stream unreadable) and started again later.

The replica runs NICER steps ahead of the daemon in the CPU scheduler's eyes.

When a frame goes out: `push()` is called before the daemon sends any reply or event (the API
server's `before_send`), soon after each change the engine reports, and every CHECK seconds from
the loop, for what changes without the engine: the Kubernetes part (the label protocol's state,
the DRA driver's claims and slices, which follow the cluster) and the groups. A frame is written
only when something in it changed, and a beat at least every BEAT seconds tells the replica the
loop is alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

import gpud
from gpud.api.peers import group_id
from gpud.api.socket_file import ServerError, bind_socket, unlink_own
from gpud.api.status_snapshot import StatusSnapshot
from gpud.engine.engine import Engine
from gpud.wire import frames

log = logging.getLogger("gpud.api")

STALE_AFTER = 5.0  # seconds without a frame after which the replica sends clients to the daemon
BEAT = 0.25  # seconds between two frames at most: the replica's sign that the daemon's loop runs
# Seconds the replica may leave the daemon's frames unanswered (it says "heard" within a round of
# reading them, a few times a second at most): longer, it is stopped or stuck, and killed. Before
# its first word START_LIMIT holds: an interpreter starting on a loaded machine.
HEARD_LIMIT = 1.0
START_LIMIT = 60.0
# Seconds between two looks at what changes without the engine telling: the Kubernetes part of a
# status follows the cluster (a label the agent wrote, a claim the kubelet asked for), and is in
# the replica this long after it changed at most. A look costs tens of microseconds (the view and
# snapshot are kept; the Kubernetes part is built and encoded).
CHECK = 0.02
_GROUP_AGE = 5.0  # seconds a looked-up gid is kept: a lookup may ask NSS (LDAP...) at every look otherwise
# The replica's priority over the daemon's (nice steps): its work is a few tens of microseconds per
# answer, asked for by people and scripts waiting on it, where the daemon's is an apply's reading
# and planning, which can wait that long. On a host whose CPUs are all taken during an apply
# (2 here) this took the tail of its answers from 2.0-2.5 ms to 1.3-1.8 (bench/results/scale.md).
NICER = -5
_SNDBUF = 8 << 20  # the feed's send buffer: 100 snapshots of 64 GPUs with 7 MIG devices each
_RESTART = (1.0, 2.0, 5.0, 10.0, 30.0)  # seconds before each start again after a death, the last repeated
_encode = msgspec.msgpack.Encoder().encode


class StatusFeed:
    """`snapshot`: the daemon's status snapshot (the same bytes its own answers are made of);
    `kubernetes(gpus)`: the Kubernetes part of a status answered now; `lease_group()`: the group
    the layout lets lease (its members may read status too); `counted(n)`: n answers the replica
    gave; `path`: the replica's socket (gpud.wire.frames.status_socket)."""

    def __init__(self, engine: Engine, snapshot: StatusSnapshot, kubernetes: Callable[[Any], Any],
                 lease_group: Callable[[], str | None], counted: Callable[[int], None], *, path: str,
                 gpud_gid: int | None, like: str | None = None, stale_after: float = STALE_AFTER,
                 start_limit: float = START_LIMIT) -> None:
        self.engine = engine
        self.snapshot = snapshot
        self.kubernetes = kubernetes  # gpus -> the KubernetesStatus of a status answered now
        self.lease_group = lease_group
        self.counted = counted  # answers the replica gave, for the stats op
        self.path = path
        self.gpud_gid = gpud_gid
        self.like = like  # the daemon's socket: the replica's takes its mode and group (systemd's .socket may set them)
        self.stale_after = stale_after
        self.start_limit = start_limit
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._feed: socket.socket | None = None
        self._owned: tuple[int, int] | None = None
        self._in = bytearray()
        self._sent: tuple[Any, ...] | None = None  # what the last snapshot frame carried
        self._started_at = 0.0
        self._wrote_at = 0.0  # time.monotonic() of the last frame
        self._unheard_since: float | None = None  # the first frame written since the replica's last word
        self._heard_any = False  # the replica has said anything since it was started
        self._gid: tuple[str | None, int | None, float] = (None, None, -_GROUP_AGE)  # name, gid, when
        self._soon = False
        self._closing = False

    # -- the child ------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the socket and start the replica on it; the first snapshot goes out at once."""
        listener, self._owned = bind_socket(self.path, self.gpud_gid)
        try:
            self._as_the_daemons()
        except OSError:
            listener.close()
            raise
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(OSError):  # root may exceed net.core.wmem_max; the default serves too
                ours.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_SNDBUFFORCE", 32), _SNDBUF)
            ours.setblocking(False)
            package_root = os.path.dirname(os.path.dirname(os.path.abspath(gpud.__file__)))
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpud.api.status_replica", str(listener.fileno()), str(theirs.fileno()),
                 f"{self.stale_after:g}"],
                pass_fds=(listener.fileno(), theirs.fileno()), stdin=subprocess.DEVNULL, env=env, close_fds=True)
        except BaseException:
            ours.close()
            raise
        finally:
            listener.close()  # the child's copy is the only one: it dies, nothing listens
            theirs.close()
        with contextlib.suppress(OSError):  # not root: it runs at the daemon's own priority
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, max(-20, os.getpriority(os.PRIO_PROCESS, 0) + NICER))
        self.starts += 1
        log.info("status replica started (pid %d) on %s", self.proc.pid, self.path)
        self.attach(ours)

    def _as_the_daemons(self) -> None:
        """The replica's socket no more open than the daemon's: a socket unit's SocketMode and
        SocketGroup (or the daemon's own 0660 root:gpud / 0600) hold for both."""
        try:
            st = os.stat(self.like) if self.like is not None else None
        except FileNotFoundError:  # an inherited socket elsewhere than --socket says: bind_socket's own
            st = None
        if st is None:
            return
        os.chown(self.path, -1, st.st_gid)
        os.chmod(self.path, st.st_mode & 0o770)

    def attach(self, feed: socket.socket) -> None:
        """Feed the replica at the other end of `feed` (non-blocking), starting with a snapshot."""
        self._feed = feed
        self._in.clear()
        self._sent = None
        self._unheard_since = None
        self._heard_any = False
        asyncio.get_running_loop().add_reader(feed.fileno(), self._readable)
        self.push()

    def _lost(self, why: str) -> None:
        """The child is gone or no longer usable: stop feeding it, make sure it is dead."""
        feed, self._feed = self._feed, None
        if feed is not None:
            asyncio.get_running_loop().remove_reader(feed.fileno())
            feed.close()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
        if not self._closing:
            log.warning("status replica (pid %s) %s; clients ask gpud itself until it is back",
                        proc.pid if proc else "?", why)

    async def run(self) -> None:
        """Start the replica, look for changes every CHECK seconds, and start it again after it
        dies (waiting longer after each death in a row that came soon after its start). Never
        ends on the replica's account: without it, clients ask the daemon."""
        failures = 0
        while True:
            if self._feed is None:
                if self.proc is not None:
                    await asyncio.to_thread(self.proc.wait)
                    started_long_ago = time.monotonic() - self._started_at > 60
                    failures = 0 if started_long_ago else failures + 1
                    await asyncio.sleep(_RESTART[min(failures, len(_RESTART)) - 1] if failures else _RESTART[0])
                try:
                    self._started_at = time.monotonic()
                    self.start()
                except (OSError, subprocess.SubprocessError, ServerError) as e:
                    log.warning("cannot start the status replica: %s; clients ask gpud itself", e)
                    self.proc = None
                    failures += 1
                    await asyncio.sleep(_RESTART[min(failures, len(_RESTART)) - 1])
                    continue
            await asyncio.sleep(CHECK)  # (a sleep: waiting on the death too cost a task per look)
            if self._feed is not None:
                self.push(beat=time.monotonic() - self._wrote_at >= BEAT)
            self.check_heard()

    def check_heard(self) -> None:
        """A replica that has not answered the daemon's frames for HEARD_LIMIT seconds (stopped,
        or stuck) is killed: until it is, each client waits for it before asking the daemon."""
        since = self._unheard_since
        if self._feed is None or since is None:
            return
        limit = HEARD_LIMIT if self._heard_any else self.start_limit
        if time.monotonic() - since > limit:
            self._lost(f"did not read the daemon's frames for {limit:g} s: killed")

    async def close(self) -> None:
        """Stop the replica and remove its socket (when still ours)."""
        self._closing = True
        proc = self.proc
        feed, self._feed = self._feed, None
        if feed is not None:
            asyncio.get_running_loop().remove_reader(feed.fileno())
            feed.close()  # the replica exits when its feed closes
        if proc is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), 5)
            except TimeoutError:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self._owned is not None:
            unlink_own(self.path, self._owned)
            self._owned = None

    # -- frames ---------------------------------------------------------------------------------
    def changed(self) -> None:
        """The engine's listener: a push soon, once however many changes come in one callback
        (a push in the middle of the engine's own update could carry half of it)."""
        if not self._soon and self._feed is not None:
            self._soon = True
            asyncio.get_running_loop().call_soon(self._push_soon)

    def _push_soon(self) -> None:
        self._soon = False
        self.push()

    def push(self, *, beat: bool = False) -> None:
        """Write a snapshot frame if anything in it changed since the last; else, with `beat`, a
        beat. Never raises: it runs before every reply the daemon sends, which must go out
        whatever happens to the replica (a frame that cannot be made stops the replica, and
        clients ask the daemon)."""
        if self._feed is None:
            return
        try:
            self._push(beat)
        except Exception:  # any failure here is the replica's, never the reply's
            log.exception("cannot make the status replica's frame")
            self._lost("could not be sent the daemon's state: stopped")

    def _push(self, beat: bool) -> None:
        view = self.engine.view
        encoded = self.snapshot.parts(view)
        kube = _encode(self.kubernetes(view.observation.gpus))
        observed_at = round(self.engine.observed_at, 3)
        started = self.engine.observation_started
        lease_gid = self._lease_gid()
        carried = (encoded, kube, observed_at, started, self.gpud_gid, lease_gid)
        sent = self._sent
        if sent is not None and sent[0] is encoded and sent[1:] == carried[1:]:
            if beat:
                self._write(_encode(["beat"]))
            return
        if self._write(_encode(["snapshot", encoded.parts, encoded.tail, observed_at, started, kube,
                                self.gpud_gid, lease_gid])):
            self._sent = carried

    def _lease_gid(self) -> int | None:
        name, gid, when = self._gid
        now = time.monotonic()
        current = self.lease_group()
        if current != name or now - when > _GROUP_AGE:
            gid = group_id(current)
            self._gid = (current, gid, now)
        return gid

    def _write(self, payload: bytes) -> bool:
        data = frames.frame(payload, max_frame=_SNDBUF // 2)
        feed = self._feed
        assert feed is not None
        try:
            sent = feed.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            self._lost(f"closed its feed ({e.strerror or e})")
            return False
        if sent < len(data):  # its buffer is full: the replica has stopped reading
            self._lost("stopped reading the daemon's snapshots: killed")
            return False
        self._wrote_at = time.monotonic()
        if self._unheard_since is None:
            self._unheard_since = self._wrote_at
        return True

    def _readable(self) -> None:
        feed = self._feed
        assert feed is not None
        try:
            data = feed.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._lost("exited")
            return
        self._in += data
        for payload in frames.whole_frames(self._in):
            try:
                msg = msgspec.msgpack.decode(payload)
            except msgspec.DecodeError:
                self._lost("wrote a malformed frame: killed")
                return
            if not (isinstance(msg, list) and msg[:1] == ["heard"] and len(msg) == 2 and isinstance(msg[1], int)):
                self._lost("wrote a frame it has no business writing: killed")
                return
            self._unheard_since = None
            self._heard_any = True
            if msg[1]:
                self.counted(msg[1])
                self.engine.looked()
