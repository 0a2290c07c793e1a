"""The engine's vGPU concern: read each GPU's vGPU side, plan its next vGPU step, run it, and keep
the identities gpud chose (mdev UUIDs per type, the type of each VF) in the state directory, so a
daemon restart or a reboot rebuilds the same vGPUs a VM manager knows.

The order within one GPU is the reconcile loop's: vGPU removals first (a GPU instance carrying a
MIG-backed vGPU cannot be destroyed, and a GPU leaving vm-vgpu sheds its vGPUs and VFs before it
changes driver or MIG mode), then MIG, then the driver, then vGPU creations.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import msgspec

from gpud.engine.gpu_state import GpuState, VgpuAction
from gpud.engine.vgpu.executor import execute
from gpud.host.files import state_files
from gpud.host.nvidia.sriov_manage import SriovManage
from gpud.host.nvidia.vgpu_sysfs import VgpuSysfs
from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu, Holder
from gpud.plan.vgpu import VgpuPlan, VgpuRecord, VgpuStep, gi_profiles_of, plan_vgpu
from gpud.profiles import model_name
from gpud.vgpu_types import by_device

RECORD_FILE = "vgpu-record.json"


class VgpuKeeper:
    def __init__(self, vgpu: VgpuSysfs, state_dir: str | None, problems: state_files.Problems | None = None,
                 *, vf_tool: SriovManage | None = None) -> None:
        self.vgpu = vgpu
        self.vf_tool = vf_tool  # the only way VFs change
        self.state_dir = state_dir
        self.problems = problems if problems is not None else state_files.Problems()
        self.records: dict[str, VgpuRecord] = self._load()
        self.rebuilt: dict[str, list[str]] = {}  # GPU -> what gpud recreated from its record (status)

    # ---- identities
    def _path(self) -> str | None:
        return os.path.join(self.state_dir, RECORD_FILE) if self.state_dir else None

    def _load(self) -> dict[str, VgpuRecord]:
        path = self._path()
        if path is None:
            return {}
        return state_files.load(path, lambda b: msgspec.json.decode(b, type=dict[str, VgpuRecord]), self.problems,
                                what="vGPU record") or {}

    def _save(self) -> str | None:
        """Write the record; the reason when it could not be written (the old file stays)."""
        path = self._path()
        if path is None:
            return None
        try:
            state_files.save(path, msgspec.json.format(msgspec.json.encode(self.records)), mode=0o644)
        except OSError as e:
            why = f"{path}: not written ({e})"
            self.problems.say(path, why)
            return why
        self.problems.clear(path)
        return None

    @staticmethod
    def key(gpu: Gpu) -> str:
        """Identities follow the GPU, not its slot: its UUID when NVML knows it, else its address."""
        return gpu.nvml.uuid if gpu.nvml is not None and gpu.nvml.uuid else gpu.pci

    def record(self, gpu: Gpu) -> VgpuRecord:
        return self.records.setdefault(self.key(gpu), VgpuRecord())

    # ---- reading
    def observe(self, gpu: Gpu) -> Gpu:
        if gpu.function.driver != "nvidia" or not gpu.present:
            return gpu
        state = self.vgpu.read(gpu.pci)
        if state.interface is None:
            return gpu
        return msgspec.structs.replace(gpu, vgpu=state)

    # ---- planning
    def plan(self, gpu: Gpu, desired: DesiredGpu | None, *, with_instances: bool) -> VgpuPlan | None:
        if gpu.vgpu is None:
            return None
        return plan_vgpu(pci=gpu.pci, index=gpu.index, gpu_key=self.key(gpu), where=f"{model_name(gpu)} {gpu.pci}",
                         state=gpu.vgpu, desired=desired, model=by_device(gpu.function.device),
                         record=self.record(gpu), gi_profiles=gi_profiles_of(gpu.nvml) if with_instances else None)

    def removals(self, gpu: Gpu, desired: DesiredGpu) -> VgpuAction | GpuState | None:
        """Before anything else on this GPU: vGPUs to go (or the holders that keep them)."""
        plan = self.plan(gpu, desired, with_instances=False)
        if plan is None:
            return None
        if plan.infeasible and desired.workload == "vm-vgpu":
            return GpuState("failed", plan.infeasible)
        if plan.blocked_by or plan.removals:
            return VgpuAction(plan, "removals", _summary(plan.removals) or "vGPUs in use")
        return None

    def creations(self, gpu: Gpu, desired: DesiredGpu) -> VgpuAction | GpuState | None:
        """Last on this GPU: the vGPUs the layout asks for that are missing."""
        if desired.workload != "vm-vgpu":
            return None
        if gpu.vgpu is None:
            if desired.vgpu_devices:
                return GpuState("failed", f"{model_name(gpu)} {gpu.pci} shows no vGPU interface (no "
                                          "mdev_supported_types, no SR-IOV VFs): is NVIDIA's vGPU manager driver loaded?")
            return None
        plan = self.plan(gpu, desired, with_instances=True)
        assert plan is not None  # the GPU has a vGPU side (above)
        if plan.infeasible:
            return GpuState("failed", plan.infeasible)
        if plan.blocked_by or plan.steps:
            return VgpuAction(plan, "creations" if not plan.removals and not plan.blocked_by else "removals",
                              _summary(plan.steps) or "vGPUs in use")
        return None

    def vfs_before_instances(self, gpu: Gpu, desired: DesiredGpu) -> VgpuAction | None:
        """MIG-backed vGPUs: with MIG mode in place, VFs come before the GPU instances, because
        enabling them (sriov-manage rebinds the GPU) destroys every instance."""
        if desired.workload != "vm-vgpu" or gpu.vgpu is None or gpu.vgpu.vfs:
            return None
        plan = self.plan(gpu, desired, with_instances=False)
        if plan is None or plan.infeasible or plan.removals or [s.action for s in plan.creations] != ["enable-vfs"]:
            return None
        return VgpuAction(plan, "creations", "enable-vfs (before the GPU instances)")

    def vfs_off_before_mode_change(self, gpu: Gpu) -> VgpuAction | None:
        """The driver refuses a MIG mode change while VFs exist: disable them first (their vGPUs
        went in the removals already)."""
        if gpu.vgpu is None or not gpu.vgpu.vfs or gpu.vgpu.devices:
            return None
        plan = VgpuPlan(pci=gpu.pci, index=gpu.index, interface=gpu.vgpu.interface,
                        removals=[VgpuStep("disable-vfs", gpu.pci, count=0)])
        return VgpuAction(plan, "removals", "disable-vfs (before the MIG mode change)")

    # ---- running (in a worker thread)
    def run(self, gpu: Gpu, action: VgpuAction, on_step: Callable[[VgpuStep], None],
            holders: Callable[[str], list[Holder]] | None = None) -> GpuState:
        record = self.record(gpu)
        restoring = {u for us in record.uuids.values() for u in us} | set(record.vfs)
        outcome = execute(self.vgpu, action.plan, record, phase=action.phase, on_step=on_step,
                          vf_tool=self.vf_tool, holders=holders)
        rebuilt = [s for s in action.plan.creations if (s.uuid or s.vf) in restoring]
        if rebuilt and action.phase == "creations":
            self.rebuilt[gpu.pci] = [f"{s.type} {s.uuid or s.vf}" for s in rebuilt]
        unrecorded = self._save()
        if unrecorded is not None and outcome.state != "failed":
            done = "; ".join(f"{verb} {', '.join(items)}" for verb, items in
                             (("created", outcome.created), ("removed", outcome.removed)) if items) or "no change"
            return GpuState("failed", f"{done}; the vGPU identities could not be recorded ({unrecorded}): "
                                      "a restart may not recreate the same UUIDs; free space and apply again")
        if outcome.state == "blocked":
            names = ", ".join(_holder_text(h) for h in outcome.holders)
            why = f"{outcome.message}; " if outcome.message.startswith("sriov-manage") else ""
            return GpuState("waiting", f"{why}waiting for {names}", tuple(outcome.holders))
        if outcome.state == "failed":
            return GpuState("failed", outcome.message)
        return GpuState("converged", "")


def changes_vfs(action: VgpuAction) -> bool:
    """Does this action enable or disable VFs (sriov-manage: NVML must be closed around it)?"""
    steps = {"removals": action.plan.removals, "creations": action.plan.creations}.get(action.phase,
                                                                                      action.plan.steps)
    return any(s.action in ("enable-vfs", "disable-vfs") for s in steps)


def _summary(steps: list[VgpuStep]) -> str:
    if not steps:
        return ""
    counts: dict[str, int] = {}
    for s in steps:
        label = f"{s.action} {s.type}" if s.type else s.action
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{n} x {label}" if n > 1 else label for label, n in counts.items())


def _holder_text(h: Holder) -> str:
    vm = f" (VM {h.vm})" if h.vm else ""
    return f"pid {h.pid} {h.name}{vm} on {h.device}"


def step_event(step: VgpuStep) -> tuple[str, dict]:
    """An event line and its data for one vGPU step (each vGPU named)."""
    what = {"set-vf-type": "created", "create-mdev": "created", "remove": "removed", "free-vf": "removed",
            "enable-vfs": "enabled VFs", "disable-vfs": "disabled VFs"}[step.action]
    ident = step.uuid or step.vf or (f"x{step.count}" if step.count else "")
    line = f"vGPU {what}: {step.type} {ident}".replace("  ", " ").strip() if step.type else f"{what} {ident}".strip()
    return line, json.loads(msgspec.json.encode(step))
