"""The engine's boundary: one view out, a few typed commands in.

Everything outside gpud/engine/ (the socket API, the daemon's status, metrics and label writers,
the kube agent's applier) holds an Engine, never the Reconciler: it reads `view` (a frozen
EngineView, gpud.engine.view) and sends commands. The Reconciler keeps its records and helpers to
itself, so a change inside the engine cannot break a caller that read one of them, and a caller
cannot change the engine's state except by a command (tests/test_layering.py holds this).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpud.engine import queries
from gpud.engine.events import EventBus
from gpud.engine.observe.discovery import Observation
from gpud.engine.preview import GpuPreview, preview
from gpud.engine.view import EngineView
from gpud.layout.parse import ParsedLayout
from gpud.layout.resolve import Resolution

if TYPE_CHECKING:
    from gpud.engine.leases.engine import LeaseEngine
    from gpud.engine.ports import Hardware
    from gpud.engine.reconciler import Reconciler
    from gpud.layout.schema import Policy


def build_engine(hardware: Hardware, **settings: Any) -> Engine:
    """The engine over `hardware`, its collaborators given once (gpud.engine.reconciler.Reconciler's
    keyword arguments); callers keep only the Engine."""
    from gpud.engine.reconciler import Reconciler

    return Engine(Reconciler(hardware, **settings))


class Versions:
    """The driver's own version strings (NVML), asked when an output needs them."""

    def __init__(self, rec: Reconciler) -> None:
        self._nvml = rec.hw.nvml

    def driver(self) -> str:
        return self._nvml.driver_version()

    def nvml(self) -> str:
        return self._nvml.nvml_version()

    def cuda(self) -> int:
        return self._nvml.cuda_driver_version()


class Engine:
    """Commands return when the engine took them; `view` is the state they led to."""

    def __init__(self, rec: Reconciler) -> None:
        self._rec = rec
        self.events: EventBus = rec.bus
        self.versions = Versions(rec)

    # ---- out -------------------------------------------------------------------------------
    @property
    def view(self) -> EngineView:
        """The engine's state now (the same object while nothing changed)."""
        return self._rec.view()

    @property
    def policy(self) -> Policy | None:
        """The layout in force's policy (what `view.policy` says, without building a view: every
        API request asks it, for the lease group)."""
        parsed = self._rec.layout
        return parsed.layout.policy if parsed is not None and parsed.layout is not None else None

    def subscribe(self, callback: Callable[[], None]) -> None:
        """`callback()` after every change the engine makes or hears of; it reads `view`."""
        self._rec.on_change(callback)

    @property
    def observed_at(self) -> float:
        """time.time() of the observation in the view."""
        return self._rec.observer.wall_time

    def observation_age(self) -> float:
        """Seconds since the observation in the view was read."""
        return self._rec.observer.age()

    @property
    def observation_started(self) -> float:
        """time.monotonic() when the observation in the view began to be read (0: none yet)."""
        return self._rec.observer.started

    @property
    def observations(self) -> int:
        """Host reads taken since start."""
        return self._rec.observer.reads

    @property
    def after_boot(self) -> bool:
        """This is the first start of gpud since the host booted (gpud.engine.boot.rebuild)."""
        return self._rec.boot_rebuild.after_boot

    # ---- life cycle ------------------------------------------------------------------------
    async def run(self, debounce: float = 0.2) -> None:
        """The one task that runs passes (until cancelled); requests within `debounce` s share one."""
        await self._rec.run(debounce)

    async def finish(self, timeout: float) -> bool:
        """At a stop: wait for a hardware step in flight; False when one still runs (NVML stays open for it)."""
        return await self._rec.steps.finish(timeout=timeout)

    # ---- MIG on demand ---------------------------------------------------------------------
    @property
    def leases(self) -> LeaseEngine:
        """The lease room's commands (gpud.engine.leases.engine): lease, release, list."""
        return self._rec.leases

    async def start_leases(self) -> None:
        """At start, before anyone can ask: lease records against NVML (gpud.engine.leases.startup)."""
        await self._rec.leases.start()

    # ---- in: the pass ----------------------------------------------------------------------
    def kick(self, reason: str) -> int:
        """Ask for a pass; the ticket `wait` takes."""
        return self._rec.kick(reason)

    async def wait(self, ticket: int, timeout: float | None = None) -> bool:
        """True once the pass that serves `ticket` ended; False on timeout."""
        return await self._rec.wait_for(ticket, timeout)

    async def start_apply(self) -> int:
        """Re-read the file and ask for a pass (queries.InvalidLayout when the file is bad)."""
        return await queries.start_apply(self._rec)

    def changes_at_start(self) -> list[str]:
        """GPUs the first pass will change (READY=1 waits for it: gpud.engine.queries)."""
        return queries.changes_at_start(self._rec)

    def vgpus_missing(self) -> list[str]:
        """vm-vgpu GPUs of the layout in force with fewer vGPUs than it asks for."""
        return queries.vgpus_missing(self._rec)

    # ---- in: the file ----------------------------------------------------------------------
    async def load(self) -> bool:
        """Read the file (the host read off the loop); False when it was refused."""
        return await self._rec.load_config_async()

    async def reload(self, reason: str) -> bool:
        """Read the file again; a valid one starts a pass. False when it was refused."""
        return await self._rec.reload_async(reason)

    async def choose_layout(self, name: str | None) -> bool:
        """Put layout `name` of the file in force instead of its `selected` (None: the file's own)."""
        return await self._rec.choose_layout_async(name)

    async def select_layout(self, name: str | None) -> bool:
        """`gpudctl select`: layout `name` in force, kept across restarts; False when refused (the
        errors in the view's layout_errors until the next load)."""
        return await self._rec.select_layout_async(name)

    async def evaluate_each(self, text: str, path: str, names: list[str]) -> list[tuple[str, Resolution]]:
        """Layouts `names` of one text, each resolved as if selected (one parse, one host read)."""
        return await self._rec.evaluate_each_async(text, path, names)

    def mark_pending(self) -> None:
        """The GPUs a just-taken layout will change show `pending` until its pass starts."""
        self._rec.mark_pending()

    async def evaluate(self, text: str, path: str, *, select: str | None = None,
                       ) -> tuple[ParsedLayout, Resolution, Observation]:
        """A layout text parsed and resolved against this host as its own `match:` sees it; changes nothing."""
        return await self._rec.evaluate_async(text, path, select=select)

    def preview(self, resolution: Resolution, observation: Observation) -> list[GpuPreview]:
        """What a pass would do now for `resolution` (gpudctl plan); changes nothing."""
        return preview(self._rec, resolution, observation)

    # ---- in: the host ----------------------------------------------------------------------
    async def refresh(self) -> EngineView:
        """Re-read the host (off the loop, shared with whoever else waits for a read)."""
        await self._rec.refresh_async()
        return self.view

    async def read_for_status(self, fresh: bool) -> EngineView:
        """`fresh`: the view after one host read that started after this call; else the view in
        memory at once, the observer told it was asked for (it re-reads when older than its bound:
        holders change without any event)."""
        if fresh:
            await self._rec.observer.fresh(time.monotonic())
        else:
            self.looked()
        return self.view

    def looked(self) -> None:
        """A client read the status (here or from the status replica): the observer re-reads in
        the background when its observation is older than its bound."""
        self._rec.observer.poke()

    def refresh_now(self) -> EngineView:
        """Re-read the host on the calling thread (start-up, before anything is served)."""
        self._rec.refresh()
        return self.view
