"""What NVML says about a GPU that cannot change while the session and the GPU stay the same.

A GPU's identity (UUID, name, minor number, total memory, compute capability), whether it is MIG
capable, its GPU instance profiles with their possible placements, and the compute instance
profiles of each GI profile are fixed by the GPU model and the loaded driver: NVML documents the
placement calls as "possible placements, not necessarily available" and the profile infos as the
profile's capacities, not its use (docs/hardware/nvml-static-reads.md). They change only when the
driver is reloaded, the GPU is reset or swapped, and each of those happens with gpud's NVML session
closed (a rebind suspends it, a reset needs it closed, a hot-plug re-opens it): so a session's
cache lives exactly as long as the session, and `gpud.host.nvidia.nvml.Nvml.close` drops it.

An observation then asks NVML only what changes: the MIG mode, the MIG devices and the processes,
and the GIs and CIs only when the MIG devices are not exactly those of the last read (`layouts`).
This module holds the records; it does not import pynvml (gpud.host.nvidia.nvml does).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from gpud.model import CiProfile, GpuInstance, MigProfile


@dataclass(frozen=True)
class GpuStatic:
    """One GPU's fixed facts, read once per session."""

    pci: str
    uuid: str
    name: str
    minor: int | None
    memory_mb: int
    compute_capability: tuple[int, int] | None
    mig_capable: bool
    # GI profiles by id, without their CI profiles (those need a live GI: `SessionCache.ci_profiles`)
    profiles: tuple[MigProfile, ...] = ()


@dataclass(frozen=True)
class MigDeviceRecord:
    """What a MIG device's UUID names, fixed while the device exists: a CI is created with its GI
    and CI ids, profile and placement and keeps them until destroyed, and the UUID "uniquely
    identifies the subscribed MIG compute instance" (docs/hardware/nvml-static-reads.md). Used
    only while its GI answers the same id, profile and placement; dropped when gpud changes the GPU."""

    pci: str
    gi: tuple[int, int, int, int]  # the GI's id, profile id, placement start and size
    gi_id: int
    ci_id: int
    profile_id: int
    slices: int
    start: int | None


@dataclass
class SessionCache:
    """Per-session caches, dropped at nvmlShutdown. `generation` counts sessions: a read that began
    in an earlier session must not store what it learned into a later one (`store_if`)."""

    generation: int = 0
    # the session's GPUs in NVML index order: (device handle, PCI address); None until enumerated
    enumerated: list[tuple[Any, str]] | None = None
    gpus: dict[str, GpuStatic] = field(default_factory=dict)
    # (PCI address, GI profile id) -> the CI profiles NVML lists for a GI of that profile
    ci_profiles: dict[tuple[str, int], dict[int, CiProfile]] = field(default_factory=dict)
    max_mig_devices: dict[str, int] = field(default_factory=dict)  # asked with MIG on (0 with it off)
    mig_devices: dict[str, MigDeviceRecord] = field(default_factory=dict)  # by MIG device UUID
    # PCI address -> its GIs and CIs as the last read found them, every CI with its MIG device's
    # UUID: what a read that finds exactly those MIG devices again shows (MigReader._unchanged)
    layouts: dict[str, tuple[GpuInstance, ...]] = field(default_factory=dict)
    memory_stale: set[str] = field(default_factory=set)  # GPUs whose total memory is asked again
    lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        with self.lock:
            self.generation += 1
            self.enumerated = None
            self.gpus.clear()
            self.ci_profiles.clear()
            self.max_mig_devices.clear()
            self.mig_devices.clear()
            self.layouts.clear()
            self.memory_stale.clear()

    def mode_changed(self, pci: str) -> None:
        """A MIG mode change of one GPU: the profile tables and placements stay (NVML documents the
        placements "regardless of whether MIG is enabled or not"; the H200 answers the profile
        infos with MIG off too), the most MIG devices does not (0 with MIG off), and the total
        memory is asked again (nothing says whether it moves with the mode)."""
        with self.lock:
            self.max_mig_devices.pop(pci, None)
            self.layouts.pop(pci, None)
            self.memory_stale.add(pci)
            for uuid in [u for u, r in self.mig_devices.items() if r.pci == pci]:
                del self.mig_devices[uuid]

    def instances_changed(self, pci: str) -> None:
        """gpud created or destroyed an instance on `pci`: its MIG device records are asked again."""
        with self.lock:
            self.layouts.pop(pci, None)
            for uuid in [u for u, r in self.mig_devices.items() if r.pci == pci]:
                del self.mig_devices[uuid]

    def handle_of(self, pci: str) -> Any | None:
        """The device handle this session enumerated for `pci`, if it did."""
        for handle, address in self.enumerated or ():
            if address == pci:
                return handle
        return None

    def store_if(self, generation: int, put: Any) -> None:
        """Run `put()` (a store into this cache) unless the session changed since `generation`."""
        with self.lock:
            if generation == self.generation:
                put()
