"""What one GPU needs next to match its layout entry: a vGPU removal, a MIG plan, a rebind, a vGPU
creation, or nothing; a GpuState when it cannot go on (infeasible, NVML blind, taken by leases).

The order is the safe one: vGPUs (and VFs) the layout no longer has go first (before a MIG change
under them, before the GPU leaves nvidia; a held one stops everything here); MIG state belongs to
the nvidia driver, so it is undone before a GPU leaves for vfio-pci; VFs are off before a MIG mode
change and on before the instances they need; the binding last; vGPUs are created on the result.
The pass (engine/reconciler.py), its preview (gpudctl plan) and the file's verdict
(engine/feasibility.py) all ask this one function.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from gpud.engine.gpu_state import Action, BindAction, GpuState, MigAction
from gpud.engine.leases.engine import LeaseEngine
from gpud.engine.vgpu.keeper import VgpuKeeper
from gpud.layout.desired import DesiredGpu
from gpud.layout.schema import Policy
from gpud.model import Gpu
from gpud.plan.binding import plan_binding, vfio_driver
from gpud.plan.lease_placement import dynamic_mode
from gpud.plan.mig import GpuPlan, plan_gpu


def next_action(gpu: Gpu, desired: DesiredGpu, *, vgpus: VgpuKeeper, leases: LeaseEngine, policy: Policy | None,
                drivers: frozenset[str], nvml_error: str | None,
                plan_mig: Callable[[Gpu, DesiredGpu], GpuPlan] = plan_gpu) -> Action | GpuState | None:
    """The next thing this GPU needs, or None when it matches its entry (`drivers`: the kernel's
    PCI drivers; `nvml_error`: why NVML could not be read, for the message; `plan_mig`: plan_gpu, or
    one that keeps its answers for the same GPU view)."""
    target_driver = vfio_driver(gpu.function) if desired.workload == "vm-passthrough" else "nvidia"
    if gpu.function.driver == "nvidia":
        removal = vgpus.removals(gpu, desired)
        if removal is not None:
            return removal
        if gpu.nvml is None:
            return GpuState("failed", "bound to nvidia but NVML does not see it" + (f" ({nvml_error})" if nvml_error else ""))
        mig_desired = desired
        if target_driver != "nvidia" and gpu.nvml.mig_capable and (gpu.nvml.mig_mode or gpu.nvml.mig_pending):
            mig_desired = msgspec.structs.replace(desired, mig_enabled=False, mig_devices={})
        if mig_desired.dynamic and mig_desired is desired:
            # Leases make this GPU's instances (gpud.engine.leases): the pass sees only to the mode,
            # where leases cannot (an Ampere change needs a reset) or the policy keeps it on; never
            # to an instance.
            mig_desired = dynamic_mode(gpu, desired, policy)
        if mig_desired.mig_enabled is not None and gpu.nvml.mig_capable:
            plan = plan_mig(gpu, mig_desired)
            if plan.infeasible:
                return GpuState("failed", plan.infeasible)
            if (taken := leases.taken_by(plan)) is not None:  # a static layout over leases
                return GpuState("failed", taken)
            if plan.steps:
                if plan.mode_change and (off := vgpus.vfs_off_before_mode_change(gpu)) is not None:
                    return off
                vfs = vgpus.vfs_before_instances(gpu, desired)
                if vfs is not None and not plan.mode_change:
                    return vfs
                if vfs is not None and desired.mig_devices:  # the mode alone now, instances after the VFs
                    plan = plan_gpu(gpu, msgspec.structs.replace(mig_desired, mig_devices={}))
                return MigAction(plan, f"{len(plan.steps)} MIG step(s)")
    bplan = plan_binding(gpu, desired.workload, drivers=drivers)
    if bplan.infeasible:
        return GpuState("failed", bplan.infeasible)
    if bplan.steps:
        return BindAction(bplan, f"bind to {target_driver}")
    return vgpus.creations(gpu, desired)
