"""The reconcile loop: observe -> resolve -> plan -> execute per GPU -> re-observe, one pass at a time.

Each GPU converges on its own: one GPU's failure or wait never stops the others. A pass is
re-entrant: it recomputes what is left from what the hardware says now, so a wait that ends, an
event from udev, a daemon restart or an edit of the file all lead to the same place. Nothing is
ever killed: busy GPUs wait (or fail, by policy) and name their holders.

One concern, the pass itself: which GPUs change, running them, and what the pass concludes.
Everything else is handed to a module that holds it: the file (layout_keeper), when passes run
(scheduler), reading the host (observe.observer, observe.host_read), a change of the GPU set
(observe.gpu_set), what a GPU needs next (next_action), each GPU's rounds (gpu_rounds), running a
step on the hardware (steps), the operands and hook phases around the GPUs that change (pass_apply,
hooks.phases), pending and drift between passes (between_passes), the host-wide lock (apply_lock),
policy.reboot (boot.reboot_policy), waking on a holder's exit (observe.holder_watch), the published
view (view).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import MappingProxyType
from typing import Any

from gpud.engine import between_passes, layout_choice
from gpud.engine.action_inputs import DriverList, PlanMemo
from gpud.engine.apply_lock import ApplyLock, ApplyLockRefused
from gpud.engine.boot.reboot_policy import RebootPolicy
from gpud.engine.boot.rebuild import BootRebuild, boot_id
from gpud.engine.events import EventBus
from gpud.engine.feasibility import judged
from gpud.engine.gpu_rounds import GpuRounds
from gpud.engine.gpu_state import Action, GpuState, GpuStates, Phase, concluded_phase, phase_now
from gpud.engine.gpu_tasks import for_each_gpu
from gpud.engine.layout_keeper import LayoutKeeper
from gpud.engine.leases.engine import LeaseEngine
from gpud.engine.next_action import next_action
from gpud.engine.observe.discovery import Observation
from gpud.engine.observe.gpu_index import GpuIndex, index_path
from gpud.engine.observe.gpu_set import GpuSetNotes, gone_message
from gpud.engine.observe.holder_watch import HolderWatch
from gpud.engine.observe.host_read import HostReader
from gpud.engine.observe.observer import DEFAULT_MAX_AGE, Observer
from gpud.engine.pass_apply import PassApply
from gpud.engine.ports import BootOverrides, Drainer, Hardware, OperandGuard, Rebooter
from gpud.engine.scheduler import PassScheduler
from gpud.engine.steps import StepRunner
from gpud.engine.vgpu.keeper import VgpuKeeper
from gpud.engine.view import EngineView, ViewCache, said_once
from gpud.host.files.state_files import Problems
from gpud.host.systemd.logind import BOOT_ID_PATH
from gpud.layout.desired import DesiredGpu
from gpud.layout.parse import ParsedLayout
from gpud.layout.resolve import Resolution
from gpud.layout.schema import Layout, MatchRule, Policy
from gpud.model import Gpu
from gpud.plan.mig import GpuPlan

log = logging.getLogger(__name__)



class Reconciler:
    def __init__(
        self,
        hardware: Hardware,
        *,
        config_path: str,
        apply_lock: ApplyLock,
        bus: EventBus,
        read_only: bool = False,
        drainer: Drainer | None = None,
        binder_timeout: float = 30.0,
        udev_rules: BootOverrides | None = None,
        state_dir: str | None = None,
        rebooter: Rebooter | None = None,
        max_status_age: float = DEFAULT_MAX_AGE,
        boot_id_path: str | None = None,
        cdi_generate: Callable[[], Awaitable[str]] | None = None,
        operand_guard: OperandGuard | None = None,
        label_selects: bool = False,
    ) -> None:
        self.hw = hardware
        self.config_path = config_path
        self.apply_lock = apply_lock
        self.bus = bus
        self.read_only = read_only
        self.drainer = drainer  # None: no system bus
        # `nvidia-ctk cdi generate` after MIG changes when the toolkit's refresh unit is absent
        # (gpud.host.nvidia.cdi.CdiGenerator; None: the toolkit is not installed)
        self.cdi_generate = cdi_generate
        self.udev_rules = udev_rules  # boot-time vfio overrides
        # state files set aside or not written (gpud.host.files.state_files): an event each, and status
        self.state_problems = Problems(lambda m: bus.publish("state-file", m))
        self.reboot_policy = RebootPolicy(rebooter=rebooter, state_dir=state_dir, read_only=read_only, bus=bus,
                                          boot_id_path=boot_id_path or BOOT_ID_PATH, problems=self.state_problems)
        # boot_id_path None: this boot is not told apart from the last (tests without a host's boot id)
        self.boot_rebuild = BootRebuild(state_dir, boot_id(boot_id_path), bus, read_only=read_only,
                                        problems=self.state_problems)
        # label_selects (--kube-node): the node label chooses the layout, `selected` may be absent
        self.plans = PlanMemo()  # MIG plans per GPU view and entry, planned ahead in worker threads
        self.drivers = DriverList(self.hw.sysfs)  # the kernel's PCI drivers, listed once per host read
        self.layout_file = LayoutKeeper(config_path, bus, self._observe, judge=lambda *a: judged(self.next_action, *a),
                                        label_selects=label_selects, prepare=self.plans.plan_ahead)
        self.state_dir = state_dir
        # `gpudctl select NAME`, kept across restarts (engine/layout_choice); a node label replaces it,
        # so with --kube-node a choice kept from before does not count
        self.layout_file.select = None if label_selects else layout_choice.load(state_dir, self.state_problems)
        self.operand_guard = operand_guard  # --kube-node: the kube agent
        self.scheduler = PassScheduler()
        self.holder_watch = HolderWatch(self._holder_exited)
        # PCI address -> kept index: a GPU leaving the bus shifts nobody (gpud.engine.observe.gpu_index)
        self.gpu_index = GpuIndex(index_path(state_dir), problems=self.state_problems)
        self.gpu_set = GpuSetNotes(bus)  # a change of the GPU set: said, and noted for status
        self._pass_layout: ParsedLayout | None = None  # the layout a running pass started with
        self._concluded_under: Layout | None = None  # the layout the last pass concluded the GPU states for
        self.resolution: Resolution | None = None
        self.observation = Observation(gpus=(), functions=())
        self.gpu_states = GpuStates()
        self.phase: Phase = "starting"
        self._apply_wanted = False  # `gpudctl apply` asked for the next pass (policy.apply: manual)
        self._apply_now = False  # ... and the running pass is that one
        self.passes = 0  # passes started
        self.completed_passes = 0  # passes finished (phase says how they ended)
        self._listeners: list[Callable[[], None]] = []
        self._views = ViewCache()
        self.vgpus = VgpuKeeper(hardware.vgpu, state_dir if not read_only else None, self.state_problems,
                                vf_tool=hardware.vf_tool)
        self.reader = HostReader(hardware, self.vgpus, self.gpu_index)
        self.steps = StepRunner(hardware, bus, self.vgpus, self, binder_timeout=binder_timeout)
        self.rounds = GpuRounds(self, self.steps, self.holder_watch, self.reboot_policy)  # each GPU of a pass
        # the one current observation: read off the loop, re-read on change and while clients ask
        # (no background read of the whole host while a pass's GPUs are in their rounds: the pass
        # re-reads each GPU it changes, and the whole host at its end; at 64 GPUs such a read is
        # ~1,000 NVML calls beside its own. While a pass waits (the apply lock, hooks, operands,
        # the CDI refresh) nothing re-reads for it, so clients' looks do.)
        self.observer = Observer(self._read_host, self._install, max_age=max_status_age,
                                 busy=lambda: bool(self.steps.inflight) or self.rounds.running > 0,
                                 prepare=self._plan_ahead)
        # MIG on demand on the dynamic GPUs: beside the pass, never behind it (engine/leases)
        self.leases = LeaseEngine(hardware, bus, state_dir=state_dir, problems=self.state_problems,
                                  gate=self.steps.nvml_gate, dynamic=self._dynamic_gpus, policy=lambda: self.policy,
                                  reread=self.refresh_async, observed_at=lambda: self.observer.started,
                                  read_only=read_only)

    # ---- the file (kept by self.layout_file) ----------------------------------------------
    @property
    def layout(self) -> ParsedLayout | None:
        """The last good layout in force."""
        return self.layout_file.layout

    @property
    def layout_issues(self) -> tuple[list[str], list[str]]:
        """(errors, warnings) of the file as it is now."""
        return self.layout_file.issues

    def load_config(self) -> bool:
        """Read and parse the file; a bad file never replaces the last good layout. Reads the
        host on the calling thread (start-up, tests); the daemon uses `load_config_async`."""
        return self._taken(self.layout_file.load())

    def _taken(self, ok: bool) -> bool:
        """After a good file is taken, `resolution` is the new layout's at once (the load's own
        resolution when it read this observation), so status never shows the old layout's
        workloads beside GPU states pending the new one. A good file read after a new GPU joined
        acknowledges it: its note leaves status."""
        if ok:
            self.resolution = self.layout_file.resolve(self.observation)
            present = {g.pci for g in self.observation.gpus}
            self.gpu_set.acknowledge(present)
        return ok

    async def load_config_async(self) -> bool:
        """`load_config` with the host read off the event loop."""
        return self._taken(await self.layout_file.load_async(self._observe_async))

    async def choose_layout_async(self, name: str | None) -> bool:
        """Put layout `name` of the file in force instead of its `selected` (a node label's
        choice; None: the file's own again), read and checked off the event loop."""
        return self._taken(await self.layout_file.choose_async(name, self._observe_async))

    async def select_layout_async(self, name: str | None) -> bool:
        """`gpudctl select`: put layout `name` of the file in force (None: the file's own
        `selected` again) and keep the choice across restarts. A name the file refuses changes
        nothing: the choice in force before stays, and False is returned with the errors in
        `layout_issues` until the next load."""
        before = self.layout_file.select
        if await self.choose_layout_async(name):
            if not self.read_only:
                layout_choice.keep(self.state_dir, name, self.state_problems)
            self.bus.publish("layout-selected", f"layout {name!r} chosen by gpudctl select" if name
                             else "the file's own `selected` is in force again")
            return True
        self.layout_file.select = before
        return False

    async def evaluate_async(self, text: str, path: str, *, select: str | None = None,
                             ) -> tuple[ParsedLayout, Resolution, Observation]:
        """Parse a layout text and resolve it against this host as that layout's own `match:` sees it
        (`select`: a layout chosen over the file's `selected`), the host read off the event loop."""
        return await self.layout_file.evaluate_async(text, path, self._observe_async, select=select)

    async def evaluate_each_async(self, text: str, path: str, names: list[str]) -> list[tuple[str, Resolution]]:
        """Layouts `names` of one text, each resolved as if selected, from one parse and one host read."""
        return await self.layout_file.evaluate_each_async(text, path, names, self._observe_async)

    async def _observe_async(self, match: tuple[MatchRule, ...]) -> Observation:
        """The host as `match` selects it, read in a worker thread. For the layout in force's own
        `match:` this is a re-read of the current observation (status sees it too)."""
        if match == self.layout_file.match:
            return await self.observer.refresh()
        return await asyncio.to_thread(self._observe, match)

    def _observe(self, match: tuple[MatchRule, ...]) -> Observation:
        return self.reader.read(match)

    async def reload_async(self, reason: str) -> bool:
        """Re-read the file (the host read off the event loop); a valid one starts a pass. False
        when the file was refused."""
        return self._reloaded(await self.load_config_async(), reason)

    def _reloaded(self, ok: bool, reason: str) -> bool:
        if ok:
            self.kick(reason)
            self.mark_pending()
        return ok

    def mark_pending(self) -> None:
        """Right after a new layout is taken, before its pass starts, the GPUs it will change are
        `pending`, not `converged`: status must not claim the new layout is in place. Resolved
        against the last observation (no hardware read); the pass re-plans from a fresh one."""
        if self.layout is None or self.scheduler.running:
            return  # a running pass sets each GPU's state itself
        resolution = self.resolution = self.layout_file.resolve(self.observation)
        if resolution is None or resolution.errors or self.read_only:
            return
        states = between_passes.pending(self.observation, resolution, self.gpu_states, self.next_action)
        if states:
            self.gpu_states.update(states)
            self._notify()

    @property
    def pass_running(self) -> bool:
        """A pass is under way: run by the scheduler (after its debounce) or called directly (start-up, tests)."""
        return self.scheduler.running or self._pass_layout is not None

    def phase_now(self) -> Phase:
        """The phase as it is at this moment (gpud.engine.gpu_state.phase_now)."""
        invalid = bool(self.layout_issues[0]) or (self.resolution is not None and bool(self.resolution.errors))
        return phase_now(self.phase, self.gpu_states.values(), invalid=invalid)

    def view(self) -> EngineView:
        """The engine's state now as one frozen record (gpud.engine.view), rebuilt only when
        something in it changed (ViewCache)."""
        states = self.gpu_states
        rebuilt = tuple((pci, tuple(what)) for pci, what in self.vgpus.rebuilt.items())  # a small, edited dict
        errors, warnings = self.layout_issues
        records = self.leases.book.records  # replaced, never edited, on each lease change
        label_selects = self.layout_file.label_selects
        chosen = self.selected is not None and self.selected == self.layout_file.select and not label_selects
        problems = said_once(self.state_problems.list(), self.gpu_index.problem)
        return self._views.get(  # (phase_now follows from the states, the phase and the errors)
            (self.observation, self.resolution, self.layout, records),
            (states.version, self.phase, tuple(errors), tuple(warnings), self.config_path,
             self.read_only, self.boot_rebuild.summary, rebuilt, problems,
             tuple(self.gpu_set.notes.items()), self.passes, self.completed_passes, label_selects, chosen),
            lambda: EngineView(
                observation=self.observation, resolution=self.resolution, gpu_states=MappingProxyType(dict(states)),
                phase=self.phase, phase_now=self.phase_now(), layout=self.layout, layout_errors=tuple(errors),
                layout_warnings=tuple(warnings), config_path=self.config_path, read_only=self.read_only,
                notes=MappingProxyType(dict(self.gpu_set.notes)), problems=problems,
                rebuilt_after_boot=self.boot_rebuild.summary, vgpus_rebuilt=MappingProxyType(dict(rebuilt)),
                passes=self.passes, completed_passes=self.completed_passes, leases=tuple(self.leases.leases()),
                lease_free=MappingProxyType(self.leases.free()), label_selects=label_selects, chosen=chosen))

    @property
    def selected(self) -> str | None:
        layout = self.layout
        return layout.layout.selected if layout is not None and layout.layout is not None else None

    @property
    def policy(self) -> Policy | None:
        layout = self._pass_layout or self.layout
        return layout.layout.policy if layout is not None and layout.layout is not None else None

    # ---- scheduling (by self.scheduler) ---------------------------------------------------
    def kick(self, reason: str, *, seen_since: float | None = None) -> int:
        """Ask for a pass; returns the ticket a caller can wait on with `wait_for` (`seen_since`:
        PassScheduler.kick)."""
        return self.scheduler.kick(reason, seen_since=seen_since)

    async def wait_for(self, ticket: int, timeout: float | None = None) -> bool:
        return await self.scheduler.wait_for(ticket, timeout)

    def on_change(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    async def run(self, debounce: float = 0.2) -> None:
        """The one task that runs passes; requests that arrive during a pass coalesce into the next."""
        await self.scheduler.run(self._guarded_pass, debounce)

    async def _guarded_pass(self) -> None:
        try:
            await self.converge()
        except ApplyLockRefused as e:  # an unsafe lock file: nothing is applied until it is fixed
            log.error("%s", e)
            self.phase = "failed"
            self.bus.publish("error", str(e))
        except Exception:
            log.exception("reconcile pass failed")
            self.phase = "failed"
            self.bus.publish("error", "internal error in the reconcile pass; see the journal")

    # ---- observation ------------------------------------------------------------------------
    @property
    def nvml_stale(self) -> bool:
        """The observation's NVML view is the last good one, kept while a rebind holds NVML closed."""
        return self.observation.nvml_stale

    async def reread(self, pci: str) -> Gpu | None:
        """The host re-read; the GPU at `pci` as it is now (None: gone from the bus)."""
        await self.refresh_async()
        return self.gpu(pci)

    def _dynamic_gpus(self) -> list[tuple[Gpu, DesiredGpu]]:
        """The GPUs the layout in force marks `mig-devices: dynamic`, as last observed."""
        res = self.resolution
        if res is None or res.errors:
            return []
        return [(g, d) for g in self.observation.gpus if (d := res.desired.get(g.pci)) is not None and d.dynamic]

    def gpu(self, pci: str) -> Gpu | None:
        """The GPU at `pci` in the last observation."""
        return next((g for g in self.observation.gpus if g.pci == pci), None)

    async def reread_gpu(self, pci: str) -> None:
        """Re-read one GPU (after its MIG steps, which change that GPU alone)."""
        await self.observer.refresh_gpu(pci, self.reader.read_gpu)

    def refresh(self) -> Observation:
        """Re-read the host on the calling thread (the start-up read, before anything is served)."""
        return self.observer.read_now()

    async def refresh_async(self) -> Observation:
        """Re-read the host in a worker thread (one read at a time, shared by whoever waits for
        it): the loop keeps serving every client meanwhile."""
        return await self.observer.refresh()

    def _read_host(self) -> Observation:
        """The host as the layout in force's `match:` selects it; blocking, run in a worker thread."""
        return self.reader.read(self.layout_file.match, commit=True)

    def _plan_ahead(self, observation: Observation) -> None:
        """In the reading thread, once the read's unchanged GPUs are the views in force: resolve
        the layout in force against it (taken by `_install` on the loop) and plan its GPUs for
        their entries (gpud.engine.action_inputs); a GPU planned before is found kept, so only a
        changed one is planned."""
        resolution = self.layout_file.resolve_ahead(observation) or self.resolution
        if resolution is not None and not resolution.errors:
            self.plans.plan_ahead(resolution, observation)

    def _install(self, observation: Observation) -> None:
        """Take a new observation, on the loop: changes of the GPU set said first, the layout
        resolved against it, vanished GPUs marked `gone`."""
        while self.reader.set_changes:
            self.gpu_set.report(self.reader.set_changes.pop(0))
        self.observation = observation
        if self.layout is not None:
            self.resolution = self.layout_file.resolve(observation)
        present = {g.pci for g in self.observation.gpus}
        for known in self.observation.gone:
            if self.gpu_states.get(known.pci, GpuState("unmanaged")).state != "gone":
                self.gpu_states[known.pci] = GpuState("gone", gone_message(known))
        for pci, st in list(self.gpu_states.items()):
            if pci not in present and st.state != "gone":  # left the bus but not numbered (not managed)
                self.gpu_states[pci] = GpuState("gone", "the GPU disappeared from the PCI bus")
                self.bus.publish("gpu-gone", "GPU removed", gpu=pci)
        self._judge_drift()
        self._notify()

    def _judge_drift(self) -> None:
        """Every observation is compared with the layout: a GPU a pass left `converged` that no
        longer matches (another tool changed MIG or a driver binding) is `drift`, with the step
        that would put it back named, an event said once, and (policy on-drift: converge, the
        default) a pass asked for. Judged only between passes and under the layout those states
        were concluded for (a new layout's differences are `pending`, not drift)."""
        res = self.resolution
        if (res is None or res.errors or res.layout is None or res.layout is not self._concluded_under
                or self.pass_running):
            return
        drift = between_passes.drifted(self.observation, res, self.gpu_states, self.next_action)
        for pci, state in drift.items():
            self.gpu_states[pci] = state
            self.bus.publish("drift", state.message, gpu=pci)
        if drift:
            self.phase = concluded_phase(self.gpu_states.values())
            if res.layout.policy.on_drift == "converge" and not self.read_only:
                self.kick("drift")

    def _notify(self) -> None:
        for cb in self._listeners:
            cb()

    # ---- planning -----------------------------------------------------------------------------
    def next_action(self, gpu: Gpu, desired: DesiredGpu) -> Action | GpuState | None:
        """The next thing this GPU needs (gpud.engine.next_action), or None when it matches its entry."""
        return next_action(gpu, desired, vgpus=self.vgpus, leases=self.leases, policy=self.policy,
                           drivers=self.drivers.of(self.observation, self.observer.reads), nvml_error=self.observation.nvml_error,
                           plan_mig=self._plan_mig)

    def _plan_mig(self, gpu: Gpu, desired: DesiredGpu) -> GpuPlan:
        return self.plans.plan(gpu, desired, gpus=len(self.observation.gpus))

    # ---- execution ----------------------------------------------------------------------------
    def request_apply(self, *, seen_since: float | None = None) -> int:
        """`gpudctl apply`: a pass that converges even under `policy.apply: manual`; its ticket."""
        self._apply_wanted = True
        return self.kick("apply requested", seen_since=seen_since)

    def held(self) -> bool:
        """This pass only says what is pending: the layout in force is `apply: manual` and no
        `gpudctl apply` asked for it (with --kube-node the node label is that request)."""
        policy = self.policy
        return (policy is not None and policy.apply == "manual" and not self._apply_now
                and self.operand_guard is None and not self.read_only)

    async def converge(self) -> None:
        self._apply_now, self._apply_wanted = self._apply_wanted, False
        if self.layout is None:
            await self.refresh_async()
            self.phase = "invalid-layout"
            return
        async with self.apply_lock.held(lambda m: self.bus.publish("waiting", m)):
            self.passes += 1
            self._pass_layout = self.layout  # a reload during the pass takes effect in the next one
            self.rounds.acted = False
            try:
                await self._converge_all()
            finally:
                self._pass_layout = None
            if self.rounds.acted:  # a pass that changed nothing ends with the view it began with
                # a read begun after its GPUs' rounds ended sees all it changed: one a client's look
                # started meanwhile (hooks and the CDI refresh may follow the rounds) is that read
                await self.observer.fresh(self.rounds.ended)
        self.phase = concluded_phase(self.gpu_states.values())
        # the layout this pass's states were concluded under: later observations are judged against it
        self._concluded_under = self.resolution.layout if self.resolution is not None else None
        self.reboot_policy.after_pass(self.phase)
        self.boot_rebuild.pass_ended(self.gpu_states, self.phase)
        self.completed_passes += 1
        self._notify()

    async def _converge_all(self) -> None:
        if self.scheduler.running:  # a read begun after the pass was asked for is fresh enough
            await self.observer.fresh(self.scheduler.pass_since)
        else:
            await self.refresh_async()
        resolution = self.resolution  # this pass works from one resolution, whatever refresh() does
        assert resolution is not None
        # A file taken while the pass waited for its read is the one resolved: its policy (and, via
        # the resolution, its hooks) rule this pass, never the layout the pass was asked under.
        self._pass_layout = self.layout
        if resolution.errors:  # the host changed under a good file: change nothing
            self.phase = "invalid-layout"
            self.bus.publish("layout-invalid", "; ".join(str(e) for e in resolution.errors))
            return
        if self.udev_rules is not None and not self.read_only:
            # Before any rebind: after a reboot the override must beat the nvidia probe.
            if self.udev_rules.sync(self.observation.gpus, resolution.desired):
                self.bus.publish("udev-rules", f"{self.udev_rules.path} updated for the layout")
        todo = self._changing(resolution)
        self.boot_rebuild.will_change({g.pci: f"GPU {g.index} ({g.pci})" for g in self.observation.gpus if g.pci in todo})
        for gpu in self.observation.gpus:
            if gpu.pci not in resolution.desired:
                self.set_state(gpu.pci, GpuState("unmanaged", "not in the selected layout: left untouched"))
        if todo:
            await PassApply(todo, resolution, rounds=self.rounds, states=self.gpu_states, set_state=self.set_state,
                            bus=self.bus, steps=self.steps, operand_guard=self.operand_guard,
                            hooks_refused=self.layout_file.hooks_refused, config_path=self.config_path,
                            drainer=self.drainer, cdi_generate=self.cdi_generate, gpus=self.observation.gpus).run()
        # the GPUs with nothing to do (re-checked)
        await for_each_gpu([p for p in sorted(resolution.desired) if p not in todo],
                           lambda pci: self.rounds.converge(pci, resolution.desired[pci]))

    def _changing(self, resolution: Resolution) -> dict[str, Action]:
        """The GPUs a pass will change, with their first action: hooks run only when there is one."""
        todo = {}
        for gpu in self.observation.gpus:
            desired = resolution.desired.get(gpu.pci)
            if desired is not None and not self.read_only and not self.held():
                action = self.next_action(gpu, desired)
                if isinstance(action, Action):
                    todo[gpu.pci] = action
        return todo

    def set_state(self, pci: str, st: GpuState, **data: Any) -> None:
        """A GPU's state; a change is published (an event) and notified."""
        old = self.gpu_states.get(pci)
        self.gpu_states[pci] = st
        if old is None or (old.state, old.message) != (st.state, st.message):
            self.bus.publish(st.state, st.message, gpu=pci, **data)
            self._notify()

    def _holder_exited(self, pid: int) -> None:  # called once per process (HolderWatch)
        self.bus.publish("holder-exited", f"pid {pid} exited")
        # only an applying pass waits for holders: the pass that goes on after one is that apply's,
        # under policy.apply: manual too
        self._apply_wanted = True
        self.kick(f"pid {pid} exited")
