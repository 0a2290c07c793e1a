"""A GPU's GPU instances, compute instances and MIG devices as NVML lists them, and what a session
keeps of them (gpud.host.nvidia.nvml_static.SessionCache): the CI profiles of a GI profile, the
most MIG devices a GPU has, what a MIG device's UUID names. gpud.host.nvidia.nvml reads a GPU
through `MigReader`; processes are named from /proc first (`proc_root`), NVML's name second.
"""

from __future__ import annotations

import functools
import os
from ctypes import byref, c_uint
from typing import Any

import msgspec
import pynvml

from gpud.host.kernel.procs import process_name as proc_name
from gpud.host.nvidia import nvml_profiles as profile_tables
from gpud.host.nvidia.nvml_errors import NvmlError, call
from gpud.host.nvidia.nvml_static import GpuStatic, MigDeviceRecord, SessionCache
from gpud.model import CiProfile, ComputeInstance, GpuInstance, Holder, MigProfile, Placement
from gpud.profiles import NOT_IN_MIG_INSTANCE


def _listed(pci: str, function: str, fn: Any, ctype: Any, capacity: int, *args: Any) -> list[Any]:
    """NVML's caller-allocated list: `fn(*args, array, &count)` with room for `capacity` handles
    (at least one), the handles it filled."""
    count = c_uint(0)
    arr = (ctype * max(capacity, 1))()
    call(function, pci, fn, *args, arr, byref(count))
    return [arr[i] for i in range(count.value)]


def _mig_device_at(pci: str, h: Any, index: int) -> Any | None:
    """The MIG device handle at `index` of the GPU, or None where that index holds none."""
    try:
        return pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, index)
    except pynvml.NVMLError as e:
        if e.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
            return None
        raise NvmlError(e.value, "nvmlDeviceGetMigDeviceHandleByIndex", pci) from e


def _no_room(prof: MigProfile, used: set[int]) -> bool:
    """Whether every possible placement of `prof` overlaps a memory slice in `used`: GIs never share
    a memory slice (nvml.h), so no GI of this profile can exist beside the GIs that use them."""
    return bool(prof.placements) and all(used & set(range(p.start, p.start + p.size)) for p in prof.placements)


