"""A GPU's MIG profile tables as NVML states them: the GPU instance profiles with their possible
placements, and the compute instance profiles of a GPU instance with theirs.

Traps handled here (docs/hardware/mig-nvml.md): GI profiles are asked by *index* constant but
everything is keyed by the `.id` they answer with; placements are caller-allocated (a first call
for the count, a second with the array). These are fixed for a session: gpud.host.nvidia.nvml
asks them once and keeps them (gpud.host.nvidia.nvml_static).
"""

from __future__ import annotations

from ctypes import byref, c_uint
from typing import Any

import pynvml

from gpud.host.nvidia.nvml_errors import SKIP, NvmlError, call
from gpud.model import CiProfile, MigProfile, Placement


def gi_profiles(pci: str, h: Any) -> tuple[MigProfile, ...]:
    """The GI profiles with their possible placements, asked by every index constant NVML knows
    and keyed by the profile *id* they answer with; CI profiles are added per read (Nvml._profiles)."""
    raw: dict[int, Any] = {}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
        except pynvml.NVMLError as e:
            if e.value in SKIP:
                continue
            raise NvmlError(e.value, "nvmlDeviceGetGpuInstanceProfileInfo", pci) from e
        raw.setdefault(info.id, info)
    out = []
    for info in raw.values():
        name = info.name.decode() if isinstance(info.name, bytes) else info.name
        out.append(MigProfile(
            id=info.id, name=name.removeprefix("MIG "), slices=info.sliceCount,
            memory_mb=info.memorySizeMB, sms=info.multiprocessorCount,
            instance_count=info.instanceCount, placements=possible_placements(pci, h, info.id),
            copy_engines=info.copyEngineCount, decoders=info.decoderCount,
            encoders=info.encoderCount, jpegs=info.jpegCount, ofas=info.ofaCount))
    return tuple(out)


def possible_placements(pci: str, h: Any, profile_id: int) -> tuple[Placement, ...]:
    """Where GIs of a profile may sit (memory slices): possible, not necessarily free."""
    count = c_uint(0)
    fn = "nvmlDeviceGetGpuInstancePossiblePlacements"
    call(fn, pci, pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, profile_id, None, byref(count))
    if count.value == 0:
        return ()
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    call(fn, pci, pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, profile_id, arr, byref(count))
    return tuple(sorted(Placement(arr[i].start, arr[i].size) for i in range(count.value)))


def ci_profiles(pci: str, gi_handle: Any) -> dict[int, CiProfile]:
    """The CI profiles of one GI, by id, each with where its CIs may sit."""
    out: dict[int, CiProfile] = {}
    for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi_handle, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        except pynvml.NVMLError as e:
            if e.value in SKIP:
                continue
            raise NvmlError(e.value, "nvmlGpuInstanceGetComputeInstanceProfileInfo", pci) from e
        if info.id not in out:
            out[info.id] = CiProfile(id=info.id, slices=info.sliceCount, instance_count=info.instanceCount,
                                     sms=info.multiprocessorCount,
                                     starts=ci_starts(pci, gi_handle, info.id))
    return out


def ci_starts(pci: str, gi_handle: Any, ci_profile_id: int) -> tuple[int, ...]:
    """Where CIs of a profile may sit in this GI (compute slices), caller-allocated like the GI
    call. A driver without the call answers nothing: the planner then uses the model's table."""
    fn = "nvmlGpuInstanceGetComputeInstancePossiblePlacements"
    count = c_uint(0)
    try:
        pynvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gi_handle, ci_profile_id, None, byref(count))
        if count.value == 0:
            return ()
        arr = (pynvml.c_nvmlComputeInstancePlacement_t * count.value)()
        pynvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gi_handle, ci_profile_id, arr, byref(count))
    except pynvml.NVMLError as e:
        if e.value in SKIP or e.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            return ()
        raise NvmlError(e.value, fn, pci) from e
    return tuple(sorted(arr[i].start for i in range(count.value)))
