"""GPU states that change between passes, without touching the hardware: a GPU a new layout will
change is `pending`, and a GPU a pass left `converged` that an observation shows no longer matching
is `drift`. Both are judged against an observation with the pass's own `next_action`, and each
returns the new states only; the reconciler takes them, says them and notifies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from gpud.engine.gpu_state import Action, GpuState
from gpud.engine.observe.discovery import Observation
from gpud.layout.desired import DesiredGpu
from gpud.layout.resolve import Resolution
from gpud.model import Gpu

log = logging.getLogger(__name__)

NextAction = Callable[[Gpu, DesiredGpu], Action | GpuState | None]


def pending(observation: Observation, resolution: Resolution, states: Mapping[str, GpuState],
            next_action: NextAction) -> dict[str, GpuState]:
    """Right after a new layout is taken, before its pass starts: the GPUs it will change are
    `pending`, not `converged` (status must not claim the new layout is in place). A GPU already
    not converged keeps its state; the pass re-plans from a fresh observation."""
    out = {}
    for gpu in observation.gpus:
        desired = resolution.desired.get(gpu.pci)
        old = states.get(gpu.pci)
        if desired is None or (old is not None and not old.converged):
            continue
        try:
            action = next_action(gpu, desired)
        except Exception:  # a surprise here must not refuse a reload; the pass will report it
            log.exception("GPU %s: planning the pending change", gpu.pci)
            continue
        if isinstance(action, Action):
            out[gpu.pci] = GpuState("pending", f"layout changed: {action.summary}, not started yet")
    return out


def drifted(observation: Observation, resolution: Resolution, states: Mapping[str, GpuState],
            next_action: NextAction) -> dict[str, GpuState]:
    """A GPU a pass left `converged` that no longer matches (another tool changed MIG or a driver
    binding) is `drift`, with the step that would put it back named."""
    out = {}
    for gpu in observation.gpus:
        state, desired = states.get(gpu.pci), resolution.desired.get(gpu.pci)
        if state is None or desired is None or state.state != "converged":
            continue
        action = next_action(gpu, desired)
        if action is None or isinstance(action, GpuState):
            continue
        out[gpu.pci] = GpuState("drift", f"the hardware changed behind gpud and no longer matches the layout: {action.summary}")
    return out
