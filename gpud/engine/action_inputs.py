"""What next_action (gpud.engine.next_action) needs besides the GPU and its entry, kept per
observation: next_action runs on the loop for every GPU, several times a pass (the file's judge,
which GPUs change, each GPU's rounds), so each input is worked out once.

MIG plans: plan_gpu (gpud.plan.mig) is pure and costs about 3 ms a GPU (at 64 GPUs planning on the
loop held every client up for a second), so a worker thread that read the host or resolved a layout
plans ahead (`PlanMemo.plan_ahead`) and the loop finds the plan kept. A GPU view is an
observation's record, never changed (a GPU read again is a new one), so it is kept by identity;
entries are compared by value (each resolution makes its own).

The kernel's PCI drivers: listing them on the loop handed the GIL to a busy worker (up to its
switch interval) while clients waited. A driver loaded since (gpud's own modprobe in a bind step)
is seen with that step's re-read."""

from __future__ import annotations

from typing import Protocol

from gpud.engine.observe.discovery import Observation
from gpud.layout.desired import DesiredGpu
from gpud.layout.resolve import Resolution
from gpud.model import Gpu
from gpud.plan.mig import GpuPlan, plan_gpu


class PlanMemo:
    def __init__(self) -> None:
        self._plans: dict[int, tuple[Gpu, list[tuple[DesiredGpu, GpuPlan]]]] = {}

    def plan(self, gpu: Gpu, desired: DesiredGpu, *, gpus: int) -> GpuPlan:
        """plan_gpu(gpu, desired), computed once per GPU view and equal entry (`gpus`: how many GPUs
        the host has, which bounds how many views are kept)."""
        kept = self._plans.get(id(gpu))
        if kept is not None and kept[0] is gpu:
            for d, plan in kept[1]:
                if d is desired or d == desired:
                    return plan
        if len(self._plans) > 16 * max(gpus, 16):
            self._plans.clear()  # views of earlier observations
        plan = plan_gpu(gpu, desired)
        entries = kept[1] if kept is not None and kept[0] is gpu else []
        self._plans[id(gpu)] = (gpu, [*entries[-3:], (desired, plan)])  # the view held: its id stays its own
        return plan

    def plan_ahead(self, resolution: Resolution, observation: Observation) -> None:
        """In a worker thread: each GPU's MIG plan for its entry in `resolution`, kept for the judge
        and the pass that follow on the loop."""
        for gpu in observation.gpus:
            desired = resolution.desired.get(gpu.pci)
            if (desired is not None and desired.mig_enabled is not None and not desired.dynamic
                    and gpu.nvml is not None and gpu.nvml.mig_capable and gpu.function.driver == "nvidia"):
                self.plan(gpu, desired, gpus=len(observation.gpus))


class _Sysfs(Protocol):
    def drivers(self) -> list[str]: ...


class DriverList:
    def __init__(self, sysfs: _Sysfs) -> None:
        self.sysfs = sysfs
        self._seen: tuple[Observation, int, frozenset[str]] | None = None

    def of(self, observation: Observation, read: int) -> frozenset[str]:
        """The kernel's PCI drivers, listed once for `observation` as host read number `read`
        (a read that found the host unchanged keeps the observation object: a module loaded
        meanwhile is still listed anew)."""
        kept = self._seen
        if kept is None or kept[0] is not observation or kept[1] != read:
            kept = self._seen = (observation, read, frozenset(self.sysfs.drivers()))
        return kept[2]
