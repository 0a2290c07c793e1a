"""The reconcile loop: observe -> resolve -> plan -> execute per GPU -> re-observe, one pass at a time.

Each GPU converges on its own: one GPU's failure or wait never stops the others. A pass is
re-entrant: it recomputes what is left from what the hardware says now, so a wait that ends, an
event from udev, a daemon restart or an edit of the file all lead to the same place. Nothing is
ever killed: busy GPUs wait (or fail, by policy) and name their holders.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from gpud.engine.events import EventBus
from gpud.engine.observe import Observation, observe
from gpud.host.nvml import Nvml
from gpud.host.procs import Procs
from gpud.host.sysfs import Sysfs
from gpud.layout.desired import DesiredGpu
from gpud.layout.match import DEFAULT_MATCH
from gpud.layout.parse import ParsedLayout, parse_layout
from gpud.layout.resolve import Resolution, resolve
from gpud.model import Gpu, Holder
from gpud.plan.binding import plan_binding
from gpud.plan.mig import GpuPlan, plan_gpu

log = logging.getLogger(__name__)

MAX_ROUNDS = 4  # MIG off -> rebind -> MIG on is three; one spare


class GpuState(msgspec.Struct, frozen=True):
    """What the engine last concluded about one GPU."""

    state: str  # converged | applying | waiting | failed | stuck | reset-required | reboot-required | unmanaged | read-only | gone
    message: str = ""
    holders: tuple[Holder, ...] = ()

    @property
    def converged(self) -> bool:
        return self.state in ("converged", "unmanaged")


class Action(msgspec.Struct, frozen=True):
    kind: str  # "mig" | "bind"
    plan: Any
    summary: str


class Hardware(msgspec.Struct):
    """The adapters one daemon drives, chosen once at start (real host or simulator)."""

    sysfs: Sysfs
    nvml: Nvml
    procs: Procs


class ApplyLock:
    """Host-wide apply lock (flock): two daemons on one host must never both change it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @contextlib.asynccontextmanager
    async def held(self, on_wait: Callable[[str], None]):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                on_wait(f"another gpud (pid {holder}) is applying; waiting for {self.path}")
                await self._wait(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the flock

    @staticmethod
    async def _wait(fd: int, interval: float = 0.5) -> None:
        """Retry the lock (not the hardware) until the other daemon's apply ends; unlike a thread
        parked in flock(), this can be cancelled when gpud stops."""
        while True:
            await asyncio.sleep(interval)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                continue


class Reconciler:
    def __init__(
        self,
        hardware: Hardware,
        *,
        config_path: str,
        apply_lock: ApplyLock,
        bus: EventBus,
        read_only: bool = False,
        drainer=None,
        binder_timeout: float = 30.0,
        udev_rules=None,
        state_dir: str | None = None,
        rebooter=None,
    ) -> None:
        self.hw = hardware
        self.config_path = config_path
        self.apply_lock = apply_lock
        self.bus = bus
        self.read_only = read_only
        self.drainer = drainer  # gpud.host.unit_drain.UnitDrainer or None (no system bus)
        self.binder_timeout = binder_timeout
        self.udev_rules = udev_rules  # gpud.engine.udev_rules.UdevRules: boot-time vfio overrides
        self.state_dir = state_dir  # where the reboot marker lives
        self.rebooter = rebooter  # async (state_dir, reason) -> bool; logind on a real host
        self._reboot_reported: tuple | None = None
        self._pass_layout: ParsedLayout | None = None  # the layout a running pass started with
        self._inflight: set[asyncio.Future] = set()  # hardware steps running in worker threads
        self._mig_changed: set[str] = set()  # GPUs whose MIG devices changed in this pass
        self._last_nvml: dict[str, Any] = {}  # PCI -> the last NvmlGpu read without error
        self.layout: ParsedLayout | None = None  # the last good layout in force
        self.layout_issues: tuple[list[str], list[str]] = ([], [])  # (errors, warnings) of the file as it is now
        self.resolution: Resolution | None = None
        self.observation = Observation(gpus=(), functions=())
        self.gpu_states: dict[str, GpuState] = {}
        self.phase = "starting"
        self.passes = 0
        self._kick = asyncio.Event()
        self._requested = 0
        self._completed = 0
        self._done = asyncio.Condition()
        self._pid_watches: dict[int, int] = {}
        self._listeners: list[Callable[[], None]] = []

    # ---- the file -------------------------------------------------------------------------
    def load_config(self) -> bool:
        """Read and parse the file; a bad file never replaces the last good layout."""
        try:
            text = Path(self.config_path).read_text()
        except FileNotFoundError:
            self.layout_issues = ([f"{self.config_path}: file not found; keeping the last good layout"], [])
            self.bus.publish("layout-invalid", self.layout_issues[0][0])
            return False
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else f"not UTF-8 text ({e.reason} at byte {e.start})"
            self.layout_issues = ([f"{self.config_path}: {why}; keeping the last good layout"], [])
            self.bus.publish("layout-invalid", self.layout_issues[0][0])
            return False
        parsed, resolution, _ = self.evaluate(text, self.config_path)
        errors = [str(i) for i in resolution.errors]  # parse errors included: one full report
        warnings = [str(i) for i in resolution.warnings]
        if errors:
            self.layout_issues = (errors, warnings)
            self.bus.publish("layout-invalid", f"{len(errors)} error(s); keeping the last good layout",
                             errors=errors)
            return False
        self.layout = parsed
        self.layout_issues = ([], warnings)
        self.bus.publish("layout-loaded", f"{self.config_path}: selected {parsed.layout.selected!r}")
        return True

    def evaluate(self, text: str, path: str) -> tuple[ParsedLayout, Resolution, Observation]:
        """Parse a layout text and resolve it against this host as that layout's own `match:` sees
        it: selectors and profile names are checked against the real GPUs before the file is taken."""
        parsed = parse_layout(text, path)
        candidate = parsed.layout or parsed.draft
        match = candidate.match if candidate is not None and candidate.match else DEFAULT_MATCH
        obs = self._observe(match)
        return parsed, resolve(parsed, obs.gpus), obs

    def _observe(self, match) -> Observation:
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
                return obs
        else:
            return obs  # NVML is really unavailable (no driver): status says so
        obs = observe(self.hw.sysfs, None, match)
        gpus = tuple(msgspec.structs.replace(g, nvml=self._last_nvml.get(g.pci)) if g.function.driver == "nvidia"
                     else g for g in obs.gpus)
        return msgspec.structs.replace(obs, gpus=gpus)

    def reload(self, reason: str) -> bool:
        """Re-read the file; a valid one starts a pass. False when the file was refused."""
        ok = self.load_config()
        if ok:
            self.kick(reason)
        return ok

    @property
    def match(self):
        if self.layout is not None and self.layout.layout is not None and self.layout.layout.match:
            return self.layout.layout.match
        return DEFAULT_MATCH

    @property
    def policy(self):
        layout = self._pass_layout or self.layout
        return layout.layout.policy if layout is not None and layout.layout is not None else None

    # ---- scheduling -------------------------------------------------------------------------
    def kick(self, reason: str) -> int:
        """Ask for a pass; returns the ticket a caller can wait on with `wait_for`."""
        self._requested += 1
        log.debug("pass requested: %s", reason)
        self._kick.set()
        return self._requested

    async def wait_for(self, ticket: int, timeout: float | None = None) -> bool:
        async def _wait() -> None:
            async with self._done:
                await self._done.wait_for(lambda: self._completed >= ticket)

        try:
            await asyncio.wait_for(_wait(), timeout)
            return True
        except TimeoutError:
            return False

    def on_change(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    async def run(self, debounce: float = 0.2) -> None:
        """The one task that runs passes; requests that arrive during a pass coalesce into the next."""
        while True:
            await self._kick.wait()
            await asyncio.sleep(debounce)  # coalesce bursts (editor saves, udev storms)
            self._kick.clear()
            target = self._requested
            try:
                await self.converge()
            except Exception:
                log.exception("reconcile pass failed")
                self.phase = "failed"
                self.bus.publish("error", "internal error in the reconcile pass; see the journal")
            async with self._done:
                self._completed = max(self._completed, target)
                self._done.notify_all()

    # ---- observation ------------------------------------------------------------------------
    def refresh(self) -> Observation:
        """Re-read the host; runs on the event loop on purpose: a hung driver stalls the loop and
        the systemd watchdog restarts us, instead of serving stale state forever."""
        self.observation = self._observe(self.match)
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
                    return Action("mig", plan, f"{len(plan.steps)} MIG step(s)")
        bplan = plan_binding(gpu, desired.workload, drivers=frozenset(self.hw.sysfs.drivers()))
        if bplan.infeasible:
            return GpuState("failed", bplan.infeasible)
        if bplan.steps:
            return Action("bind", bplan, f"bind to {target_driver}")
        return None

    def plan_all(self, resolution: Resolution | None = None, observation: Observation | None = None) -> dict[str, Any]:
        """What a pass would do now, without doing it (`gpudctl plan`). A candidate file is planned
        against the GPUs its own `match:` selects (`observation` from `evaluate`)."""
        resolution = resolution or self.resolution
        out: dict[str, Any] = empty_plan()
        if resolution is None:
            return out
        out["warnings"] = [str(w) for w in resolution.warnings]
        for gpu in (observation or self.observation).gpus:
            desired = resolution.desired.get(gpu.pci)
            if desired is None:
                continue
            entry = {"index": gpu.index, "pci": gpu.pci, "steps": [], "infeasible": None, "blocked_by": []}
            action = self.next_action(gpu, desired)
            if isinstance(action, GpuState):
                entry["infeasible"] = action.message
            elif isinstance(action, Action) and action.kind == "mig":
                plan: GpuPlan = action.plan
                entry["steps"] = [_step_dict(s) for s in plan.steps]
                entry["blocked_by"] = [msgspec.to_builtins(h) for h in plan.blocked_by]
                d = out["disruption"]
                d["destroyed"] += [msgspec.to_builtins(x) for x in plan.destroyed]
                if plan.mode_change:
                    d["mode_changes"].append(gpu.pci)
                if plan.reset:
                    d["resets"].append(gpu.pci)
                if desired.workload == "vm-passthrough":
                    entry["steps"].append({"action": "bind", "driver": "vfio-pci"})
            elif isinstance(action, Action):
                entry["steps"] = [msgspec.to_builtins(s) for s in action.plan.steps]
                if desired.workload == "container" and desired.mig_enabled is not None:
                    entry["steps"].append({"action": "then-mig", "message": "MIG is planned once nvidia has the GPU"})
            out["gpus"].append(entry)
        return out

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
        self.after_reboot()
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
            self._set(pci, await self._reboot_policy(pci, await self._converge_gpu(pci, desired)))
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
        """mig-parted's hook phases around the GPUs that change; a failing before-hook aborts the apply."""
        from gpud.engine.hooks import ApplyInfo, HookFailed, Hooks, refresh_cdi

        layout = self._pass_layout.layout
        hooks = Hooks.from_config(layout.hooks, log=lambda line: self.bus.publish("hook", line))
        # A GPU coming back from vfio-pci gets its MIG layout after the rebind: count it now.
        comes_back_with_mig = [p for p, a in todo.items() if a.kind == "bind" and resolution.desired[p].mig_enabled]
        mode_change = bool(comes_back_with_mig) or any(a.kind == "mig" and a.plan.mode_change for a in todo.values())
        mig_config = bool(comes_back_with_mig) or any(a.kind == "mig" for a in todo.values())
        info = ApplyInfo(layout=self.config_path, selected=layout.selected or "", gpus=sorted(todo),
                         mode_change=mode_change)
        self._mig_changed.clear()
        done: set[str] = set()
        try:
            async with hooks.around_apply(info) as info:
                if mode_change:
                    await hooks.run("pre-apply-mode", info)
                if mig_config:
                    await hooks.run("pre-apply-config", info)
                for pci in sorted(todo):
                    done.add(pci)
                    await self._converge_one(pci, resolution.desired[pci])
                info.changed_mig = bool(self._mig_changed)
                failed = [p for p in todo if not self.gpu_states[p].converged]
                if failed:
                    info.result, info.error = "failure", f"{len(failed)} GPU(s) not converged"
        except HookFailed as e:
            for pci in set(todo) - done:
                self._set(pci, GpuState("failed", f"hook aborted the apply, nothing changed: {e}"))
            return
        if info.changed_mig and self.drainer is not None:
            await refresh_cdi(self.drainer, log=lambda line: self.bus.publish("hook", line))

    async def _reboot_policy(self, pci: str, st: GpuState) -> GpuState:
        """`policy.reboot: allow`: ask for one reboot when only a reboot can settle a mode change.
        The marker in the state dir stops a second reboot for a change the first did not fix."""
        if st.state != "reboot-required" or self.policy is None or self.policy.reboot != "allow":
            return st
        if self.rebooter is None or self.state_dir is None or self.read_only:
            return GpuState(st.state, f"{st.message}; policy allows a reboot, but logind is not reachable", st.holders)
        if await self.rebooter(self.state_dir, f"{pci}: {st.message}"):
            self.bus.publish("reboot", f"reboot requested from logind: {st.message}", gpu=pci)
            return GpuState(st.state, f"{st.message}; reboot requested", st.holders)
        return GpuState(st.state, f"{st.message}; an earlier reboot did not settle it, not rebooting again "
                                  f"(remove {self.state_dir}/reboot-request.json after fixing the cause)", st.holders)

    def after_reboot(self) -> None:
        """On start: say whether the reboot gpud asked for settled what it was for; clear the
        marker once the host converged, keep it (no second reboot) while it did not."""
        from gpud.host.logind import clear_reboot_request, reboot_outcome

        if self.state_dir is None or self.read_only:
            return
        record = reboot_outcome(self.state_dir)
        if record is None or not record.rebooted or self._reboot_reported == (record.requested_at, self.phase):
            return
        self._reboot_reported = (record.requested_at, self.phase)
        if self.phase == "converged":
            clear_reboot_request(self.state_dir)
            self.bus.publish("reboot", f"the reboot settled it: {record.reason}")
        else:
            self.bus.publish("reboot", f"the reboot did not settle it: {record.reason}")

    async def _converge_gpu(self, pci: str, desired: DesiredGpu) -> GpuState:
        for _ in range(MAX_ROUNDS):
            gpu = next((g for g in self.observation.gpus if g.pci == pci), None)
            if gpu is None:
                return GpuState("gone", "the GPU disappeared from the PCI bus")
            action = self.next_action(gpu, desired)
            if action is None:
                if desired.workload == "vm-vgpu":
                    return GpuState("failed", "vm-vgpu: the GPU is on nvidia, but creating vGPU types is not "
                                              "supported by this version of gpud")
                return GpuState("converged", _converged_message(gpu, desired))
            if isinstance(action, GpuState):
                return action
            if self.read_only:
                return GpuState("read-only", f"read-only mode: would apply {action.summary}")
            if action.kind == "mig" and action.plan.blocked_by:  # nothing is touched while busy
                names = ", ".join(f"pid {h.pid} {h.name} on {h.device}" for h in action.plan.blocked_by)
                return self._busy(GpuState("waiting", f"waiting for {names}", tuple(action.plan.blocked_by)))
            self._set(pci, GpuState("applying", action.summary))
            outcome = await (self._run_mig(gpu, action.plan) if action.kind == "mig" else self._run_bind(gpu, action.plan))
            if outcome.state != "converged":
                return self._busy(outcome) if outcome.state == "waiting" else outcome
            self.refresh()
        return GpuState("failed", f"still not converged after {MAX_ROUNDS} rounds")

    def _busy(self, waiting: GpuState) -> GpuState:
        """Holders block a step: wait for them to exit (`on-busy: wait`) or fail (`fail`)."""
        if self.policy is not None and self.policy.on_busy == "fail":
            return GpuState("failed", f"busy (on-busy: fail): {waiting.message}", waiting.holders)
        self._watch_holders(waiting.holders)
        return waiting

    async def _run_mig(self, gpu: Gpu, plan: GpuPlan) -> GpuState:
        from gpud.engine import mig_executor
        from gpud.host.deadline_write import DeadlineSysfs

        loop = asyncio.get_running_loop()

        def on_step(step, result: str = "done") -> None:  # called from the worker thread
            msg = f"{step.action} {step.profile or ''} {result}".strip()
            loop.call_soon_threadsafe(lambda: self.bus.publish("step", msg, gpu=gpu.pci, step=_step_dict(step)))

        async with self._drained(gpu):
            outcome = await self._in_worker(
                mig_executor.execute, self.hw.nvml, plan, sysfs=DeadlineSysfs(self.hw.sysfs, self.binder_timeout),
                policy_reset=self.policy.reset if self.policy else "per-gpu", on_step=on_step,
                holders=self._device_holders,
            )
        if outcome.done:
            self._mig_changed.add(gpu.pci)
        return GpuState(outcome.state, outcome.message, tuple(outcome.holders))

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

    async def _run_bind(self, gpu: Gpu, plan) -> GpuState:
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

    def _watch_holders(self, holders) -> None:
        """Wake a pass when a holder exits: pidfds make that an event, not a poll."""
        loop = asyncio.get_running_loop()
        for h in holders:
            if h.pid in self._pid_watches:
                continue
            try:
                fd = os.pidfd_open(h.pid)
            except OSError:
                continue  # not a process we can see (simulated or gone): other events will wake us

            def _exited(fd=fd, pid=h.pid) -> None:
                loop.remove_reader(fd)
                os.close(fd)
                self._pid_watches.pop(pid, None)
                self.bus.publish("holder-exited", f"pid {pid} exited")
                self.kick(f"pid {pid} exited")

            self._pid_watches[h.pid] = fd
            loop.add_reader(fd, _exited)

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


def empty_plan() -> dict[str, Any]:
    return {"gpus": [], "disruption": {"destroyed": [], "mode_changes": [], "resets": []}, "warnings": []}


def _phase(states) -> str:
    states = [s.state for s in states]
    for phase in ("failed", "stuck", "reset-required", "reboot-required", "waiting", "read-only", "applying"):
        if phase in states:
            return phase
    return "converged"


def _step_dict(step) -> dict[str, Any]:
    d = msgspec.to_builtins(step)
    return {k: v for k, v in d.items() if v is not None}


def _converged_message(gpu: Gpu, desired: DesiredGpu) -> str:
    if desired.workload == "vm-passthrough":
        return f"on vfio-pci (IOMMU group {gpu.function.iommu_group})"
    if gpu.nvml is not None and gpu.nvml.mig_mode:
        return f"MIG: {len(gpu.nvml.instances)} GPU instance(s)"
    return "whole GPU"
