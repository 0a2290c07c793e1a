"""Running one GPU's step on the hardware: a MIG plan, a reset, a driver change, vGPUs and VFs.

The reconcile pass decides what a GPU needs next; this runs it, with the rules every step shares:
the step runs in a worker thread and is never abandoned half-way (a cancelled pass still lets it
finish, and `finish` waits for it on stop); NVML work and leaving nvidia exclude each other across
GPUs (gpud.engine.gpu_tasks.NvmlSessionGate), and gpud's own NVML session is closed whenever it
would itself be what keeps the GPU busy (nvidia-smi -r, sriov-manage's unbind lock, an unbind);
the units policy.drain-units names are stopped around it and started again, also when it failed.
Each step returns a GpuState: "converged" means "go on", and the pass plans the GPU again from
what it shows now. A step never waits on holders itself: it names them, and the pass's on-busy
policy decides.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Literal, ParamSpec, Protocol, TypeVar

from gpud.engine.events import EventBus, event_fields
from gpud.engine.gpu_state import Action, BindAction, GpuState, GpuStateName, MigAction, VgpuAction
from gpud.engine.gpu_tasks import NvmlSessionGate, SharedDrain
from gpud.engine.observe.holders import lock_holders, reset_holders
from gpud.engine.ports import Drainer, Hardware
from gpud.engine.vgpu.keeper import VgpuKeeper, changes_vfs, step_event
from gpud.host.nvidia.gpu_reset import ResetResult
from gpud.layout.desired import DesiredGpu
from gpud.layout.schema import Policy
from gpud.model import Gpu
from gpud.plan.binding import BindingPlan
from gpud.plan.mig import GpuPlan, Step
from gpud.plan.vgpu import VgpuStep

P = ParamSpec("P")
T = TypeVar("T")


class ThePass(Protocol):
    """What a step asks of the pass it runs for (the Reconciler is one)."""

    @property
    def policy(self) -> Policy | None:
        """The layout in force's policy (drain-units, reset, reboot)."""

    @property
    def drainer(self) -> Drainer | None:
        """Stops and starts the units policy.drain-units names (None: no system bus)."""

    @property
    def nvml_stale(self) -> bool:
        """The last observation's NVML view is one kept while a rebind held NVML closed."""

    async def reread(self, pci: str) -> Gpu | None:
        """Re-read the host; the GPU at `pci` as it is now (None: gone from the bus)."""

    def next_action(self, gpu: Gpu, desired: DesiredGpu) -> Action | GpuState | None:
        """The pass's own planner, for a MIG plan made from a view that went stale."""


