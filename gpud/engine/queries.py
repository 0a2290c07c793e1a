"""What the edge (the socket API) asks of the engine besides reading its state: pick GPUs by a
user's selector, count the MIG capacity left, start an apply.

Refusals are engine errors (`EngineError` and its kinds); the API decides which wire error code
each becomes, so the engine never speaks the protocol.
"""

from __future__ import annotations

from gpud.engine.reconciler import Reconciler
from gpud.model import Gpu, MigProfile, Placement


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


def start_apply(rec: Reconciler) -> int:
    """Re-read the file and ask for a pass; the ticket to wait on. InvalidLayout when the file is bad."""
    rec.load_config()
    if rec.layout_issues[0]:
        raise InvalidLayout("; ".join(rec.layout_issues[0]))
    return rec.kick("apply requested")
