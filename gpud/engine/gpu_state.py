"""What the engine concludes about one GPU, and the next step it takes on one: the vocabulary the
reconcile loop, its helpers and the status reply share. The state names are the strings the
socket API and `gpudctl status` show, so they are a Literal of exactly those strings."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu, Holder
from gpud.plan.binding import BindingPlan
from gpud.plan.mig import GpuPlan
from gpud.plan.vgpu import VgpuPlan

GpuStateName = Literal[
    "converged",  # matches its entry
    "pending",  # the layout changed and a pass will change this GPU; it has not started yet
    "applying",  # a step is running
    "waiting",  # processes hold what must change (policy on-busy: wait)
    "failed",  # cannot get there; the message says why
    "stuck",  # a driver write did not return in time
    "reset-required",  # a mode change needs a GPU reset that policy or holders prevent
    "reboot-required",  # only a reboot settles the mode change
    "unmanaged",  # not in the selected layout: left untouched
    "drift",  # was converged; the hardware changed behind gpud and no longer matches (the message says how)
    "read-only",  # read-only mode: would apply something
    "gone",  # the GPU left the PCI bus
]

Phase = Literal[
    "starting",  # no pass has ended yet
    "converged",  # every managed GPU matches the layout
    "invalid-layout",  # the file (or its resolution on this host) has errors: nothing new is applied
    # the GPU states a pass reports as its phase (PHASE_ORDER)
    "failed", "stuck", "reset-required", "reboot-required", "drift", "waiting", "read-only", "applying", "pending",
]

# The states a whole pass reports as its phase, most urgent first (none of them: "converged").
PHASE_ORDER: tuple[Phase, ...] = (
    "failed", "stuck", "reset-required", "reboot-required", "drift", "waiting", "read-only", "applying", "pending",
)
# Phases a layout is still working through (anything else: settled, until something changes).
SETTLING_PHASES: tuple[Phase, ...] = ("starting", "applying", "waiting")


class GpuState(msgspec.Struct, frozen=True):
    """What the engine last concluded about one GPU."""

    state: GpuStateName
    message: str = ""
    holders: tuple[Holder, ...] = ()

    @property
    def converged(self) -> bool:
        return self.state in ("converged", "unmanaged")


class GpuStates(dict[str, GpuState]):
    """PCI -> GpuState, with `version` moved on by every change: what is built from the whole table
    (the engine's view, asked for by every `status` request) tells it changed by one comparison
    instead of one per GPU. The states are frozen, so a change is always one of these calls."""

    version = 0

    def __setitem__(self, pci: str, state: GpuState) -> None:
        super().__setitem__(pci, state)
        self.version += 1

    def __delitem__(self, pci: str) -> None:
        super().__delitem__(pci)
        self.version += 1

    def update(self, *args: Any, **kw: GpuState) -> None:  # dict.update does not call __setitem__
        super().update(*args, **kw)
        self.version += 1

    def __ior__(self, other: Any) -> GpuStates:  # type: ignore[override,misc]
        self.update(other)
        return self

    def setdefault(self, pci: str, state: GpuState) -> GpuState:
        if pci not in self:
            self.version += 1
        return super().setdefault(pci, state)

    def pop(self, pci: str, *default: Any) -> Any:
        self.version += 1
        return super().pop(pci, *default)

    def popitem(self) -> tuple[str, GpuState]:
        self.version += 1
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        self.version += 1


class MigAction(msgspec.Struct, frozen=True):
    """Change the GPU's MIG mode or devices (it is on nvidia)."""

    plan: GpuPlan
    summary: str
    kind: Literal["mig"] = "mig"


class BindAction(msgspec.Struct, frozen=True):
    """Move the GPU to another driver (nvidia <-> vfio-pci)."""

    plan: BindingPlan
    summary: str
    kind: Literal["bind"] = "bind"


class VgpuAction(msgspec.Struct, frozen=True):
    """Remove vGPUs (before any MIG change: an instance carrying one cannot go) or create them
    (once the MIG layout and the driver are right), or enable/disable the GPU's VFs."""

    plan: VgpuPlan
    phase: Literal["removals", "creations"]
    summary: str
    kind: Literal["vgpu"] = "vgpu"


Action = MigAction | BindAction | VgpuAction


def step_count(action: Action) -> int:
    """How many steps this action runs (apply --wait's `[3/7]`): a vGPU action runs one phase."""
    if isinstance(action, VgpuAction):
        return len({"removals": action.plan.removals, "creations": action.plan.creations}[action.phase])
    return len(action.plan.steps)


def converged_message(gpu: Gpu, desired: DesiredGpu) -> str:
    """What a converged GPU's status line says it is: its driver, vGPUs or MIG state."""
    if desired.workload == "vm-passthrough":
        return f"on {gpu.function.driver or 'no driver'} (IOMMU group {gpu.function.iommu_group})"  # the kernel's word
    if desired.workload == "vm-vgpu":
        devices = gpu.vgpu.devices if gpu.vgpu is not None else ()
        counts: dict[str, int] = {}
        for d in devices:
            counts[d.type] = counts.get(d.type, 0) + 1
        kinds = " ".join(f"{n}x{t}" for t, n in sorted(counts.items())) or "none"
        return f"vGPUs ({gpu.vgpu.interface if gpu.vgpu else 'no interface'}): {kinds}"
    if desired.dynamic:
        n = len(gpu.nvml.instances) if gpu.nvml is not None and gpu.nvml.mig_mode else 0
        mode = "on" if gpu.nvml is not None and gpu.nvml.mig_mode else "off"
        return f"MIG on demand (leases), MIG {mode}, {n} GPU instance{'' if n == 1 else 's'}"
    if gpu.nvml is not None and gpu.nvml.mig_mode:
        n = len(gpu.nvml.instances)
        return f"MIG on, {n} GPU instance{'' if n == 1 else 's'}"
    return "whole GPU"


def concluded_phase(states: Iterable[GpuState]) -> Phase:
    """What a pass concludes from its GPUs' states: the most urgent of PHASE_ORDER, else converged."""
    names = {s.state for s in states}
    for phase in PHASE_ORDER:
        if phase in names:
            return phase
    return "converged"


def phase_now(concluded: Phase, states: Iterable[GpuState], *, invalid: bool) -> Phase:
    """The phase at this moment (status' top line): an invalid file (or resolution) first, then a
    GPU being changed, then a change not started yet, else what the last pass concluded."""
    if invalid:
        return "invalid-layout"
    names = {s.state for s in states}
    if "applying" in names:
        return "applying"
    if "pending" in names:
        return "pending"
    return concluded
