"""One GPU of a pass, converged in rounds: its next action planned from the current observation,
run as one step on the hardware, the GPU re-read, until it matches its entry, cannot go on, waits
for holders, or MAX_ROUNDS pass. Each GPU has its own safety net (its surprise never stops the
others), and the GPUs of one IOMMU group take turns: each one's binding plan moves every endpoint
of the group, so two side by side bound each other's functions twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from gpud.engine.boot.reboot_policy import RebootPolicy
from gpud.engine.gpu_state import Action, GpuState, converged_message, step_count
from gpud.engine.observe.discovery import Observation
from gpud.engine.observe.holder_watch import HolderWatch
from gpud.engine.steps import StepRunner
from gpud.layout.desired import DesiredGpu
from gpud.layout.schema import Policy
from gpud.model import Gpu

log = logging.getLogger(__name__)

MAX_ROUNDS = 8  # vGPUs off -> MIG off -> rebind -> MIG on -> VFs on -> vGPUs on is six; spares


class RoundsPass(Protocol):
    """What a GPU's rounds ask of the pass they run in (the Reconciler is one)."""

    @property
    def read_only(self) -> bool: ...

    @property
    def policy(self) -> Policy | None: ...

    def gpu(self, pci: str) -> Gpu | None:
        """The GPU at `pci` in the current observation."""

    def next_action(self, gpu: Gpu, desired: DesiredGpu) -> Action | GpuState | None: ...

    def held(self) -> bool:
        """The pass only says what is pending (policy.apply: manual, no `gpudctl apply`)."""

    def set_state(self, pci: str, st: GpuState, **data: Any) -> None: ...

    async def refresh_async(self) -> Observation: ...

    async def reread_gpu(self, pci: str) -> None: ...


class GpuRounds:
    def __init__(self, the_pass: RoundsPass, steps: StepRunner, holder_watch: HolderWatch,
                 reboot_policy: RebootPolicy) -> None:
        self._rec = the_pass
        self._steps = steps
        self._holder_watch = holder_watch
        self._reboot_policy = reboot_policy
        self.acted = False  # whether a step was carried out since the pass began (the pass resets it)
        self.running = 0  # GPUs whose rounds are under way (their steps, and the re-reads after them)
        self.ended = 0.0  # time.monotonic() when the last GPU's rounds ended
        self._group_turns: dict[int, asyncio.Lock] = {}

    async def converge(self, pci: str, desired: DesiredGpu) -> None:
        """One GPU, inside its own safety net; its state set when it ends (policy.reboot settles it)."""
        rec = self._rec
        gpu = rec.gpu(pci)
        group = gpu.function.iommu_group if gpu is not None else None
        turn = self._group_turns.setdefault(group, asyncio.Lock()) if group is not None else None
        self.running += 1
        try:
            if turn is None:
                state = await self._rounds(pci, desired)
            else:
                async with turn:
                    state = await self._rounds(pci, desired)
            rec.set_state(pci, await self._reboot_policy.settle(pci, state, rec.policy))
        except Exception as e:
            log.exception("GPU %s", pci)
            rec.set_state(pci, GpuState("failed", f"internal error: {e}"))
        finally:
            self.running -= 1
            self.ended = time.monotonic()

    async def _rounds(self, pci: str, desired: DesiredGpu) -> GpuState:
        rec = self._rec
        for _ in range(MAX_ROUNDS):
            gpu = rec.gpu(pci)
            if gpu is None:
                return GpuState("gone", "the GPU disappeared from the PCI bus")
            action = rec.next_action(gpu, desired)
            if action is None:
                return GpuState("converged", converged_message(gpu, desired))
            if isinstance(action, GpuState):
                return action
            if rec.read_only:
                return GpuState("read-only", f"read-only mode: would apply {action.summary}")
            if rec.held():
                n = step_count(action)
                return GpuState("pending", f"pending: {n} step{'s' if n != 1 else ''} (policy.apply: manual; "
                                           "`gpudctl plan` shows them, `gpudctl apply` runs them)")
            if action.kind in ("mig", "vgpu") and action.plan.blocked_by:  # nothing is touched while busy
                names = ", ".join(f"pid {h.pid} {h.name}{f' (VM {h.vm})' if h.vm else ''} on {h.device}"
                                  for h in action.plan.blocked_by)
                return self._busy(GpuState("waiting", f"waiting for {names}", tuple(action.plan.blocked_by)))
            rec.set_state(pci, GpuState("applying", action.summary), steps=step_count(action))
            outcome = await self._steps.run(gpu, action, desired)
            self.acted = True
            if outcome.state != "converged":
                return self._busy(outcome) if outcome.state == "waiting" else outcome
            if action.kind == "mig":
                await rec.reread_gpu(pci)  # MIG steps change that GPU alone
            else:
                await rec.refresh_async()
        return GpuState("failed", f"still not converged after {MAX_ROUNDS} rounds")

    def _busy(self, waiting: GpuState) -> GpuState:
        """Holders block a step: wait for them to exit (`on-busy: wait`) or fail (`fail`)."""
        policy = self._rec.policy
        if policy is not None and policy.on_busy == "fail":
            return GpuState("failed", f"busy (on-busy: fail): {waiting.message}", waiting.holders)
        if not waiting.holders:  # nothing's exit would ever wake the wait: never `waiting` on nothing
            return GpuState("failed", f"{waiting.message}; no process to wait for")
        self._holder_watch.watch(waiting.holders)
        return waiting
