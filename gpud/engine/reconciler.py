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
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from gpud.engine.apply_lock import ApplyLock
from gpud.engine.events import EventBus, event_fields
from gpud.engine.gpu_state import PHASE_ORDER, Action, BindAction, GpuState, MigAction, VgpuAction
from gpud.engine.holder_watch import HolderWatch
from gpud.engine.hooked_apply import apply_with_hooks
from gpud.engine.hooks import HookFailed
from gpud.engine.layout_keeper import LayoutKeeper
from gpud.engine.observe import Observation, observe
from gpud.engine.ports import BootOverrides, Drainer, Rebooter
from gpud.engine.reboot_policy import RebootPolicy
from gpud.engine.scheduler import PassScheduler
from gpud.engine.vgpu_keeper import NAMES_FILE, VgpuKeeper, step_event
from gpud.host.nvml import Nvml
from gpud.host.procs import Procs
from gpud.host.sysfs import Sysfs
from gpud.host.vgpu_sysfs import VgpuSysfs
from gpud.layout.desired import DesiredGpu
from gpud.layout.parse import ParsedLayout
from gpud.layout.resolve import Resolution, resolve
from gpud.layout.schema import MatchRule, Policy
from gpud.model import Gpu, Holder, NvmlGpu
from gpud.plan.binding import BindingPlan, plan_binding
from gpud.plan.mig import GpuPlan, plan_gpu

log = logging.getLogger(__name__)

MAX_ROUNDS = 8  # vGPUs off -> MIG off -> rebind -> MIG on -> VFs on -> vGPUs on is six; spares


