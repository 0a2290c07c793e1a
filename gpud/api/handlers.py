"""The daemon's answers to socket requests: each op maps onto the reconciler's state or its one
apply path, so `gpudctl` never sees anything the engine does not itself act on.

The engine refuses with its own errors (`gpud.engine.queries.EngineError`); this module is where
each becomes a wire error code, and every reply is a `gpud.api.wire` struct built by `replies`.
"""

from __future__ import annotations

from typing import Any, Protocol

from gpud import VERSION
from gpud.api import replies, wire
from gpud.api.peers import Peer
from gpud.api.server import ApiError
from gpud.engine import passthrough
from gpud.engine.events import EventQueue
from gpud.engine.queries import EngineError, InvalidLayout, NoSuchGpu, select_gpus, start_apply
from gpud.engine.reconciler import Reconciler
from gpud.host.nvml import NvmlError

# Engine refusals -> wire error codes (anything else unexpected is the server's "internal").
_CODES: dict[type[EngineError], str] = {
    InvalidLayout: wire.E_INVALID_LAYOUT,
    NoSuchGpu: "not-found",
}


class Notifier(Protocol):
    """systemd's sd_notify: RELOADING=1 ... READY=1 around a reload."""

    def reloading(self) -> None: ...

    def ready(self) -> None: ...


class RequestHandler:
    """`gpud.api.server.Handler` for one reconciler. `dev_root`: where /dev/vfio/<group> is looked for."""

    def __init__(self, rec: Reconciler, notifier: Notifier | None = None, *, dev_root: str = "/dev") -> None:
        self.rec = rec
        self.notifier = notifier
        self.dev_root = dev_root

    async def handle(self, op: str, args: dict[str, Any], peer: Peer) -> Any:
        answer = getattr(self, "op_" + op.replace("-", "_"), None)
        if answer is None:
            raise ApiError(wire.E_UNKNOWN_OP, f"unknown request {op!r}")
        try:
            return await answer(**(args or {}))
        except EngineError as e:
            raise ApiError(_CODES.get(type(e), wire.E_INTERNAL), str(e)) from e

    def recent_events(self) -> list[dict[str, Any]]:
        return self.rec.bus.recent()

    def subscribe(self) -> EventQueue:
        return self.rec.bus.subscribe()

    def unsubscribe(self, queue: EventQueue) -> None:
        self.rec.bus.unsubscribe(queue)

    async def op_status(self) -> wire.StatusReply:
        self.rec.refresh()
        return replies.status_reply(self.rec)

    async def op_version(self) -> wire.VersionReply:
        try:
            driver, nvml = self.rec.hw.nvml.driver_version(), self.rec.hw.nvml.nvml_version()
        except NvmlError:  # no driver, or closed during a rebind
            driver = nvml = None
        return wire.VersionReply(version=VERSION, driver=driver, nvml=nvml, protocol=wire.PROTOCOL)

    async def op_check(self, text: str, path: str | None = None) -> wire.CheckReply:
        _, res, _ = self.rec.evaluate(text, path or "layout.yaml")
        return wire.CheckReply(valid=not res.errors, errors=[str(e) for e in res.errors],
                               warnings=[str(w) for w in res.warnings], selected=res.selected)

    async def op_plan(self, text: str | None = None, path: str | None = None) -> wire.PlanReply:
        if text is None:  # the file in force, against the host as it is now
            observation = self.rec.refresh()
            resolution, errors = self.rec.resolution, list(self.rec.layout_issues[0])
        else:
            _, resolution, observation = self.rec.evaluate(text, path or "layout.yaml")
            errors = []
        if resolution is not None:
            errors += [str(e) for e in resolution.errors if str(e) not in errors]
        if errors or resolution is None:
            return replies.plan_reply(self.rec, errors=errors or ["no valid layout in force"])
        return replies.plan_reply(self.rec, resolution, observation)

    async def op_apply(self, wait: bool = False, timeout: float | None = None) -> wire.ApplyReply:
        ticket = start_apply(self.rec)
        if not wait:
            return wire.ApplyReply(phase="applying", converged=False, message="apply started", gpus=[])
        finished = await self.rec.wait_for(ticket, timeout)
        return replies.apply_reply(self.rec, finished)

    async def op_reload(self) -> wire.LayoutStatus:
        """Re-read the file and answer at once; the apply it starts runs on. systemd's ExecReload
        waits for this, and units ordered after gpud (kubelet, dcgm) would deadlock with a reload
        that waited for an apply draining them."""
        if self.notifier is not None:
            self.notifier.reloading()
        try:
            self.rec.reload("reload")
        finally:
            if self.notifier is not None:
                self.notifier.ready()
        return replies.layout_status(self.rec)

    async def op_mig_profiles(self, gpu: str | None = None) -> wire.MigProfilesReply:
        self.rec.refresh()
        return replies.mig_profiles_reply(select_gpus(self.rec.observation.gpus, gpu))

    async def op_passthrough(self) -> wire.PassthroughReply:
        self.rec.refresh()
        return replies.passthrough_reply(passthrough.entries(self.rec.observation.gpus, dev_root=self.dev_root),
                                         self.rec.observation.gpus)

    async def op_vgpu_types(self, gpu: str | None = None) -> wire.VgpuTypesReply:
        self.rec.refresh()
        return replies.vgpu_types_reply(select_gpus(self.rec.observation.gpus, gpu))
