"""Discovery: one consistent picture of the managed GPUs, joined from sysfs and NVML.

sysfs is the authority on which GPUs exist and which driver holds them (NVML cannot see a GPU on
vfio-pci), so indices never shift with the binding: `observe` numbers the GPUs present in
PCI-address order, and the reconciler replaces those numbers with the kept ones of
gpud.engine.observe.gpu_index, so that a GPU leaving the bus shifts nobody. NVML adds identity and MIG
state for the GPUs it can see.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from msgspec import Struct, structs

from gpud.host.kernel.sysfs import Sysfs
from gpud.host.nvidia.nvml import Nvml, NvmlError
from gpud.layout.match import managed
from gpud.layout.schema import MatchRule
from gpud.model import Gpu, KnownGpu, NvmlGpu, PciFunction

log = logging.getLogger(__name__)


class Observation(Struct, frozen=True):
    gpus: tuple[Gpu, ...]
    functions: tuple[PciFunction, ...]  # every PCI function, for companions and the inventory
    nvml_error: str | None = None  # NVML unusable (driver gone, no GPU bound): said in status
    gone: tuple[KnownGpu, ...] = ()  # GPUs numbered before and missing from the bus now (gpu_index)
    index_problem: str | None = None  # why indices cannot be trusted now: index-based entries refused
    # NVML was closed for a rebind during the read: the GPUs' NVML parts are the last good view,
    # fine to show, not to plan MIG steps from (engine/reconciler.py re-reads before it does)
    nvml_stale: bool = False


def keep_unchanged(new: Observation, old: Observation) -> Observation:
    """`new`, with each part equal to `old`'s replaced by `old`'s own object: `old` itself when
    nothing changed. What is built from an observation (the layout's resolution, the engine's
    view, each GPU's part of the status reply, node labels) is kept by identity, so a re-read that
    found the host as it was costs nothing on the event loop, and one that found one GPU changed
    rebuilds that GPU's parts only. Called in the worker thread that read `new`: comparing 64 GPUs
    with their MIG devices is work the loop does not do."""
    if new == old:
        return old
    before = {g.pci: g for g in old.gpus}
    gpus = tuple(same_if_equal(g, before.get(g.pci)) for g in new.gpus)
    gpus = old.gpus if gpus == old.gpus else gpus
    functions = old.functions if new.functions == old.functions else new.functions
    gone = old.gone if new.gone == old.gone else new.gone
    if all(a is b for a, b in zip(gpus, new.gpus, strict=True)) and functions is new.functions and gone is new.gone:
        return new  # nothing of `old` to keep
    return structs.replace(new, gpus=gpus, functions=functions, gone=gone)


def same_if_equal(new: Gpu, old: Gpu | None) -> Gpu:
    """`old` where it equals `new` (see keep_unchanged), else `new`."""
    return old if old is not None and old == new else new


def companions_of(function: PciFunction, functions: Sequence[PciFunction]) -> tuple[PciFunction, ...]:
    """The other endpoints that must follow a GPU to vfio-pci: its IOMMU group, or without an
    IOMMU (no group links) the other functions of the same slot."""
    if function.iommu_group is not None:
        return tuple(f for f in functions if f.iommu_group == function.iommu_group and f.address != function.address)
    return tuple(f for f in functions if f.slot == function.slot and f.address != function.address)


def observe(sysfs: Sysfs, nvml: Nvml | None, match: Sequence[MatchRule]) -> Observation:
    functions = tuple(sysfs.functions())
    nvml_gpus: dict[str, NvmlGpu] = {}
    nvml_error = None
    if nvml is not None and any(f.driver == "nvidia" for f in managed(functions, match)):
        try:
            # NVML enumerates at nvmlInit: the GPUs on nvidia per sysfs tell it when to look again
            on_nvidia = [f.address for f in functions if f.driver == "nvidia"]
            nvml_gpus = {g.pci: g for g in nvml.gpus(on_nvidia=on_nvidia)}
        except NvmlError as e:
            nvml_error = str(e)
            log.warning("NVML unavailable: %s", e)
    gpus = tuple(
        Gpu(
            index=i,
            function=f,
            companions=companions_of(f, functions),
            nvml=nvml_gpus.get(f.address) if f.driver == "nvidia" else None,
        )
        for i, f in enumerate(managed(functions, match))
    )
    return Observation(gpus=gpus, functions=functions, nvml_error=nvml_error)
