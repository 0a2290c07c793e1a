"""The GPUs one pass changes, applied inside what must surround them: with --kube-node the
cluster's GPU operands that see them leave the node first and come back after (engine.ports
.OperandGuard: the kube agent); a layout whose hooks were refused changes nothing; then the hook
phases (gpud.engine.hooks.phases) around the GPUs, side by side. `PassApply` is what those phases
drive (hooks.phases.PassGpus): each GPU converged by the pass, its outcome, the hooks' lines.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from gpud.engine.events import EventBus
from gpud.engine.gpu_rounds import GpuRounds
from gpud.engine.gpu_state import Action, GpuState
from gpud.engine.hooks.phases import apply_with_hooks
from gpud.engine.hooks.runner import HookFailed
from gpud.engine.layout_keeper import has_hooks
from gpud.engine.ports import Drainer, OperandGuard, OperandsNotPaused
from gpud.engine.steps import StepRunner
from gpud.layout.resolve import Resolution
from gpud.model import Gpu
from gpud.plan.operand_impact import impact


class PassApply:
    def __init__(self, todo: Mapping[str, Action], resolution: Resolution, *, rounds: GpuRounds,
                 states: Mapping[str, GpuState], set_state: Callable[[str, GpuState], None], bus: EventBus,
                 steps: StepRunner, operand_guard: OperandGuard | None, hooks_refused: str | None, config_path: str,
                 drainer: Drainer | None, cdi_generate: Callable[[], Awaitable[str]] | None,
                 gpus: tuple[Gpu, ...]) -> None:
        self._todo = todo
        self._resolution = resolution
        self._rounds = rounds
        self._states = states
        self._set_state = set_state
        self._bus = bus
        self._steps = steps
        self._operand_guard = operand_guard
        self._hooks_refused = hooks_refused
        self._config_path = config_path
        self._drainer = drainer
        self._cdi_generate = cdi_generate
        self._gpus = gpus

    async def run(self) -> None:
        todo = self._todo
        if self._operand_guard is None:
            await self._with_hooks()
            return
        try:
            async with self._operand_guard.operands_paused(impact(self._gpus, self._resolution.desired, todo)):
                await self._with_hooks()
        except OperandsNotPaused as e:  # they could not leave: nothing is changed
            for pci in todo:
                self._set_state(pci, GpuState("failed", f"{e}; nothing changed"))

    async def _with_hooks(self) -> None:
        todo = self._todo
        self._steps.mig_changed.clear()
        layout = self._resolution.layout  # hooks and steps from the same resolved layout, always
        assert layout is not None  # a resolution without errors carries its layout
        refused = self._hooks_refused
        if refused and has_hooks(layout.hooks):  # run without its hooks, an apply could do harm
            self._bus.publish("hooks-refused", f"{self._config_path}: hooks refused, nothing changed: {refused}")
            for pci in todo:
                self._set_state(pci, GpuState("failed", f"the layout's hooks are refused, nothing changed: {refused}"))
            return
        await apply_with_hooks(todo, self._resolution.desired, layout=layout, layout_path=self._config_path,
                               gpus=self, drainer=self._drainer, cdi_generate=self._cdi_generate)

    # ---- hooks.phases.PassGpus ----------------------------------------------------------------
    async def apply_gpu(self, pci: str) -> None:
        await self._rounds.converge(pci, self._resolution.desired[pci])

    def gpu_converged(self, pci: str) -> bool:
        return self._states[pci].converged

    def mig_changed(self) -> bool:
        return bool(self._steps.mig_changed)

    def hook_aborted(self, pci: str, failure: HookFailed) -> None:
        self._set_state(pci, GpuState("failed", f"hook aborted the apply, nothing changed: {failure}"))

    def hook_said(self, line: str) -> None:
        self._bus.publish("hook", line)