class MigReader:
    def __init__(self, cache: SessionCache, proc_root: str) -> None:
        self._cache = cache
        self.proc_root = proc_root

    def ci_profiles(self, pci: str, gi_handle: Any, gi_profile_id: int) -> dict[int, CiProfile]:
        """The CI profiles of GI profile `gi_profile_id`, asked through one of its GIs once a session
        (the same for every GI of the profile: docs/hardware/nvml-static-reads.md)."""
        key = (pci, gi_profile_id)
        known = self._cache.ci_profiles.get(key)
        if known is not None:
            return known
        generation = self._cache.generation
        found = profile_tables.ci_profiles(pci, gi_handle)
        self._cache.store_if(generation, lambda: self._cache.ci_profiles.__setitem__(key, found))
        return found

    def _gis(self, pci: str, h: Any, static: GpuStatic) -> list[tuple[Any, GpuInstance]]:
        """The GIs (handle, GI without its CIs), by id."""
        gis: list[tuple[Any, GpuInstance]] = []
        used: set[int] = set()  # memory slices of the GIs found so far
        for prof in static.profiles:
            if _no_room(prof, used):
                continue
            for gi_handle in _listed(pci, "nvmlDeviceGetGpuInstances", pynvml.nvmlDeviceGetGpuInstances,
                                     pynvml.c_nvmlGpuInstance_t, prof.instance_count, h, prof.id):
                gi_info = call("nvmlGpuInstanceGetInfo", pci, pynvml.nvmlGpuInstanceGetInfo, gi_handle)
                if any(g.id == gi_info.id for _, g in gis):
                    continue
                gis.append((gi_handle, GpuInstance(id=gi_info.id, profile_id=gi_info.profileId,
                                                placement=Placement(gi_info.placement.start, gi_info.placement.size))))
                used.update(range(gi_info.placement.start, gi_info.placement.start + gi_info.placement.size))
        return sorted(gis, key=lambda hg: hg[1].id)

    def instances(self, pci: str, h: Any, static: GpuStatic) -> tuple[GpuInstance, ...]:
        """GIs with their CIs as NVML lists them, without MIG UUIDs or holders (a step's check)."""
        return tuple(msgspec.structs.replace(gi, cis=self._cis(pci, handle, gi.profile_id))
                     for handle, gi in self._gis(pci, h, static))

    def _cis(self, pci: str, gi_handle: Any, gi_profile_id: int) -> tuple[ComputeInstance, ...]:
        cis: list[ComputeInstance] = []
        for ci_prof in self.ci_profiles(pci, gi_handle, gi_profile_id).values():
            for ci_handle in _listed(pci, "nvmlGpuInstanceGetComputeInstances", pynvml.nvmlGpuInstanceGetComputeInstances,
                                     pynvml.c_nvmlComputeInstance_t, ci_prof.instance_count, gi_handle, ci_prof.id):
                info = call("nvmlComputeInstanceGetInfo", pci, pynvml.nvmlComputeInstanceGetInfo, ci_handle)
                cis.append(ComputeInstance(id=info.id, profile_id=info.profileId, slices=ci_prof.slices, uuid="",
                                           start=info.placement.start))
        return tuple(sorted(cis, key=lambda c: c.id))

    @staticmethod
    def in_mig_devices(procs: list[Any]) -> dict[tuple[int, int], list[int]] | None:
        """The GPU handle's process list by (GI id, CI id), to stand for each MIG device's own list:
        "In MIG mode, if device handle is provided, the API returns aggregate information, only if
        the caller has appropriate privileges" (nvml.h, nvmlDeviceGetComputeRunningProcesses_v3),
        each process with its GI and CI ids. None (ask each MIG device) unless gpud runs as root:
        what a caller without those privileges gets is not documented."""
        if os.geteuid() != 0:
            return None
        out: dict[tuple[int, int], list[int]] = {}
        for p in procs:
            gi, ci = getattr(p, "gpuInstanceId", None), getattr(p, "computeInstanceId", None)
            if gi is not None and ci is not None and gi != NOT_IN_MIG_INSTANCE:
                out.setdefault((gi, ci), []).append(p.pid)
        return out

    def instances_with_devices(self, pci: str, h: Any, static: GpuStatic,
                                in_devices: dict[tuple[int, int], list[int]] | None) -> tuple[GpuInstance, ...]:
        """GIs with their CIs, MIG UUIDs and holders, read through the MIG devices.

        Every CI is a MIG device (nvml.h, `nvmlDeviceGetMigDeviceHandleByIndex`), and what a MIG
        device's UUID names cannot change while it exists: its GI and CI ids, the CI's profile and
        placement (gpud.host.nvidia.nvml_static.MigDeviceRecord). So a MIG device seen before costs its
        handle, its UUID and its processes; only a GI holding a device not seen before, or none,
        has its CIs listed (and what they are kept). The processes in each come from the GPU's own
        list (`in_devices`) where NVML gives it whole, else from each device. The indices stop being asked once every GI
        found is filled by the CIs found: CIs of one GI never share a compute slice (nvml.h,
        `nvmlGpuInstanceGetComputeInstancePossiblePlacements`), so no further one can exist.

        Before all that, `_unchanged`: when the MIG devices are exactly those of the last read, the
        GIs are not listed at all."""
        cache = self._cache
        generation = cache.generation
        same = self._unchanged(pci, h, static, in_devices)
        if same is not None:
            return same
        gis = self._gis(pci, h, static)
        if not gis:
            cache.store_if(generation, functools.partial(cache.layouts.pop, pci, None))
            return ()
        gi_keys = {(gi.id, gi.profile_id, gi.placement.start, gi.placement.size) for _, gi in gis}
        handle_of = {gi.id: (handle, gi.profile_id) for handle, gi in gis}
        room = {gi.id: next((p.slices for p in static.profiles if p.id == gi.profile_id), 0) for _, gi in gis}
        found: dict[int, list[ComputeInstance]] = {gi.id: [] for _, gi in gis}
        listed: dict[int, tuple[ComputeInstance, ...]] = {}  # GI id -> its CIs, for a GI holding a new device
        unknown: dict[int, dict[int, tuple[str, tuple[Holder, ...]]]] = {}  # GI id -> CI id -> (uuid, holders)
        for i in range(self.max_mig_devices(pci, h)):
            if all(v <= 0 for v in room.values()):
                break
            m = _mig_device_at(pci, h, i)
            if m is None:
                continue
            uuid = call("nvmlDeviceGetUUID", pci, pynvml.nvmlDeviceGetUUID, m)
            known = cache.mig_devices.get(uuid)
            if known is not None and known.pci == pci and known.gi in gi_keys:
                holders = self.mig_holders(pci, m, uuid, in_devices, (known.gi_id, known.ci_id))
                found[known.gi_id].append(ComputeInstance(id=known.ci_id, profile_id=known.profile_id,
                                                          slices=known.slices, uuid=uuid, holders=holders,
                                                          start=known.start))
                room[known.gi_id] -= known.slices
                continue
            gi_id = call("nvmlDeviceGetGpuInstanceId", pci, pynvml.nvmlDeviceGetGpuInstanceId, m)
            ci_id = call("nvmlDeviceGetComputeInstanceId", pci, pynvml.nvmlDeviceGetComputeInstanceId, m)
            holders = self.mig_holders(pci, m, uuid, in_devices, (gi_id, ci_id))
            if gi_id in found:
                unknown.setdefault(gi_id, {})[ci_id] = (uuid, holders)
                if gi_id not in listed:
                    # The GI's CIs say how many devices it holds: the scan goes on until each one's
                    # UUID is found (a GI's other new CIs come at later indices).
                    listed[gi_id] = self._cis(pci, *handle_of[gi_id])
                    room[gi_id] = sum(c.slices for c in listed[gi_id]) - sum(c.slices for c in found[gi_id])
                room[gi_id] -= next((c.slices for c in listed[gi_id] if c.id == ci_id), 0)
        out = []
        for handle, gi in gis:
            if gi.id in unknown or not found[gi.id]:
                details = unknown.get(gi.id, {})
                cis = []
                for ci in listed.get(gi.id) or self._cis(pci, handle, gi.profile_id):
                    uuid, holders = details.get(ci.id, ("", ()))
                    if not uuid:  # seen before, or no MIG device for it: as the device loop found it
                        seen = next((c for c in found[gi.id] if c.id == ci.id), None)
                        uuid, holders = (seen.uuid, seen.holders) if seen is not None else ("", ())
                    cis.append(msgspec.structs.replace(ci, uuid=uuid, holders=holders))
                    if uuid:
                        record = MigDeviceRecord(
                            pci=pci, gi=(gi.id, gi.profile_id, gi.placement.start, gi.placement.size), gi_id=gi.id,
                            ci_id=ci.id, profile_id=ci.profile_id, slices=ci.slices, start=ci.start)
                        cache.store_if(generation, functools.partial(cache.mig_devices.__setitem__, uuid, record))
                out.append(msgspec.structs.replace(gi, cis=tuple(cis)))
            else:
                out.append(msgspec.structs.replace(gi, cis=tuple(sorted(found[gi.id], key=lambda c: c.id))))
        if all(gi.cis and all(c.uuid for c in gi.cis) for gi in out):
            cache.store_if(generation, functools.partial(cache.layouts.__setitem__, pci, tuple(out)))
        else:  # an empty GI, or a CI without a MIG device: nothing a MIG device could vouch for
            cache.store_if(generation, functools.partial(cache.layouts.pop, pci, None))
        return tuple(out)

    def _unchanged(self, pci: str, h: Any, static: GpuStatic,
                   in_devices: dict[tuple[int, int], list[int]] | None) -> tuple[GpuInstance, ...] | None:
        """The last read's GIs and CIs with fresh holders, when NVML still shows exactly its MIG
        devices; None (read the GIs) on any difference or doubt.

        A MIG device's UUID is "globally unique" and "immutable for the lifetime of a MIG device"
        (nvml.h, `nvmlDeviceGetUUID`): a UUID answered now is the CI the last read found, with its
        GI and CI ids, profile and placement, inside the same GI (a CI cannot outlive its GI or
        move; a GI or CI made again is a new MIG device with a new UUID). What else could exist:
        - another GI: only in memory slices the known GIs leave free (GIs never overlap: nvml.h,
          `nvmlDeviceGetGpuInstancePossiblePlacements_v2`), so each profile with a placement there
          is listed (`nvmlDeviceGetGpuInstances`) and must answer none; a packed GPU asks nothing;
        - another CI in a known GI: it is a MIG device (nvml.h, `nvmlDeviceGetMigDeviceHandleByIndex`),
          so the indices are asked to the end unless every GI is filled by its CIs' compute slices;
        - a GI without a CI has no MIG device to vouch for it: such a layout is never kept.
        Any UUID not in the last read, or one of its UUIDs not found, means a change: None."""
        last = self._cache.layouts.get(pci)
        if not last:
            return None
        used: set[int] = set()
        for gi in last:
            used.update(range(gi.placement.start, gi.placement.start + gi.placement.size))
        for prof in static.profiles:
            if _no_room(prof, used):
                continue
            if _listed(pci, "nvmlDeviceGetGpuInstances", pynvml.nvmlDeviceGetGpuInstances,
                       pynvml.c_nvmlGpuInstance_t, prof.instance_count, h, prof.id):
                return None  # a GI where the last read found free memory
        room = {p.id: p.slices for p in static.profiles}
        filled = all(sum(c.slices for c in gi.cis) >= room.get(gi.profile_id, 0) for gi in last)
        expected = {c.uuid: (gi.id, c.id) for gi in last for c in gi.cis}
        holders: dict[str, tuple[Holder, ...]] = {}
        for i in range(self.max_mig_devices(pci, h)):
            if filled and len(holders) == len(expected):
                break
            m = _mig_device_at(pci, h, i)
            if m is None:
                continue
            uuid = call("nvmlDeviceGetUUID", pci, pynvml.nvmlDeviceGetUUID, m)
            if uuid not in expected or uuid in holders:
                return None
            holders[uuid] = self.mig_holders(pci, m, uuid, in_devices, expected[uuid])
        if len(holders) != len(expected):
            return None
        return tuple(msgspec.structs.replace(gi, cis=tuple(msgspec.structs.replace(c, holders=holders[c.uuid])
                                                           for c in gi.cis))
                     for gi in last)

    def mig_holders(self, pci: str, m: Any, uuid: str, in_devices: dict[tuple[int, int], list[int]] | None = None,
                     ids: tuple[int, int] | None = None) -> tuple[Holder, ...]:
        if in_devices is not None and ids is not None:
            pids = in_devices.get(ids, [])
        else:
            pids = [p.pid for p in call("nvmlDeviceGetComputeRunningProcesses", pci,
                                              pynvml.nvmlDeviceGetComputeRunningProcesses, m)]
        return tuple(sorted(Holder(pid=pid, name=self.process_name(pid), device=uuid) for pid in pids))

    def max_mig_devices(self, pci: str, h: Any) -> int:
        """nvmlDeviceGetMaxMigDeviceCount with MIG on: the GPU's most MIG devices, kept for the session
        (with MIG off it answers 0, so it is asked only with MIG on, and a mode change drops it)."""
        known = self._cache.max_mig_devices.get(pci)
        if known is not None:
            return known
        generation = self._cache.generation
        n = int(call("nvmlDeviceGetMaxMigDeviceCount", pci, pynvml.nvmlDeviceGetMaxMigDeviceCount, h))
        self._cache.store_if(generation, lambda: self._cache.max_mig_devices.__setitem__(pci, n))
        return n

    def process_name(self, pid: int) -> str:
        name = proc_name(self.proc_root, pid)
        if name:
            return name
        try:
            return pynvml.nvmlSystemGetProcessName(pid) or "?"
        except pynvml.NVMLError:
            return "?"

    def mig_device(self, pci: str, h: Any, gi_id: int, ci_id: int) -> tuple[str, tuple[Holder, ...]] | None:
        """The MIG device of one CI: its UUID and the processes in it (None: no such CI), without
        reading the whole GPU (a lease's answer, a release's busy check)."""
        for i in range(self.max_mig_devices(pci, h)):
            m = _mig_device_at(pci, h, i)
            if m is None:
                continue
            if (call("nvmlDeviceGetGpuInstanceId", pci, pynvml.nvmlDeviceGetGpuInstanceId, m) == gi_id and
                    call("nvmlDeviceGetComputeInstanceId", pci, pynvml.nvmlDeviceGetComputeInstanceId, m) == ci_id):
                uuid = call("nvmlDeviceGetUUID", pci, pynvml.nvmlDeviceGetUUID, m)
                return uuid, self.mig_holders(pci, m, uuid)
        return None

