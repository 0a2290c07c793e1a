"""What the edges (the socket API, the daemon's readiness) ask of the engine besides reading its
state: pick GPUs by a user's selector, count the MIG capacity left, start an apply, the vGPUs
still to be made.

Refusals are engine errors (`EngineError` and its kinds); the API decides which wire error code
each becomes, so the engine never speaks the protocol.
"""

from __future__ import annotations

import time

from gpud.engine.gpu_state import Action
from gpud.engine.reconciler import Reconciler
from gpud.model import CiProfile, ComputeInstance, Gpu, MigProfile, Placement


class EngineError(Exception):
    """The engine refuses a request; the message says why, for a person."""


class NoSuchGpu(EngineError):
    """A selector matches no managed GPU."""


class InvalidLayout(EngineError):
    """The layout file in place has errors; the engine keeps the last good one and applies nothing new."""


def select_gpus(gpus: tuple[Gpu, ...], selector: str | None) -> list[Gpu]:
    """The GPUs a selector names: index, PCI address (with or without the domain) or GPU UUID."""
    if not selector:
        return list(gpus)
    wanted = selector.lower()
    chosen = [g for g in gpus if wanted in (str(g.index), g.pci, g.pci.removeprefix("0000:"))
              or (g.nvml is not None and g.nvml.uuid.lower() == wanted)]
    if not chosen:
        raise NoSuchGpu(f"no managed GPU matches {selector!r} (index, PCI address or UUID)")
    return chosen


def remaining_capacity(profile: MigProfile, used: list[Placement], existing: int) -> int:
    """NVML's RemainingCapacity: placements of this profile that still fit together, bounded by
    the instances the profile still allows."""
    taken = set().union(*(p.slices for p in used)) if used else set()
    fits = 0
    for placement in profile.placements:
        if not (placement.slices & taken):
            taken |= placement.slices
            fits += 1
    return max(0, min(fits, profile.instance_count - existing))


def ci_remaining_capacity(ci: CiProfile, cis: tuple[ComputeInstance, ...], gi_slices: int) -> int:
    """NVML's nvmlGpuInstanceGetComputeInstanceRemainingCapacity for one GPU instance, by the
    same rule as the GI count above: the CI profile's placements that still fit together beside
    the CIs there, bounded by the instances the profile still allows. Where a CI's placement or
    the profile's placements were not read, by compute slices left instead."""
    same = sum(1 for c in cis if c.profile_id == ci.id)
    left = ci.instance_count - same
    if ci.starts and all(c.start is not None for c in cis):
        taken = {s for c in cis if c.start is not None for s in range(c.start, c.start + c.slices)}
        fits = 0
        for start in ci.starts:
            slots = set(range(start, start + ci.slices))
            if not slots & taken:
                taken |= slots
                fits += 1
    else:
        fits = max(0, gi_slices - sum(c.slices for c in cis)) // max(ci.slices, 1)
    return max(0, min(fits, left))


async def start_apply(rec: Reconciler) -> int:
    """Re-read the file (off the loop) and ask for a pass; the ticket to wait on. InvalidLayout
    when the file is bad, naming its first errors (all of them are in status)."""
    asked = time.monotonic()
    await rec.load_config_async()  # reads the host afresh: the pass may start from that read
    errors = rec.layout_issues[0]
    if errors:
        more = f"; ... and {len(errors) - 10} more errors (gpudctl status)" if len(errors) > 10 else ""
        raise InvalidLayout("; ".join(errors[:10]) + more)
    ticket = rec.request_apply(seen_since=asked)
    rec.mark_pending()
    return ticket


def changes_at_start(rec: Reconciler) -> list[str]:
    """The GPUs the first pass will change (after a reboot: the MIG instances Hopper and later lost,
    VFs and vGPUs, driver overrides), vm-vgpu GPUs short of vGPUs among them. The daemon holds
    READY=1 back until that pass, so the kubelet (its device plugin, a DRA driver) and VM managers,
    ordered after gpud.service, start on the layout in place. None under `policy.apply: manual`
    (nothing runs before `gpudctl apply`) or read-only."""
    if rec.resolution is None or rec.read_only or (rec.policy is not None and rec.policy.apply == "manual"):
        return []
    pending = set(vgpus_missing(rec))
    for gpu in rec.observation.gpus:
        desired = rec.resolution.desired.get(gpu.pci)
        if desired is not None and isinstance(rec.next_action(gpu, desired), Action):
            pending.add(gpu.pci)
    return sorted(pending)


def vgpus_missing(rec: Reconciler) -> list[str]:
    """vm-vgpu GPUs of the layout in force that have fewer vGPUs than it asks for (after a
    reboot or a driver reload: all of them, since neither VFs nor vGPUs survive one). The daemon
    holds READY=1 back until its first pass has made them, so VM managers ordered after gpud
    start with their mdev UUIDs and VFs in place."""
    if rec.resolution is None or rec.read_only:
        return []
    missing = []
    for gpu in rec.observation.gpus:
        desired = rec.resolution.desired.get(gpu.pci)
        if desired is None or desired.workload != "vm-vgpu" or not desired.vgpu_devices:
            continue
        have = len(gpu.vgpu.devices) if gpu.vgpu is not None else 0
        if have < sum(desired.vgpu_devices.values()):
            missing.append(gpu.pci)
    return missing
