"""systemd's STATUS= line for gpud: what `systemctl status gpud` shows under the unit.

One line: the GPUs on the bus by state ("3/3 GPUs converged" when all are), then the GPUs gone
from it, which are not counted against those present, the first holder a wait is for, and a
refused layout file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpud.engine.gpu_state import GpuState
from gpud.engine.view import EngineView


def of(view: EngineView) -> str:
    """The line for the engine's state in `view`."""
    return status_line((g.pci for g in view.observation.gpus), view.gpu_states, layout_invalid=bool(view.layout_errors))


def status_line(present: Iterable[str], gpu_states: Mapping[str, GpuState], *, layout_invalid: bool) -> str:
    on_bus = set(present)
    states = [s for pci, s in gpu_states.items() if pci in on_bus]
    gone = sum(1 for pci, s in gpu_states.items() if pci not in on_bus and s.state == "gone")
    n = len(on_bus)
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
    if layout_invalid:
        line += "; layout.yaml invalid, keeping the last good layout"
    return line
