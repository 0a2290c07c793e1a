"""The daemon's answers to socket requests: each op maps onto the engine's view or one of its
commands (gpud.engine.engine), so `gpudctl` never sees anything the engine does not itself act on.

The engine refuses with its own errors (`gpud.engine.queries.EngineError`); this module is where
each becomes a wire error code, and every reply is a `gpud.wire.replies` struct built by `replies`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections import Counter
from collections.abc import Awaitable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from gpud import VERSION
from gpud.api import plan_replies, replies
from gpud.api.fair_share import FairShare, cost_error
from gpud.api.peers import Peer
from gpud.api.server import ApiError
from gpud.api.status_snapshot import StatusSnapshot
from gpud.engine.binding import passthrough
from gpud.engine.engine import Engine
from gpud.engine.events import EventQueue
from gpud.engine.kube.node_labels_out import LabelsOut
from gpud.engine.leases.engine import LeaseRefused
from gpud.engine.leases.records import LeaseRecord
from gpud.engine.observe.discovery import Observation
from gpud.engine.queries import EngineError, InvalidLayout, NoSuchGpu, select_gpus
from gpud.engine.view import EngineView
from gpud.host.nvidia.nvml import NvmlError
from gpud.layout.parse import ParsedLayout
from gpud.layout.resolve import Resolution
from gpud.loop_lag import LoopLagProbe
from gpud.model import Gpu
from gpud.wire import protocol as wire
from gpud.wire import replies as wire_replies
from gpud.wire import tables as wire_tables

if TYPE_CHECKING:  # their modules load the Kubernetes client and gRPC: only with --kube-node / --dra
    from gpud.api.status_feed import StatusFeed
    from gpud.engine.dra.service import DraService
    from gpud.engine.kube.agent import KubeAgent

# Engine refusals -> wire error codes (anything else unexpected is the server's "internal").
# The lease engine's refusals -> wire error codes.
_LEASE_CODES = {"no-room": wire.E_NO_ROOM, "not-found": wire.E_NOT_FOUND, "busy": wire.E_IN_USE,
                "conflict": wire.E_CONFLICT, "failed": wire.E_FAILED, "bad-args": wire.E_BAD_ARGS,
                "forbidden": wire.E_FORBIDDEN}

_CODES: dict[type[EngineError], str] = {
    InvalidLayout: wire.E_INVALID_LAYOUT,
    NoSuchGpu: "not-found",
}


class Notifier(Protocol):
    """systemd's sd_notify: RELOADING=1 ... READY=1 around a reload."""

    def reloading(self) -> object: ...

    def ready(self) -> object: ...


