"""One verdict per file: a GPU the pass could not converge (`7 x 1g.10gb` on an A100 40GB, a
passthrough GPU with no IOMMU group) makes the file invalid, in `gpudctl check`, in the daemon's
load and in `status` alike, each problem at the file and line of the entry that asks it.

`policy.on-infeasible: skip-gpu` takes the other rule: the file is valid with a warning per such
GPU, the daemon applies the other GPUs and that one is failed with the same words.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from gpud.engine.gpu_state import Action, GpuState
from gpud.engine.observe.discovery import Observation
from gpud.layout.desired import DesiredGpu, LayoutIssue
from gpud.layout.parse import ParsedLayout
from gpud.layout.resolve import Resolution
from gpud.model import Gpu

# The engine's next step for a GPU (Reconciler.next_action): a GpuState when it cannot go on.
NextAction = Callable[[Gpu, DesiredGpu], Action | GpuState | None]

# The key of an entry an infeasibility is about, most specific first.
_KEYS = ("mig-devices", "vgpu-devices", "workload", "mig-enabled", "devices")


def infeasible(next_action: NextAction, parsed: ParsedLayout, resolution: Resolution,
               observation: Observation) -> list[LayoutIssue]:
    """The GPUs of a valid resolution the engine's next step cannot go on with, as layout issues."""
    if resolution.errors:
        return []
    out = []
    for gpu in observation.gpus:
        desired = resolution.desired.get(gpu.pci)
        if desired is None:
            continue
        action = next_action(gpu, desired)
        if isinstance(action, GpuState) and action.state == "failed":
            path, line = _where(parsed, desired)
            out.append(LayoutIssue(parsed.file, line, path, f"GPU {gpu.index} {gpu.pci}: infeasible: {action.message}"))
    return out


def _where(parsed: ParsedLayout, desired: DesiredGpu) -> tuple[str, int | None]:
    entry = parsed.origin(desired.entry)
    for key in _KEYS:
        line = parsed.line(f"{entry}.{key}")
        if line is not None:
            return f"{entry}.{key}", line
    return entry, parsed.line(entry)


def judged(next_action: NextAction, parsed: ParsedLayout, resolution: Resolution,
           observation: Observation) -> Resolution:
    """`resolution` with its infeasible GPUs as errors (the file is refused whole: `desired` is
    emptied, as for any error) or, under `on-infeasible: skip-gpu`, as warnings."""
    issues = infeasible(next_action, parsed, resolution, observation)
    if not issues:
        return resolution
    if resolution.layout is not None and resolution.layout.policy.on_infeasible == "skip-gpu":
        return msgspec.structs.replace(resolution, warnings=[*resolution.warnings, *issues])
    return msgspec.structs.replace(resolution, desired={}, layout=None, errors=issues)