class StepRunner:
    """Runs steps for `the_pass` (ThePass)."""

    def __init__(self, hw: Hardware, bus: EventBus, vgpus: VgpuKeeper, the_pass: ThePass, *,
                 binder_timeout: float = 30.0) -> None:
        self.hw = hw
        self.bus = bus
        self.vgpus = vgpus
        self._pass = the_pass
        self.binder_timeout = binder_timeout
        # GPUs converge side by side (gpud.engine.gpu_tasks): NVML work and unbinds from nvidia
        # exclude each other; drained units stay stopped until the last GPU's step ends.
        self.nvml_gate = NvmlSessionGate()
        self.shared_drain = SharedDrain()
        self.inflight: set[asyncio.Future] = set()  # hardware steps running in worker threads
        self.mig_changed: set[str] = set()  # GPUs whose MIG devices changed (the pass clears it)

    async def run(self, gpu: Gpu, action: Action, desired: DesiredGpu) -> GpuState:
        """Run one action of `gpu`'s plan."""
        if isinstance(action, VgpuAction):
            return await self._vgpu(gpu, action)
        if isinstance(action, MigAction):
            return await self._mig(gpu, action.plan, desired)
        assert isinstance(action, BindAction)
        return await self._bind(gpu, action.plan)

    async def finish(self, timeout: float) -> bool:
        """On stop: wait for hardware steps still running, before NVML is closed under them."""
        if not self.inflight:
            return True
        _, pending = await asyncio.wait(set(self.inflight), timeout=timeout)
        return not pending

    async def _in_worker(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        fut = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
        self.inflight.add(fut)
        fut.add_done_callback(self.inflight.discard)
        return await asyncio.shield(fut)

    @contextlib.asynccontextmanager
    async def _drained(self) -> AsyncIterator[None]:
        policy = self._pass.policy
        units = list(policy.drain_units) if policy is not None else []
        if not units:
            yield
            return
        drainer = self._pass.drainer
        if drainer is None:
            raise RuntimeError(f"policy.drain-units {units} needs the system D-Bus, which is not reachable")
        async with self.shared_drain.drained(drainer, units):
            yield

    def _with_nvml_closed(self, fn: Callable[[], T]) -> Callable[[], T]:
        """`fn` run with gpud's NVML session closed; reads open it again on demand afterwards."""
        def run() -> T:
            self.hw.nvml.suspend()
            try:
                return fn()
            finally:
                self.hw.nvml.resume()
        return run

    async def _mig(self, gpu: Gpu, plan: GpuPlan, desired: DesiredGpu) -> GpuState:
        from gpud.engine.mig import executor as mig_executor

        loop = asyncio.get_running_loop()

        def on_step(step: Step, result: str = "done") -> None:  # called from the worker thread
            msg = f"{step} {result}"
            loop.call_soon_threadsafe(lambda: self.bus.publish("step", msg, gpu=gpu.pci, step=event_fields(step)))

        policy = self._pass.policy
        async with self.nvml_gate.hold("open"), self._drained():
            if self._pass.nvml_stale:
                # Planned from the view another GPU's rebind left while NVML was closed: steps done
                # since would be planned again (a second create fails INSUFFICIENT_RESOURCES).
                # No unbind runs while this hold is held, so NVML can be read now: plan again.
                fresh = await self._pass.reread(gpu.pci)
                if fresh is None:
                    return GpuState("gone", "the GPU disappeared from the PCI bus")
                action = self._pass.next_action(fresh, desired)
                if isinstance(action, GpuState):
                    return action
                if not isinstance(action, MigAction):  # nothing left for MIG: the pass's next round decides
                    return GpuState("converged", "re-read")
                plan = action.plan
            outcome = await self._in_worker(
                mig_executor.execute, self.hw.nvml, plan,
                policy_reset=policy.reset if policy else "per-gpu", on_step=on_step,
                holders=lambda pci: reset_holders(self.hw.procs, pci),
            )
        if outcome.done:
            self.mig_changed.add(gpu.pci)
        if outcome.reset_due:
            return await self.reset(gpu, outcome.message)
        return GpuState(outcome.state, outcome.message, tuple(outcome.holders))

    async def reset(self, gpu: Gpu, why: str) -> GpuState:
        """Reset one GPU the way the driver supports (gpud.host.nvidia.gpu_reset): drained, NVML closed
        (no other GPU's NVML work runs meanwhile), `nvidia-smi -r -i <PCI>`, then the GPU re-read."""
        resetter = self.hw.reset
        if resetter is None:
            return GpuState("reset-required", f"{why}; no reset tool is configured (--nvidia-smi)")
        self.bus.publish("step", f"reset {gpu.pci}: {' '.join(resetter.argv(gpu.pci))}", gpu=gpu.pci)
        # persistence mode (turned off for the reset) from our own session while it is open: one
        # nvidia-smi start fewer than asking it
        persistent = await self._in_worker(self.hw.nvml.persistence_mode, gpu.pci) if gpu.function.driver == "nvidia" else None
        async with self.nvml_gate.hold("closed"), self._drained():
            result = await self._in_worker(self._with_nvml_closed(
                lambda: resetter.reset(gpu.pci, gpu.function.driver, persistent)))
        self.bus.publish("reset", f"{'done' if result.ok else 'refused'} ({result.method}): {result.summary()}",
                         gpu=gpu.pci)
        if not result.ok:
            return self._reset_refused(gpu, why, result)
        self.mig_changed.add(gpu.pci)
        after = await self._pass.reread(gpu.pci)
        nv = after.nvml if after is not None else None
        if nv is not None and nv.mig_mode is not None and nv.mig_pending is not None and nv.mig_mode != nv.mig_pending:
            return GpuState("reboot-required", f"{why}; the reset of {gpu.pci} did not apply it "
                                               f"(mode {nv.mig_mode}, pending {nv.mig_pending}): reboot the host")
        return GpuState("converged", f"reset {gpu.pci} ({result.method})")

    def _reset_refused(self, gpu: Gpu, why: str, result: ResetResult) -> GpuState:
        """In use: the holders named (the pass waits or fails per on-busy, never kills); refused
        for another reason (a driver that cannot): reset-required with the tool's words, or a
        reboot where the policy allows one."""
        if result.in_use:
            holders = lock_holders(self.hw.procs, gpu.pci)
            if holders:
                names = ", ".join(f"pid {h.pid} {h.name}" for h in holders)
                return GpuState("waiting", f"{why}; {result.summary()}; held by {names}", tuple(holders))
            return GpuState("failed", f"{why}; {result.summary()}; no process holding it was found "
                                      f"(a kernel client such as nvidia_drm may hold it)")
        policy = self._pass.policy
        state: GpuStateName = "reboot-required" if policy is not None and policy.reboot == "allow" else "reset-required"
        return GpuState(state, f"{why}; the reset was refused: {result.summary()}")

    async def _vgpu(self, gpu: Gpu, action: VgpuAction) -> GpuState:
        loop = asyncio.get_running_loop()

        def on_step(step: VgpuStep) -> None:  # called from the worker thread: one event per vGPU
            line, data = step_event(step)
            loop.call_soon_threadsafe(lambda: self.bus.publish("vgpu", line, gpu=gpu.pci, step=data))

        if not changes_vfs(action):
            return await self._in_worker(self.vgpus.run, gpu, action, on_step)
        # sriov-manage's unbind lock is refused while our session holds the GPU
        holders = lambda pci: lock_holders(self.hw.procs, pci)  # noqa: E731
        async with self.nvml_gate.hold("closed"), self._drained():
            return await self._in_worker(self._with_nvml_closed(
                lambda: self.vgpus.run(gpu, action, on_step, holders=holders)))

    async def _bind(self, gpu: Gpu, plan: BindingPlan) -> GpuState:
        from gpud.engine.binding import binder

        suspended: list[bool] = []

        def before_unbind() -> None:  # called from the worker thread, at most once per run
            self.hw.nvml.suspend()  # our own handle must not be what keeps the GPU busy
            suspended.append(True)

        # Leaving nvidia needs NVML closed: wait for NVML work on other GPUs, and keep it off meanwhile.
        use: Literal["closed"] | None = "closed" if gpu.function.driver == "nvidia" else None
        async with (self.nvml_gate.hold(use) if use else contextlib.nullcontext()), self._drained():
            try:
                outcome = await self._in_worker(
                    binder.execute, self.hw.sysfs, self.hw.procs, plan,
                    before_unbind=before_unbind, timeout=self.binder_timeout, clock=self.hw.clock,
                )
            finally:
                if suspended:
                    self.hw.nvml.resume()  # reads open NVML again on demand, once no rebind needs it closed
        self.bus.publish("bind", f"{outcome.state}: {outcome.message}", gpu=gpu.pci)
        return GpuState(outcome.state, outcome.message, tuple(outcome.holders))