class RequestHandler:
    """`gpud.api.server.Handler` for one engine. `dev_root`: where /dev/vfio/<group> is looked for."""

    def __init__(self, engine: Engine, notifier: Notifier | None = None, *, dev_root: str = "/dev",
                 loop_lag: LoopLagProbe | None = None, labels: LabelsOut | None = None,
                 kube_agent: KubeAgent | None = None, dra: DraService | None = None) -> None:
        self.engine = engine
        self.notifier = notifier
        self.dev_root = dev_root
        self.status_snapshot = StatusSnapshot()
        self.loop_lag = loop_lag or LoopLagProbe()  # the daemon runs it; a bare one reports no samples
        self.requests: Counter[str] = Counter()  # per op, in the stats window
        self._reads_at_reset = 0
        self.labels = labels  # the node labels written after each pass (None: not computed)
        self.kube_agent = kube_agent  # with --kube-node
        self.dra = dra  # with --dra
        # layout texts sent by clients are evaluated in per-user turns (gpud.api.fair_share)
        self.fair = FairShare()
        self._peer: contextvars.ContextVar[Peer | None] = contextvars.ContextVar("peer", default=None)
        self.feed: StatusFeed | None = None  # the status replica's (the daemon sets it)

    def before_send(self) -> None:
        """The server is about to send a reply or an event: the status replica first gets any
        change in it, so a client that saw this and then asks the replica finds it there."""
        if self.feed is not None:
            self.feed.push()

    def status_feed(self, path: str, gpud_gid: int | None, like: str | None = None) -> StatusFeed:
        """The status replica's feed from this handler's snapshot, counted as its status answers;
        `like`: the daemon's socket, whose mode and group the replica's takes."""
        from gpud.api.status_feed import StatusFeed

        def counted(n: int) -> None:
            self.requests["status"] += n

        self.feed = StatusFeed(self.engine, self.status_snapshot, self.kubernetes, self.lease_group, counted,
                               path=path, gpud_gid=gpud_gid, like=like)
        return self.feed

    async def handle(self, op: str, args: dict[str, Any], peer: Peer) -> Any:
        answer = getattr(self, "op_" + op.replace("-", "_"), None)
        if answer is None:
            raise ApiError(wire.E_UNKNOWN_OP, f"unknown request {op!r}")
        self.requests[op] += 1
        self._peer.set(peer)  # this request's task only: its evaluations take this uid's turns
        with _engine_errors():
            return await answer(**(args or {}))

    def recent_events(self) -> list[dict[str, Any]]:
        return self.engine.events.recent()

    def subscribe(self) -> EventQueue:
        return self.engine.events.subscribe()

    def unsubscribe(self, queue: EventQueue) -> None:
        self.engine.events.unsubscribe(queue)

    async def encoded(self, op: str, args: dict[str, Any], peer: Peer) -> msgspec.Raw | None:
        """The reply of `op` already encoded where one is kept (status: its snapshot's bytes, the
        same for fifty clients but for the answer's age), else None: `handle` answers it."""
        if op != "status":
            return None
        self.requests[op] += 1
        with _engine_errors():
            view, stamp = await self._status_of(bool(args.get("fresh")))
        return self.status_snapshot.encoded(view, **stamp)

    async def op_status(self, fresh: bool = False) -> wire_replies.StatusReply:
        view, stamp = await self._status_of(fresh)
        return self.status_snapshot.reply(view, **stamp)

    async def _status_of(self, fresh: bool) -> tuple[EngineView, dict[str, Any]]:
        """The view a status answers from and what is stamped on it: from the observation in
        memory, at once, with its age; `fresh`: from one read after the request arrived. Asking
        also keeps the observation from growing older than the observer's bound (holders change
        without any event)."""
        view = await self.engine.read_for_status(fresh)
        return view, {"observed_at": self.engine.observed_at, "age": self.engine.observation_age(),
                      "kubernetes": self.kubernetes(view.observation.gpus)}

    def kubernetes(self, gpus: tuple[Gpu, ...]) -> wire_replies.KubernetesStatus:
        """The Kubernetes part of a status answered now."""
        strategy = self.labels.mig_strategy if self.labels is not None else "mixed"
        agent = self.kube_agent.status if self.kube_agent is not None else None
        dra = self.dra.status() if self.dra is not None else None
        return replies.kubernetes_status(gpus, mig_strategy=strategy, agent=agent, dra=dra,
                                         ad=self.status_snapshot.advertised(gpus, strategy))

    async def op_labels(self) -> wire_replies.LabelsReply:
        if self.labels is None:
            return wire_replies.LabelsReply()
        return await asyncio.to_thread(replies.labels_reply, self.labels)  # reads the feature file

    async def op_version(self) -> wire_replies.VersionReply:
        driver: str | None
        nvml: str | None
        try:
            driver, nvml = self.engine.versions.driver(), self.engine.versions.nvml()
        except NvmlError:  # no driver, or closed during a rebind
            driver = nvml = None
        return wire_replies.VersionReply(version=VERSION, driver=driver, nvml=nvml, protocol=wire.PROTOCOL,
                                         config=self.engine.view.config_path)

    async def op_check(self, text: str, path: str | None = None, all_layouts: bool = False) -> wire_replies.CheckReply:
        """Valid means applicable: a file that parses and resolves is also planned against this
        host, and a GPU the planner cannot converge (`7 x 1g.10gb` on an A100 40GB) is an error
        in the same words `plan` uses. `all_layouts`: every entry of `layouts` is checked so, as a
        node label may select any of them. Nothing is changed."""
        path = path or "layout.yaml"
        parsed, res, _ = await self._evaluate(text, path)
        others: list[tuple[str, Resolution]] = []
        layout = parsed.layout or parsed.draft
        if all_layouts and layout is not None:
            too_costly = cost_error(len(text.encode("utf-8", "surrogatepass")), len(layout.layouts))
            if too_costly is not None:
                raise ApiError(wire.E_BAD_ARGS, f"check --all-layouts: {too_costly}")
            names = [name for name in layout.layouts if name != res.selected]
            peer = self._peer.get()
            async with self.fair.turn(peer.uid if peer is not None else 0):
                others = await self.engine.evaluate_each(text, path, names)
            named_wrong = any(e.path == "selected" and not e.message.startswith("missing") for e in res.errors)
            if res.selected is None and others and not named_wrong:
                # no `selected` (a mig-parted file): every layout is checked as chosen, none is missing
                (_, res), others = others[0], others[1:]
        return replies.check_reply(res, others=others)

    async def _evaluate(self, text: str, path: str, *, select: str | None = None,
                        ) -> tuple[ParsedLayout, Resolution, Observation]:
        """One evaluation of a sent text, in the sender's turn (uid 0 without a peer: in-process)."""
        peer = self._peer.get()
        async with self.fair.turn(peer.uid if peer is not None else 0):
            return await self.engine.evaluate(text, path, select=select)

    async def op_plan(self, text: str | None = None, path: str | None = None) -> wire_replies.PlanReply:
        if text is None:  # the file in force, against the host as it is now
            view = await self.engine.refresh()
            observation, resolution, errors = view.observation, view.resolution, list(view.layout_errors)
        else:
            _, resolution, observation = await self._evaluate(text, path or "layout.yaml")
            errors = []
        if resolution is not None:
            known = set(errors)
            errors += [s for s in map(str, resolution.errors) if s not in known]
        if errors or resolution is None:
            return plan_replies.plan_reply(errors=errors or ["no valid layout in force"])
        return plan_replies.plan_reply(resolution, self.engine.preview(resolution, observation))

    async def op_apply(self, wait: bool = False, timeout: float | None = None) -> wire_replies.ApplyReply:
        ticket = await self.engine.start_apply()
        if not wait:
            return wire_replies.ApplyReply(phase="applying", converged=False, message="apply started", gpus=[])
        finished = await self.engine.wait(ticket, timeout)
        return replies.apply_reply(self.engine.view, finished)

    async def op_reload(self) -> wire_replies.LayoutStatus:
        """Re-read the file and answer at once; the apply it starts runs on. systemd's ExecReload
        waits for this, and units ordered after gpud (kubelet, dcgm) would deadlock with a reload
        that waited for an apply draining them."""
        if self.notifier is not None:
            self.notifier.reloading()
        try:
            await self.engine.reload("reload")
        finally:
            if self.notifier is not None:
                self.notifier.ready()
        return replies.layout_status(self.engine.view)

    async def op_select(self, name: str | None = None) -> wire_replies.LayoutStatus:
        """Put layout `name` of the file in force over its `selected`, kept across restarts
        (mig-parted's `apply -c NAME`); the pass it needs runs on its own (`apply` starts it).
        With --kube-node the node label chooses, so this is refused."""
        if self.engine.view.label_selects:
            raise ApiError(wire.E_FORBIDDEN, "with --kube-node the node label nvidia.com/mig.config chooses the "
                                             "layout; gpudctl select is not taken")
        if not await self.engine.select_layout(name):
            errors = list(self.engine.view.layout_errors)
            await self.engine.load()  # the issues of the layout still in force again
            raise InvalidLayout("; ".join(errors[:10]) or f"layout {name!r} was refused")
        self.engine.kick(f"layout {name!r} selected" if name else "the file's own layout selected")
        return replies.layout_status(self.engine.view)

    # ---- leases (gpud.engine.leases): MIG on demand on the dynamic GPUs ------------------------
    def lease_group(self) -> str | None:
        """The group whose members may lease (the layout in force's policy.lease-group)."""
        policy = self.engine.policy
        return policy.lease_group if policy is not None else None

    async def op_lease(self, profile: str, gpu: str | None = None, owner: str = "", pid: int | None = None,
                       start: int | None = None) -> wire_replies.LeaseInfo:
        peer = self._peer.get()
        rec = await self._leasing(self.engine.leases.lease(profile, gpu=gpu, owner=owner, pid=pid, start=start,
                                                           uid=peer.uid if peer is not None else 0))
        index = {g.pci: g.index for g in self.engine.view.observation.gpus}
        return replies.lease_info(rec, index.get(rec.gpu))

    async def op_release(self, id: str, wait: bool = True) -> wire_replies.ReleaseReply:
        peer = self._peer.get()
        rec = await self._leasing(self.engine.leases.release(id, uid=peer.uid if peer is not None else 0, wait=wait))
        return wire_replies.ReleaseReply(lease=replies.lease_info(rec), message=f"lease {id} released")

    async def op_leases(self) -> wire_replies.LeasesReply:
        return replies.leases_reply(self.engine.view)

    @staticmethod
    async def _leasing(call: Awaitable[LeaseRecord]) -> LeaseRecord:
        try:
            return await call
        except LeaseRefused as e:
            raise ApiError(_LEASE_CODES.get(e.code, wire.E_FAILED), str(e)) from e

    async def op_mig_profiles(self, gpu: str | None = None) -> wire_tables.MigProfilesReply:
        view = await self.engine.refresh()
        return replies.mig_profiles_reply(select_gpus(view.observation.gpus, gpu))

    async def op_mig_compute_profiles(self, gpu: str | None = None) -> wire_tables.MigComputeProfilesReply:
        view = await self.engine.refresh()
        return replies.mig_compute_profiles_reply(select_gpus(view.observation.gpus, gpu))

    async def op_passthrough(self) -> wire_tables.PassthroughReply:
        gpus = (await self.engine.refresh()).observation.gpus
        return replies.passthrough_reply(passthrough.entries(gpus, dev_root=self.dev_root), gpus)

    async def op_vgpu_types(self, gpu: str | None = None) -> wire_tables.VgpuTypesReply:
        """The vGPU types each GPU offers, with how many are still creatable: read fresh, as the
        counts move with every vGPU created anywhere on the GPU."""
        view = await self.engine.refresh()
        return replies.vgpu_types_reply(select_gpus(view.observation.gpus, gpu))

    async def op_stats(self, reset: bool = False) -> wire_replies.StatsReply:
        """The daemon's own health since start or the last reset (for benchmarks and operators)."""
        samples, p50, p99, worst = self.loop_lag.summary()
        rss, peak = _memory()
        reply = wire_replies.StatsReply(
            window_s=round(time.monotonic() - self.loop_lag.window_start, 3),
            loop_lag=wire_replies.LoopLag(samples=samples, p50_ms=round(p50, 3), p99_ms=round(p99, 3), max_ms=round(worst, 3)),
            requests=dict(self.requests), observations=self.engine.observations - self._reads_at_reset,
            rss_bytes=rss, peak_rss_bytes=peak,
        )
        if reset:
            self.loop_lag.reset()
            self.requests.clear()
            self._reads_at_reset = self.engine.observations
        return reply


def _memory() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes, from /proc/self/status (0 where unreadable)."""
    values = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in values:
                    values[key] = int(rest.split()[0]) * 1024  # "  35812 kB"
    except (OSError, ValueError, IndexError):
        pass
    return values["VmRSS"], values["VmHWM"]


@contextlib.contextmanager
def _engine_errors() -> Iterator[None]:
    """An engine's refusal as the API error a client reads (its code by the refusal's kind)."""
    try:
        yield
    except EngineError as e:
        raise ApiError(_CODES.get(type(e), wire.E_INTERNAL), str(e)) from e