class Hardware(msgspec.Struct):
    """The adapters one daemon drives, chosen once at start (real host or simulator)."""

    sysfs: Sysfs
    nvml: Nvml
    procs: Procs


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
    ) -> None:
        self.hw = hardware
        self.config_path = config_path
        self.apply_lock = apply_lock
        self.bus = bus
        self.read_only = read_only
        self.drainer = drainer  # None: no system bus (the daemon may connect one later)
        self.binder_timeout = binder_timeout
        self.udev_rules = udev_rules  # boot-time vfio overrides
        self.reboot_policy = RebootPolicy(rebooter=rebooter, state_dir=state_dir, read_only=read_only, bus=bus)
        self.layout_file = LayoutKeeper(config_path, bus, self._observe)
        self.scheduler = PassScheduler()
        self.holder_watch = HolderWatch(self._holder_exited)
        self._pass_layout: ParsedLayout | None = None  # the layout a running pass started with
        self._inflight: set[asyncio.Future] = set()  # hardware steps running in worker threads
        self._mig_changed: set[str] = set()  # GPUs whose MIG devices changed in this pass
        self._last_nvml: dict[str, NvmlGpu] = {}  # PCI -> the last NvmlGpu read without error
        self.resolution: Resolution | None = None
        self.observation = Observation(gpus=(), functions=())
        self.gpu_states: dict[str, GpuState] = {}
        self.phase = "starting"
        self.passes = 0
        self._listeners: list[Callable[[], None]] = []
        self.vgpus = VgpuKeeper(VgpuSysfs(hardware.sysfs, hardware.procs,
                                          names_file=os.path.join(state_dir, NAMES_FILE) if state_dir else None),
                                state_dir if not read_only else None)

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
        """Read and parse the file; a bad file never replaces the last good layout."""
        return self.layout_file.load()

    def evaluate(self, text: str, path: str) -> tuple[ParsedLayout, Resolution, Observation]:
        """Parse a layout text and resolve it against this host as that layout's own `match:` sees it."""
        return self.layout_file.evaluate(text, path)

    def _observe(self, match: tuple[MatchRule, ...]) -> Observation:
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
        return self._with_vgpus(msgspec.structs.replace(obs, gpus=gpus))

    def _with_vgpus(self, obs: Observation) -> Observation:
        """Each GPU's vGPU side, from sysfs (either interface, found per GPU)."""
        return msgspec.structs.replace(obs, gpus=tuple(self.vgpus.observe(g) for g in obs.gpus))

    def reload(self, reason: str) -> bool:
        """Re-read the file; a valid one starts a pass. False when the file was refused."""
        ok = self.load_config()
        if ok:
            self.kick(reason)
        return ok

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
        except Exception:
            log.exception("reconcile pass failed")
            self.phase = "failed"
            self.bus.publish("error", "internal error in the reconcile pass; see the journal")

    # ---- observation ------------------------------------------------------------------------
    def refresh(self) -> Observation:
        """Re-read the host; runs on the event loop on purpose: a hung driver stalls the loop and
        the systemd watchdog restarts us, instead of serving stale state forever."""
        self.observation = self._observe(self.layout_file.match)
        if self.layout is not None:
            self.resolution = resolve(self.layout, self.observation.gpus)
        present = {g.pci for g in self.observation.gpus}
        for pci, st in list(self.gpu_states.items()):
            if pci not in present and st.state != "gone":
                self.gpu_states[pci] = GpuState("gone", "the GPU disappeared from the PCI bus")
                self.bus.publish("gpu-gone", "GPU removed", gpu=pci)
        self._notify()
        return self.observation

    def _notify(self) -> None:
        for cb in self._listeners:
            cb()

    def desired_for(self, gpu: Gpu) -> DesiredGpu | None:
        return self.resolution.desired.get(gpu.pci) if self.resolution is not None else None

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
            self.refresh()
            self.phase = "invalid-layout"
            return
        async with self.apply_lock.held(lambda m: self.bus.publish("waiting", m)):
            self.passes += 1
            self._pass_layout = self.layout  # a reload during the pass takes effect in the next one
            try:
                await self._converge_all()
            finally:
                self._pass_layout = None
            self.refresh()
        self.phase = _phase(self.gpu_states.values())
        self.reboot_policy.after_pass(self.phase)
        self._notify()

    async def _converge_all(self) -> None:
        self.refresh()
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
        for gpu in self.observation.gpus:
            if gpu.pci not in resolution.desired:
                self._set(gpu.pci, GpuState("unmanaged", "not in the selected layout: left untouched"))
        if todo:
            await self._apply_with_hooks(todo, resolution)
        for pci, desired in resolution.desired.items():  # the GPUs with nothing to do (re-checked)
            if pci not in todo:
                await self._converge_one(pci, desired)

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

    async def _apply_with_hooks(self, todo: dict[str, Action], resolution: Resolution) -> None:
        """The GPUs that change, inside the layout's hook phases (see gpud.engine.hooked_apply)."""
        self._mig_changed.clear()

        def abort(pci: str, failure: HookFailed) -> None:
            self._set(pci, GpuState("failed", f"hook aborted the apply, nothing changed: {failure}"))

        await apply_with_hooks(
            todo, resolution.desired, layout=self._pass_layout.layout, layout_path=self.config_path,
            apply_one=lambda pci: self._converge_one(pci, resolution.desired[pci]),
            converged=lambda pci: self.gpu_states[pci].converged,
            changed_mig=lambda: bool(self._mig_changed), abort=abort, drainer=self.drainer,
            log=lambda line: self.bus.publish("hook", line),
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
            self._set(pci, GpuState("applying", action.summary))
            if action.kind == "vgpu":
                outcome = await self._run_vgpu(gpu, action)
            else:
                outcome = await (self._run_mig(gpu, action.plan) if action.kind == "mig" else self._run_bind(gpu, action.plan))
            if outcome.state != "converged":
                return self._busy(outcome) if outcome.state == "waiting" else outcome
            self.refresh()
        return GpuState("failed", f"still not converged after {MAX_ROUNDS} rounds")

    def _busy(self, waiting: GpuState) -> GpuState:
        """Holders block a step: wait for them to exit (`on-busy: wait`) or fail (`fail`)."""
        if self.policy is not None and self.policy.on_busy == "fail":
            return GpuState("failed", f"busy (on-busy: fail): {waiting.message}", waiting.holders)
        self.holder_watch.watch(waiting.holders)
        return waiting

    async def _run_mig(self, gpu: Gpu, plan: GpuPlan) -> GpuState:
        from gpud.engine import mig_executor
        from gpud.host.deadline_write import DeadlineSysfs

        loop = asyncio.get_running_loop()

        def on_step(step, result: str = "done") -> None:  # called from the worker thread
            msg = f"{step.action} {step.profile or ''} {result}".strip()
            loop.call_soon_threadsafe(lambda: self.bus.publish("step", msg, gpu=gpu.pci, step=event_fields(step)))

        async with self._drained(gpu):
            outcome = await self._in_worker(
                mig_executor.execute, self.hw.nvml, plan, sysfs=DeadlineSysfs(self.hw.sysfs, self.binder_timeout),
                policy_reset=self.policy.reset if self.policy else "per-gpu", on_step=on_step,
                holders=self._device_holders,
            )
        if outcome.done:
            self._mig_changed.add(gpu.pci)
        return GpuState(outcome.state, outcome.message, tuple(outcome.holders))

    async def _run_vgpu(self, gpu: Gpu, action: VgpuAction) -> GpuState:
        loop = asyncio.get_running_loop()

        def on_step(step) -> None:  # called from the worker thread: one event per vGPU
            line, data = step_event(step)
            loop.call_soon_threadsafe(lambda: self.bus.publish("vgpu", line, gpu=gpu.pci, step=data))

        return await self._in_worker(self.vgpus.run, gpu, action, on_step)

    def _device_holders(self, pci: str) -> list[Holder]:
        """Processes with the GPU's device node open (persistenced, DCGM, X, CUDA): a reset must
        wait for them. gpud's own NVML session is not one of them."""
        minor = self.hw.procs.nvidia_minor(pci)
        if minor is None:
            return []
        return [h for h in self.hw.procs.holders([f"/dev/nvidia{minor}"]) if h.pid != os.getpid()]

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
        from gpud.engine import binder

        def before_unbind() -> None:
            self.hw.nvml.suspend()  # our own handle must not be what keeps the GPU busy

        async with self._drained(gpu):
            try:
                outcome = await self._in_worker(
                    binder.execute, self.hw.sysfs, self.hw.procs, plan,
                    before_unbind=before_unbind, timeout=self.binder_timeout,
                )
            finally:
                self.hw.nvml.resume()  # reads open NVML again on demand
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
        async with self.drainer.drained(units):
            yield

    def _set(self, pci: str, st: GpuState) -> None:
        old = self.gpu_states.get(pci)
        self.gpu_states[pci] = st
        if old is None or (old.state, old.message) != (st.state, st.message):
            self.bus.publish(st.state, st.message, gpu=pci)
            self._notify()

    def _holder_exited(self, pid: int) -> None:
        self.bus.publish("holder-exited", f"pid {pid} exited")
        self.kick(f"pid {pid} exited")

    def summary(self) -> str:
        """One line for systemd's STATUS=."""
        states = list(self.gpu_states.values())
        n = len(self.observation.gpus)
        counts: dict[str, int] = {}
        for s in states:
            counts[s.state] = counts.get(s.state, 0) + 1
        parts = [f"{v} {k}" for k, v in sorted(counts.items())]
        waiting = next((s for s in states if s.state == "waiting" and s.holders), None)
        line = f"{n} GPUs: " + (", ".join(parts) if parts else "starting")
        if waiting:
            line += f" (waiting for pid {waiting.holders[0].pid})"
        if self.layout_issues[0]:
            line += "; layout.yaml invalid, keeping the last good layout"
        return line


def _phase(states: Iterable[GpuState]) -> str:
    states = [s.state for s in states]
    for phase in PHASE_ORDER:
        if phase in states:
            return phase
    return "converged"


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
        return f"MIG: {len(gpu.nvml.instances)} GPU instance(s)"
    return "whole GPU"
