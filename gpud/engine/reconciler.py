"""The reconcile loop: observe -> resolve -> plan -> execute per GPU -> re-observe, one pass at a time.

Each GPU converges on its own: one GPU's failure or wait never stops the others. A pass is
re-entrant: it recomputes what is left from what the hardware says now, so a wait that ends, an
event from udev, a daemon restart or an edit of the file all lead to the same place. Nothing is
ever killed: busy GPUs wait (or fail, by policy) and name their holders.

One concern, the loop itself: what a GPU needs next (`next_action`) and running it, GPU by GPU,
in a pass. Its helpers live beside it: the file (layout_keeper), when passes run (scheduler), the
host-wide lock (apply_lock), the hook phases (hooked_apply), policy.reboot (reboot_policy) and
waking on a holder's exit (holder_watch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal

import msgspec

from gpud.engine.apply_lock import ApplyLock, ApplyLockRefused
from gpud.engine.boot.reboot_policy import RebootPolicy
from gpud.engine.boot.rebuild import BootRebuild
from gpud.engine.events import EventBus, event_fields
from gpud.engine.gpu_state import PHASE_ORDER, Action, BindAction, GpuState, GpuStateName, MigAction, VgpuAction
from gpud.engine.gpu_tasks import NvmlSessionGate, SharedDrain, for_each_gpu
from gpud.engine.hooks.phases import apply_with_hooks
from gpud.engine.hooks.runner import HookFailed
from gpud.engine.kube.operands import OperandGuard, OperandsNotPaused
from gpud.engine.layout_keeper import LayoutKeeper
from gpud.engine.observe.discovery import Observation, observe
from gpud.engine.observe.gpu_index import GpuIndex, SetChange, index_path
from gpud.engine.observe.holder_watch import HolderWatch
from gpud.engine.observe.observer import DEFAULT_MAX_AGE, Observer
from gpud.engine.ports import BootOverrides, Drainer, Rebooter
from gpud.engine.scheduler import PassScheduler
from gpud.engine.vgpu.keeper import NAMES_FILE, VgpuKeeper, changes_vfs, step_event
from gpud.host.logind import BOOT_ID_PATH, current_boot_id
from gpud.host.nvidia_smi import KNOWN_HOLDERS, PERSISTENCED, GpuReset
from gpud.host.nvml import Nvml
from gpud.host.procs import Procs
from gpud.host.sriov_manage import SriovManage
from gpud.host.state_files import Problems
from gpud.host.sysfs import Sysfs
from gpud.host.vgpu_sysfs import VgpuSysfs, vfio_cdevs
from gpud.layout.desired import DesiredGpu
from gpud.layout.parse import ParsedLayout
from gpud.layout.resolve import Resolution
from gpud.layout.schema import MatchRule, Policy
from gpud.model import Gpu, Holder, KnownGpu, NvmlGpu
from gpud.plan.binding import BindingPlan, plan_binding
from gpud.plan.mig import GpuPlan, plan_gpu
from gpud.plan.operand_impact import impact

log = logging.getLogger(__name__)

MAX_ROUNDS = 8  # vGPUs off -> MIG off -> rebind -> MIG on -> VFs on -> vGPUs on is six; spares


class Hardware(msgspec.Struct):
    """The adapters one daemon drives, chosen once at start (real host or simulator)."""

    sysfs: Sysfs
    nvml: Nvml
    procs: Procs
    reset: GpuReset | None = None  # nvidia-smi -r for nvidia-bound GPUs; None: resets are left to the operator
    vf_tool: SriovManage | None = None  # NVIDIA's sriov-manage: VFs on and off; None: VFs are not changed


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
    ) -> None:
        self.hw = hardware
        self.config_path = config_path
        self.apply_lock = apply_lock
        self.bus = bus
        self.read_only = read_only
        self.drainer = drainer  # None: no system bus (the daemon may connect one later)
        # `nvidia-ctk cdi generate` after MIG changes when the toolkit's refresh unit is absent
        # (gpud.host.cdi.CdiGenerator; None: the toolkit is not installed)
        self.cdi_generate: Callable[[], Awaitable[str]] | None = None
        self.binder_timeout = binder_timeout
        self.udev_rules = udev_rules  # boot-time vfio overrides
        # state files set aside or not written (gpud.host.state_files): an event each, and status
        self.state_problems = Problems(lambda m: bus.publish("state-file", m))
        self.reboot_policy = RebootPolicy(rebooter=rebooter, state_dir=state_dir, read_only=read_only, bus=bus,
                                          boot_id_path=boot_id_path or BOOT_ID_PATH, problems=self.state_problems)
        # boot_id_path None: this boot is not told apart from the last (tests without a host's boot id)
        self.boot_rebuild = BootRebuild(state_dir, _boot_id(boot_id_path), bus, read_only=read_only,
                                        problems=self.state_problems)
        self.layout_file = LayoutKeeper(config_path, bus, self._observe)
        self.operand_guard: OperandGuard | None = None  # --kube-node: the kube agent
        self.scheduler = PassScheduler()
        self.holder_watch = HolderWatch(self._holder_exited)
        # PCI address -> kept index: a GPU leaving the bus shifts nobody (gpud.engine.observe.gpu_index)
        self.gpu_index = GpuIndex(index_path(state_dir), problems=self.state_problems)
        self.gpu_set_notes: dict[str, str] = {}  # PCI -> what changed in the GPU set, for status
        self._set_changes: list[SetChange] = []  # seen by a read in a worker thread, said by _install
        # GPUs converge side by side (gpud.engine.gpu_tasks): NVML work and unbinds from nvidia
        # exclude each other; drained units stay stopped until the last GPU's step ends.
        self.nvml_gate = NvmlSessionGate()
        self.shared_drain = SharedDrain()
        self._pass_layout: ParsedLayout | None = None  # the layout a running pass started with
        self._inflight: set[asyncio.Future] = set()  # hardware steps running in worker threads
        self._mig_changed: set[str] = set()  # GPUs whose MIG devices changed in this pass
        self._last_nvml: dict[str, NvmlGpu] = {}  # PCI -> the last NvmlGpu read without error
        self.resolution: Resolution | None = None
        self.observation = Observation(gpus=(), functions=())
        self.gpu_states: dict[str, GpuState] = {}
        self.phase = "starting"
        self.passes = 0  # passes started
        self.completed_passes = 0  # passes finished (phase says how they ended)
        self._listeners: list[Callable[[], None]] = []
        self.vgpus = VgpuKeeper(VgpuSysfs(hardware.sysfs, hardware.procs,
                                          names_file=os.path.join(state_dir, NAMES_FILE) if state_dir else None),
                                state_dir if not read_only else None, self.state_problems,
                                vf_tool=hardware.vf_tool)
        # the one current observation: read off the loop, re-read on change and while clients ask
        self.observer = Observer(self._read_host, self._install, max_age=max_status_age,
                                 busy=lambda: bool(self._inflight))

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
            for pci in [p for p in self.gpu_set_notes if p in present]:
                del self.gpu_set_notes[pci]
        return ok

    async def load_config_async(self) -> bool:
        """`load_config` with the host read off the event loop."""
        return self._taken(await self.layout_file.load_async(self._observe_async))

    async def choose_layout_async(self, name: str | None) -> bool:
        """Put layout `name` of the file in force instead of its `selected` (a node label's
        choice; None: the file's own again), read and checked off the event loop."""
        return self._taken(await self.layout_file.choose_async(name, self._observe_async))

    def evaluate(self, text: str, path: str, *, select: str | None = None) -> tuple[ParsedLayout, Resolution, Observation]:
        """Parse a layout text and resolve it against this host as that layout's own `match:` sees it
        (`select`: a layout chosen over the file's `selected`)."""
        return self.layout_file.evaluate(text, path, select=select)

    async def evaluate_async(self, text: str, path: str, *, select: str | None = None,
                             ) -> tuple[ParsedLayout, Resolution, Observation]:
        """`evaluate` with the host read off the event loop."""
        return await self.layout_file.evaluate_async(text, path, self._observe_async, select=select)

    async def _observe_async(self, match: tuple[MatchRule, ...]) -> Observation:
        """The host as `match` selects it, read in a worker thread. For the layout in force's own
        `match:` this is a re-read of the current observation (status sees it too)."""
        if match == self.layout_file.match:
            return await self.observer.refresh()
        return await asyncio.to_thread(self._observe, match)

    def _observe(self, match: tuple[MatchRule, ...], *, commit: bool = False) -> Observation:
        """The host as `match` selects it, each GPU with its kept index (gpud.engine.observe.gpu_index) and
        the known GPUs missing from the bus in `gone`. Only `commit` (the observer's reads of the
        layout in force) makes the index map take new GPUs; a `check` of a candidate file remembers
        nothing. A change of the GPU set is reported on the loop, by `_install`."""
        obs = self._read_functions(match)
        gpus, gone, change = self.gpu_index.assign(obs.gpus, (f.address for f in obs.functions), commit=commit)
        if commit and change:
            self._set_changes.append(change)  # list.append is atomic: this runs in a worker thread
        return msgspec.structs.replace(obs, gpus=gpus, gone=gone, index_problem=self.gpu_index.index_problem)

    def _read_functions(self, match: tuple[MatchRule, ...]) -> Observation:
        """While a rebind runs, NVML stays closed: opening it (nvmlInit opens every GPU) would make
        gpud itself the holder its unbind waits for. The last good NVML view stands in meanwhile,
        also for a read that the closing cut short."""
        for _ in range(2):  # a read that a whole suspend/resume cut short is read again, once
            if self.hw.nvml.suspended:
                break
            obs = observe(self.hw.sysfs, self.hw.nvml, match)
            if self.hw.nvml.suspended:  # closed under us while reading
                break
            if obs.nvml_error is None:
                self._last_nvml = {g.pci: g.nvml for g in obs.gpus if g.nvml is not None}
                return self._with_vgpus(obs)
        else:
            return obs  # NVML is really unavailable (no driver): status says so
        obs = observe(self.hw.sysfs, None, match)
        gpus = tuple(msgspec.structs.replace(g, nvml=self._last_nvml.get(g.pci)) if g.function.driver == "nvidia"
                     else g for g in obs.gpus)
        return self._with_vgpus(msgspec.structs.replace(obs, gpus=gpus, nvml_stale=True))

    def _with_vgpus(self, obs: Observation) -> Observation:
        """Each GPU's vGPU side, from sysfs (either interface, found per GPU)."""
        return msgspec.structs.replace(obs, gpus=tuple(self.vgpus.observe(g) for g in obs.gpus))

    def reload(self, reason: str) -> bool:
        """Re-read the file; a valid one starts a pass. False when the file was refused."""
        return self._reloaded(self.load_config(), reason)

    async def reload_async(self, reason: str) -> bool:
        """`reload` with the host read off the event loop."""
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
        if resolution is None or resolution.errors:
            return
        changed = False
        for gpu in self.observation.gpus:
            desired = resolution.desired.get(gpu.pci)
            old = self.gpu_states.get(gpu.pci)
            if desired is None or self.read_only or (old is not None and not old.converged):
                continue
            try:
                action = self.next_action(gpu, desired)
            except Exception:  # a surprise here must not refuse a reload; the pass will report it
                log.exception("GPU %s: planning the pending change", gpu.pci)
                continue
            if isinstance(action, Action):
                self.gpu_states[gpu.pci] = GpuState("pending", f"layout changed: {action.summary}, not started yet")
                changed = True
        if changed:
            self._notify()

    def phase_now(self) -> str:
        """The phase as it is at this moment (status' top line): an invalid file first, then a GPU
        being changed, then a change not started yet, else what the last pass concluded."""
        if self.layout_issues[0] or (self.resolution is not None and self.resolution.errors):
            return "invalid-layout"
        states = {s.state for s in self.gpu_states.values()}
        for live in ("applying", "pending"):
            if live in states:
                return live
        return self.phase

    @property
    def policy(self) -> Policy | None:
        layout = self._pass_layout or self.layout
        return layout.layout.policy if layout is not None and layout.layout is not None else None

    # ---- scheduling (by self.scheduler) ---------------------------------------------------
    def kick(self, reason: str) -> int:
        """Ask for a pass; returns the ticket a caller can wait on with `wait_for`."""
        return self.scheduler.kick(reason)

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
    def refresh(self) -> Observation:
        """Re-read the host on the calling thread (the start-up read, before anything is served)."""
        return self.observer.read_now()

    async def refresh_async(self) -> Observation:
        """Re-read the host in a worker thread (one read at a time, shared by whoever waits for
        it): the loop keeps serving every client meanwhile."""
        return await self.observer.refresh()

    def _read_host(self) -> Observation:
        """The host as the layout in force's `match:` selects it; blocking, run in a worker thread."""
        return self._observe(self.layout_file.match, commit=True)

    def _install(self, observation: Observation) -> None:
        """Take a new observation, on the loop: changes of the GPU set said first, the layout
        resolved against it, vanished GPUs marked `gone`."""
        while self._set_changes:
            self._report_set_change(self._set_changes.pop(0))
        self.observation = observation
        if self.layout is not None:
            self.resolution = self.layout_file.resolve(observation)
        present = {g.pci for g in self.observation.gpus}
        for known in self.observation.gone:
            if self.gpu_states.get(known.pci, GpuState("unmanaged")).state != "gone":
                self.gpu_states[known.pci] = GpuState("gone", _gone_message(known))
        for pci, st in list(self.gpu_states.items()):
            if pci not in present and st.state != "gone":  # left the bus but not numbered (not managed)
                self.gpu_states[pci] = GpuState("gone", "the GPU disappeared from the PCI bus")
                self.bus.publish("gpu-gone", "GPU removed", gpu=pci)
        self._notify()

    def _report_set_change(self, change: SetChange) -> None:
        """A GPU left, came back or is new: said (event, and a status warning) before the pass that
        follows applies anything, so an `all` or `device-filter` entry never silently covers a
        different set of GPUs."""
        for known in change.gone:
            note = _gone_message(known)
            self.gpu_set_notes[known.pci] = note
            self.bus.publish("gpu-gone", note, gpu=known.pci, index=known.index)
        for known in change.returned:
            self.gpu_set_notes.pop(known.pci, None)
            self.bus.publish("gpu-returned", f"GPU {known.index} ({known.pci}, {known.model}) is back on the PCI "
                                             f"bus with its index {known.index}", gpu=known.pci, index=known.index)
        for known in change.joined:
            note = (f"GPU {known.index} ({known.pci}, {known.model}) is new on this host: it gets index "
                    f"{known.index} (indices of GPUs gpud has seen before do not change); entries with "
                    "`devices: all` or `device-filter` may now select it")
            self.gpu_set_notes[known.pci] = note
            self.bus.publish("gpu-added", note, gpu=known.pci, index=known.index)
        self.bus.publish("gpu-set-changed", "the set of GPUs changed: " + ", ".join(
            [f"gone {k.index} ({k.pci})" for k in change.gone]
            + [f"back {k.index} ({k.pci})" for k in change.returned]
            + [f"new {k.index} ({k.pci})" for k in change.joined]) + "; reported before anything is applied",
            gone=[k.pci for k in change.gone], returned=[k.pci for k in change.returned],
            joined=[k.pci for k in change.joined])

    def _notify(self) -> None:
        for cb in self._listeners:
            cb()

    def vgpus_missing(self) -> list[str]:
        """vm-vgpu GPUs of the layout in force that have fewer vGPUs than it asks for (after a
        reboot or a driver reload: all of them, since neither VFs nor vGPUs survive one). The
        daemon holds READY=1 back until its first pass has made them, so VM managers ordered after
        gpud start with their mdev UUIDs and VFs in place."""
        if self.resolution is None or self.read_only:
            return []
        missing = []
        for gpu in self.observation.gpus:
            desired = self.resolution.desired.get(gpu.pci)
            if desired is None or desired.workload != "vm-vgpu" or not desired.vgpu_devices:
                continue
            have = len(gpu.vgpu.devices) if gpu.vgpu is not None else 0
            if have < sum(desired.vgpu_devices.values()):
                missing.append(gpu.pci)
        return missing

    # ---- planning -----------------------------------------------------------------------------
    def next_action(self, gpu: Gpu, desired: DesiredGpu) -> Action | GpuState | None:
        """The next thing this GPU needs, or None when it matches its entry. Returns a GpuState
        when it cannot go on (infeasible, unknown model)."""
        target_driver = "vfio-pci" if desired.workload == "vm-passthrough" else "nvidia"
        if gpu.function.driver == "nvidia":
            # vGPUs (and VFs) the layout no longer has go first: before a MIG change under them,
            # before the GPU leaves nvidia; a held one stops everything here.
            removal = self.vgpus.removals(gpu, desired)
            if removal is not None:
                return removal
            if gpu.nvml is None:
                return GpuState("failed", "bound to nvidia but NVML does not see it"
                                + (f" ({self.observation.nvml_error})" if self.observation.nvml_error else ""))
            mig_desired = desired
            if target_driver != "nvidia" and gpu.nvml.mig_capable and (gpu.nvml.mig_mode or gpu.nvml.mig_pending):
                # MIG state belongs to the nvidia driver: undo it before the GPU leaves.
                mig_desired = msgspec.structs.replace(desired, mig_enabled=False, mig_devices={})
            if mig_desired.mig_enabled is not None and gpu.nvml.mig_capable:
                plan = plan_gpu(gpu, mig_desired)
                if plan.infeasible:
                    return GpuState("failed", plan.infeasible)
                if plan.steps:
                    if plan.mode_change and (off := self.vgpus.vfs_off_before_mode_change(gpu)) is not None:
                        return off
                    vfs = self.vgpus.vfs_before_instances(gpu, desired)
                    if vfs is not None and not plan.mode_change:
                        return vfs
                    if vfs is not None and desired.mig_devices:  # the mode alone now, instances after the VFs
                        plan = plan_gpu(gpu, msgspec.structs.replace(mig_desired, mig_devices={}))
                    return MigAction(plan, f"{len(plan.steps)} MIG step(s)")
        bplan = plan_binding(gpu, desired.workload, drivers=frozenset(self.hw.sysfs.drivers()))
        if bplan.infeasible:
            return GpuState("failed", bplan.infeasible)
        if bplan.steps:
            return BindAction(bplan, f"bind to {target_driver}")
        return self.vgpus.creations(gpu, desired)

    # ---- execution ----------------------------------------------------------------------------
    async def converge(self) -> None:
        if self.layout is None:
            await self.refresh_async()
            self.phase = "invalid-layout"
            return
        async with self.apply_lock.held(lambda m: self.bus.publish("waiting", m)):
            self.passes += 1
            self._pass_layout = self.layout  # a reload during the pass takes effect in the next one
            try:
                await self._converge_all()
            finally:
                self._pass_layout = None
            await self.refresh_async()
        self.phase = _phase(self.gpu_states.values())
        self.reboot_policy.after_pass(self.phase)
        self.boot_rebuild.pass_ended(self.gpu_states, self.phase)
        self.completed_passes += 1
        self._notify()

    async def _converge_all(self) -> None:
        await self.refresh_async()
        resolution = self.resolution  # this pass works from one resolution, whatever refresh() does
        assert resolution is not None
        if resolution.errors:  # the host changed under a good file: change nothing
            self.phase = "invalid-layout"
            self.bus.publish("layout-invalid", "; ".join(str(e) for e in resolution.errors))
            return
        if self.udev_rules is not None and not self.read_only:
            # Before any rebind: after a reboot the override must beat the nvidia probe.
            if self.udev_rules.sync(self.observation.gpus, resolution.desired):
                self.bus.publish("udev-rules", f"{self.udev_rules.path} updated for the layout")
        todo = self._preview(resolution)
        self.boot_rebuild.will_change({g.pci: f"GPU {g.index} ({g.pci})" for g in self.observation.gpus if g.pci in todo})
        for gpu in self.observation.gpus:
            if gpu.pci not in resolution.desired:
                self._set(gpu.pci, GpuState("unmanaged", "not in the selected layout: left untouched"))
        if todo:
            await self._apply_guarded(todo, resolution)
        # the GPUs with nothing to do (re-checked)
        await for_each_gpu([p for p in sorted(resolution.desired) if p not in todo],
                           lambda pci: self._converge_one(pci, resolution.desired[pci]))

    async def _converge_one(self, pci: str, desired: DesiredGpu) -> None:
        """One GPU, inside its own safety net: its surprise must not stop the others."""
        try:
            self._set(pci, await self.reboot_policy.settle(pci, await self._converge_gpu(pci, desired), self.policy))
        except Exception as e:
            log.exception("GPU %s", pci)
            self._set(pci, GpuState("failed", f"internal error: {e}"))

    def _preview(self, resolution: Resolution) -> dict[str, Action]:
        """The GPUs a pass will change, with their first action: hooks run only when there is one."""
        todo = {}
        for gpu in self.observation.gpus:
            desired = resolution.desired.get(gpu.pci)
            if desired is not None and not self.read_only:
                action = self.next_action(gpu, desired)
                if isinstance(action, Action):
                    todo[gpu.pci] = action
        return todo

    async def _apply_guarded(self, todo: dict[str, Action], resolution: Resolution) -> None:
        """With --kube-node, the cluster's GPU operands that see a changing GPU leave the node
        first and come back after (gpud.engine.kube.operands); if they cannot, nothing is changed."""
        if self.operand_guard is None:
            await self._apply_with_hooks(todo, resolution)
            return
        try:
            async with self.operand_guard.operands_paused(impact(self.observation.gpus, resolution.desired, todo)):
                await self._apply_with_hooks(todo, resolution)
        except OperandsNotPaused as e:
            for pci in todo:
                self._set(pci, GpuState("failed", f"{e}; nothing changed"))

    async def _apply_with_hooks(self, todo: dict[str, Action], resolution: Resolution) -> None:
        """The GPUs that change, inside the layout's hook phases (see gpud.engine.hooks.phases)."""
        self._mig_changed.clear()
        layout = self._pass_layout.layout if self._pass_layout is not None else None
        assert layout is not None  # a pass runs only under a layout that parsed (run() set it)

        def abort(pci: str, failure: HookFailed) -> None:
            self._set(pci, GpuState("failed", f"hook aborted the apply, nothing changed: {failure}"))

        await apply_with_hooks(
            todo, resolution.desired, layout=layout, layout_path=self.config_path,
            apply_one=lambda pci: self._converge_one(pci, resolution.desired[pci]),
            converged=lambda pci: self.gpu_states[pci].converged,
            changed_mig=lambda: bool(self._mig_changed), abort=abort, drainer=self.drainer,
            log=lambda line: self.bus.publish("hook", line), cdi_generate=self.cdi_generate,
        )

    async def _converge_gpu(self, pci: str, desired: DesiredGpu) -> GpuState:
        for _ in range(MAX_ROUNDS):
            gpu = next((g for g in self.observation.gpus if g.pci == pci), None)
            if gpu is None:
                return GpuState("gone", "the GPU disappeared from the PCI bus")
            action = self.next_action(gpu, desired)
            if action is None:
                return GpuState("converged", _converged_message(gpu, desired))
            if isinstance(action, GpuState):
                return action
            if self.read_only:
                return GpuState("read-only", f"read-only mode: would apply {action.summary}")
            if action.kind in ("mig", "vgpu") and action.plan.blocked_by:  # nothing is touched while busy
                names = ", ".join(f"pid {h.pid} {h.name}{f' (VM {h.vm})' if h.vm else ''} on {h.device}"
                                  for h in action.plan.blocked_by)
                return self._busy(GpuState("waiting", f"waiting for {names}", tuple(action.plan.blocked_by)))
            self._set(pci, GpuState("applying", action.summary), steps=_step_count(action))
            if action.kind == "vgpu":
                outcome = await self._run_vgpu(gpu, action)
            else:
                outcome = await (self._run_mig(gpu, action.plan, desired) if action.kind == "mig"
                                 else self._run_bind(gpu, action.plan))
            if outcome.state != "converged":
                return self._busy(outcome) if outcome.state == "waiting" else outcome
            await self.refresh_async()
        return GpuState("failed", f"still not converged after {MAX_ROUNDS} rounds")

    def _busy(self, waiting: GpuState) -> GpuState:
        """Holders block a step: wait for them to exit (`on-busy: wait`) or fail (`fail`)."""
        if self.policy is not None and self.policy.on_busy == "fail":
            return GpuState("failed", f"busy (on-busy: fail): {waiting.message}", waiting.holders)
        if not waiting.holders:  # nothing's exit would ever wake the wait: never `waiting` on nothing
            return GpuState("failed", f"{waiting.message}; no process to wait for")
        self.holder_watch.watch(waiting.holders)
        return waiting

    async def _run_mig(self, gpu: Gpu, plan: GpuPlan, desired: DesiredGpu) -> GpuState:
        from gpud.engine.mig import executor as mig_executor

        loop = asyncio.get_running_loop()

        def on_step(step, result: str = "done") -> None:  # called from the worker thread
            msg = f"{step} {result}"
            loop.call_soon_threadsafe(lambda: self.bus.publish("step", msg, gpu=gpu.pci, step=event_fields(step)))

        async with self.nvml_gate.hold("open"), self._drained(gpu):
            if self.observation.nvml_stale:
                # Planned from the view another GPU's rebind left while NVML was closed: steps done
                # since would be planned again (a second create fails INSUFFICIENT_RESOURCES).
                # No unbind runs while this hold is held, so NVML can be read now: plan again.
                await self.refresh_async()
                fresh = next((g for g in self.observation.gpus if g.pci == gpu.pci), None)
                if fresh is None:
                    return GpuState("gone", "the GPU disappeared from the PCI bus")
                action = self.next_action(fresh, desired)
                if isinstance(action, GpuState):
                    return action
                if not isinstance(action, MigAction):  # nothing left for MIG: the caller's next round decides
                    return GpuState("converged", "re-read")
                plan = action.plan
            outcome = await self._in_worker(
                mig_executor.execute, self.hw.nvml, plan,
                policy_reset=self.policy.reset if self.policy else "per-gpu", on_step=on_step,
                holders=self._reset_holders,
            )
        if outcome.done:
            self._mig_changed.add(gpu.pci)
        if outcome.reset_due:
            return await self._run_reset(gpu, outcome.message)
        return GpuState(outcome.state, outcome.message, tuple(outcome.holders))

    async def _run_reset(self, gpu: Gpu, why: str) -> GpuState:
        """Reset one GPU the way the driver supports (gpud.host.nvidia_smi): policy.drain-units
        stopped, gpud's NVML session closed (no other GPU's NVML work runs meanwhile), `nvidia-smi
        -r -i <PCI>`, NVML open again and the GPU re-read. "converged" here means "go on": the
        caller plans the GPU again from what it shows now."""
        from gpud.host.deadline_write import DeadlineSysfs

        if self.hw.reset is None:
            return GpuState("reset-required", f"{why}; no reset tool is configured (--nvidia-smi)")
        resetter = self.hw.reset
        if resetter.sysfs is None:  # a function off nvidia is reset through sysfs, with a deadline
            resetter.sysfs = DeadlineSysfs(self.hw.sysfs, self.binder_timeout)

        def reset_with_nvml_closed():
            self.hw.nvml.suspend()  # nvidia-smi refuses while our own session holds the GPU
            try:
                return resetter.reset(gpu.pci, gpu.function.driver)
            finally:
                self.hw.nvml.resume()

        self.bus.publish("step", f"reset {gpu.pci}: {' '.join(resetter.argv(gpu.pci))}", gpu=gpu.pci)
        async with self.nvml_gate.hold("closed"), self._drained(gpu):
            result = await self._in_worker(reset_with_nvml_closed)
        self.bus.publish("reset", f"{'done' if result.ok else 'refused'} ({result.method}): {result.summary()}",
                         gpu=gpu.pci)
        if not result.ok:
            return self._reset_refused(gpu, why, result)
        self._mig_changed.add(gpu.pci)
        await self.refresh_async()
        after = next((g for g in self.observation.gpus if g.pci == gpu.pci), None)
        nv = after.nvml if after is not None else None
        if nv is not None and nv.mig_mode is not None and nv.mig_pending is not None and nv.mig_mode != nv.mig_pending:
            return GpuState("reboot-required", f"{why}; the reset of {gpu.pci} did not apply it "
                                               f"(mode {nv.mig_mode}, pending {nv.mig_pending}): reboot the host")
        return GpuState("converged", f"reset {gpu.pci} ({result.method})")

    def _reset_refused(self, gpu: Gpu, why: str, result) -> GpuState:
        """A refused reset: in use -> name the holders (waiting/failed per on-busy, never killed);
        refused for another reason (an NVSwitch system that resets GPUs only together, a driver
        that cannot) -> reset-required with the tool's words, or the reboot policy."""
        if result.in_use:
            holders = self._device_holders(gpu.pci)
            seen = {h.pid for h in holders}
            holders += [h for h in self.hw.procs.running(KNOWN_HOLDERS) if h.pid not in seen]
            if holders:
                names = ", ".join(f"pid {h.pid} {h.name}" for h in holders)
                return self._busy(GpuState("waiting", f"{why}; {result.summary()}; held by {names}", tuple(holders)))
            return GpuState("failed", f"{why}; {result.summary()}; no process holding it was found "
                                      f"(a kernel client such as nvidia_drm may hold it)")
        state: GpuStateName = (
            "reboot-required" if self.policy is not None and self.policy.reboot == "allow" else "reset-required")
        return GpuState(state, f"{why}; the reset was refused: {result.summary()}")

    async def _run_vgpu(self, gpu: Gpu, action: VgpuAction) -> GpuState:
        loop = asyncio.get_running_loop()

        def on_step(step) -> None:  # called from the worker thread: one event per vGPU
            line, data = step_event(step)
            loop.call_soon_threadsafe(lambda: self.bus.publish("vgpu", line, gpu=gpu.pci, step=data))

        if not changes_vfs(action):
            return await self._in_worker(self.vgpus.run, gpu, action, on_step)

        def run_with_nvml_closed() -> GpuState:
            self.hw.nvml.suspend()  # sriov-manage's unbind lock is refused while our session holds the GPU
            try:
                return self.vgpus.run(gpu, action, on_step, holders=self._lock_holders)
            finally:
                self.hw.nvml.resume()

        async with self.nvml_gate.hold("closed"), self._drained(gpu):
            return await self._in_worker(run_with_nvml_closed)

    def _lock_holders(self, pci: str) -> list[Holder]:
        """What keeps the driver's unbind lock from gpud: device node holders, else known services."""
        holders = self._device_holders(pci)
        seen = {h.pid for h in holders}
        return holders + [h for h in self.hw.procs.running(KNOWN_HOLDERS) if h.pid not in seen]

    def _device_holders(self, pci: str) -> list[Holder]:
        """Processes with the GPU's device node open (persistenced, DCGM, X, CUDA): a reset must
        wait for them. gpud's own NVML session is not one of them."""
        minor = self.hw.procs.nvidia_minor(pci)
        if minor is None:
            return []
        return [h for h in self.hw.procs.holders([f"/dev/nvidia{minor}"]) if h.pid != os.getpid()]

    def _reset_holders(self, pci: str) -> list[Holder]:
        """Holders a reset waits for: not nvidia-persistenced, whose hold on this GPU ends when the
        reset turns persistence off for it (`nvidia-smi -pm 0 -i <PCI>`, gpud.host.nvidia_smi)."""
        return [h for h in self._device_holders(pci) if not PERSISTENCED.startswith(h.name or "-")]

    def rebind_holders(self, gpu: Gpu) -> tuple[Holder, ...]:
        """Who loses the GPU when it leaves its driver (for `gpudctl plan`): processes with its
        device node or its IOMMU group's /dev/vfio node open, and NVML's processes on it and its
        MIG devices. gpud itself is not one of them."""
        found: dict[int, Holder] = {}
        paths = []
        minor = self.hw.procs.nvidia_minor(gpu.pci) if gpu.function.driver == "nvidia" else None
        if minor is not None:
            paths.append(f"/dev/nvidia{minor}")
        if gpu.function.driver == "vfio-pci":
            if gpu.function.iommu_group is not None:
                paths.append(f"/dev/vfio/{gpu.function.iommu_group}")
            device_dir = os.path.join(self.hw.sysfs.root, "bus/pci/devices", gpu.pci)
            paths += [f"/dev/vfio/devices/{n}" for n in vfio_cdevs(device_dir)]  # an iommufd VMM's
        listed = list(self.hw.procs.holders(paths)) if paths else []
        if gpu.nvml is not None:
            listed += list(gpu.nvml.processes) + [h for gi in gpu.nvml.instances for h in gi.holders]
        for h in listed:
            if h.pid != os.getpid():
                found.setdefault(h.pid, h)
        return tuple(found[pid] for pid in sorted(found))

    async def _in_worker(self, fn, *args, **kwargs):
        """Run a hardware step in a worker thread. The step itself is never abandoned half-way:
        a cancelled pass (gpud stopping) still lets it finish, and `finish_steps` waits for it."""
        fut = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return await asyncio.shield(fut)

    async def finish_steps(self, timeout: float) -> bool:
        """On stop: wait for hardware steps still running, before NVML is closed under them."""
        if not self._inflight:
            return True
        _, pending = await asyncio.wait(set(self._inflight), timeout=timeout)
        return not pending

    async def _run_bind(self, gpu: Gpu, plan: BindingPlan) -> GpuState:
        from gpud.engine.binding import binder

        suspended: list[bool] = []

        def before_unbind() -> None:  # called from the worker thread, at most once per run
            self.hw.nvml.suspend()  # our own handle must not be what keeps the GPU busy
            suspended.append(True)

        # Leaving nvidia needs NVML closed: wait for NVML work on other GPUs, and keep it off meanwhile.
        use: Literal["closed"] | None = "closed" if gpu.function.driver == "nvidia" else None
        async with (self.nvml_gate.hold(use) if use else contextlib.nullcontext()), self._drained(gpu):
            try:
                outcome = await self._in_worker(
                    binder.execute, self.hw.sysfs, self.hw.procs, plan,
                    before_unbind=before_unbind, timeout=self.binder_timeout,
                )
            finally:
                if suspended:
                    self.hw.nvml.resume()  # reads open NVML again on demand, once no rebind needs it closed
        self.bus.publish("bind", f"{outcome.state}: {outcome.message}", gpu=gpu.pci)
        return GpuState(outcome.state, outcome.message, tuple(outcome.holders))

    @contextlib.asynccontextmanager
    async def _drained(self, gpu: Gpu):
        """Stop the GPU client units the policy names around a disruptive step, and start again
        what was stopped, also when the step failed."""
        units = list(self.policy.drain_units) if self.policy is not None else []
        if not units:
            yield
            return
        if self.drainer is None:
            raise RuntimeError(f"policy.drain-units {units} needs the system D-Bus, which is not reachable")
        async with self.shared_drain.drained(self.drainer, units):
            yield

    def _set(self, pci: str, st: GpuState, **data) -> None:
        old = self.gpu_states.get(pci)
        self.gpu_states[pci] = st
        if old is None or (old.state, old.message) != (st.state, st.message):
            self.bus.publish(st.state, st.message, gpu=pci, **data)
            self._notify()

    def _holder_exited(self, pid: int) -> None:  # called once per process (HolderWatch)
        self.bus.publish("holder-exited", f"pid {pid} exited")
        self.kick(f"pid {pid} exited")

    def summary(self) -> str:
        """One line for systemd's STATUS=: the GPUs on the bus by state ("3/3 GPUs converged" when
        all are), then the GPUs gone from it, which are not counted against those present."""
        present = {g.pci for g in self.observation.gpus}
        states = [s for pci, s in self.gpu_states.items() if pci in present]
        gone = sum(1 for pci, s in self.gpu_states.items() if pci not in present and s.state == "gone")
        n = len(present)
        counts: dict[str, int] = {}
        for s in states:
            counts[s.state] = counts.get(s.state, 0) + 1
        parts = [f"{v} {k}" for k, v in sorted(counts.items())]
        waiting = next((s for s in states if s.state == "waiting" and s.holders), None)
        if n and counts == {"converged": n}:
            line = f"{n}/{n} GPUs converged"
        else:
            line = f"{n} GPUs: " + (", ".join(parts) if parts else "starting")
        if gone:
            line += f", {gone} gone"
        if waiting:
            line += f" (waiting for pid {waiting.holders[0].pid})"
        if self.layout_issues[0]:
            line += "; layout.yaml invalid, keeping the last good layout"
        return line


def _phase(states: Iterable[GpuState]) -> str:
    names = {s.state for s in states}
    for phase in PHASE_ORDER:
        if phase in names:
            return phase
    return "converged"


def _boot_id(path: str | None) -> str | None:
    """This boot's id, or None when it cannot be read (nothing is then claimed about a reboot)."""
    if path is None:
        return None
    try:
        return current_boot_id(path)
    except OSError as e:
        log.warning("boot id unreadable at %s: %s", path, e)
        return None


def _gone_message(known: KnownGpu) -> str:
    return (f"GPU {known.index} ({known.pci}, {known.model}"
            + (f", {known.uuid}" if known.uuid else "")
            + f") is gone from the PCI bus; it keeps index {known.index} and no other GPU takes its entry")


def _step_count(action: Action) -> int:
    """How many steps this action runs (apply --wait's `[3/7]`): a vGPU action runs one phase."""
    if isinstance(action, VgpuAction):
        return len({"removals": action.plan.removals, "creations": action.plan.creations}[action.phase])
    return len(action.plan.steps)


def _converged_message(gpu: Gpu, desired: DesiredGpu) -> str:
    if desired.workload == "vm-passthrough":
        return f"on vfio-pci (IOMMU group {gpu.function.iommu_group})"
    if desired.workload == "vm-vgpu":
        devices = gpu.vgpu.devices if gpu.vgpu is not None else ()
        counts: dict[str, int] = {}
        for d in devices:
            counts[d.type] = counts.get(d.type, 0) + 1
        kinds = " ".join(f"{n}x{t}" for t, n in sorted(counts.items())) or "none"
        return f"vGPUs ({gpu.vgpu.interface if gpu.vgpu else 'no interface'}): {kinds}"
    if gpu.nvml is not None and gpu.nvml.mig_mode:
        n = len(gpu.nvml.instances)
        return f"MIG on, {n} GPU instance{'' if n == 1 else 's'}"
    return "whole GPU"
