"""The MIG half of the fake NVML library: MIG mode, MIG device handles, GPU and compute instance
profiles, placements, creation and destruction, as the C symbols answer them.

Registered into the same library object as gpud.sim.nvml_lib (which imports this module); where a
new instance goes and whether it fits are the GPU's rules (gpud.sim.gpu_rules), this module only
reads the caller's arguments and writes the answers the way the driver does.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, Protocol

import pynvml

import gpud.sim.gpu_rules as rules
import gpud.sim.vgpu as sim_vgpu
from gpud.layout.names import device_name
from gpud.model import MigProfile
from gpud.profiles import ModelInfo
from gpud.sim.gpu_rules import busy, ci_slices, mig_devices, mig_processes, model_of, profile_of
from gpud.sim.nvml_abi import SUCCESS, Ret, as_int, c_array, check_version, deref, nvml, placement_arg, set_ptr
from gpud.sim.state import SimCi, SimGi, SimGpu, SimState

_MAX_MIG_DEVICES = 7


class Handles(Protocol):
    """What these calls ask of the library object (gpud.sim.nvml_lib.FakeNvmlLib, which imports
    this module): the objects a caller's handle names, and the handles it is given for them."""

    def key(self, handle: Any) -> tuple: ...

    def gpu(self, state: SimState, handle: Any, *, allow_mig: bool = False) -> tuple[SimGpu, tuple | None]: ...

    def gi(self, state: SimState, handle: Any) -> tuple[SimGpu, SimGi]: ...

    def ci(self, state: SimState, handle: Any) -> tuple[SimGpu, SimGi, SimCi]: ...

    def gpu_handle(self, gpu: SimGpu) -> int: ...

    def gi_handle(self, gpu: SimGpu, gi: SimGi) -> int: ...

    def ci_handle(self, gpu: SimGpu, gi: SimGi, ci: SimCi) -> int: ...

    def mig_handle(self, gpu: SimGpu, gi: SimGi, ci: SimCi) -> int: ...

# Index constants the real H200 answers with INVALID_ARGUMENT rather than NOT_SUPPORTED (fixture).
_INVALID_GI_INDEXES = {pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX}


# --- MIG mode -----------------------------------------------------------------------------------


@nvml()
def nvmlDeviceGetMigMode(lib: Handles, state: SimState, handle: Any, current_ref: Any, pending_ref: Any) -> None:
    gpu, _ = lib.gpu(state, handle)
    if not model_of(gpu, state.driver_version).mig_capable:
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    current, pending = deref(current_ref), deref(pending_ref)
    current.value = gpu.mig_mode
    pending.value = gpu.mig_pending


@nvml()
def nvmlDeviceSetMigMode(lib: Handles, state: SimState, handle: Any, mode: Any, status_ref: Any) -> None:
    """Hopper applies a change at once when idle; Ampere keeps it pending until a reset.

    Activation status: SUCCESS when applied (or nothing to change), IN_USE when processes keep the
    change pending, RESET_REQUIRED for an idle Ampere GPU (inferred: the change waits for a reset).
    """
    gpu, _ = lib.gpu(state, handle)
    model = model_of(gpu, state.driver_version)
    if not model.mig_capable:
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    mode = as_int(mode)
    if mode not in (0, 1):
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if mode == 1 and model.coherent and state.coherent_memory_mode == "driver":
        # CDMM "is not compatible with MIG" (GPU Operator 25.3.2 known issues); the driver's own
        # answer was never published: NOT_SUPPORTED, as for a GPU without MIG (docs/hardware/grace.md)
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    status = deref(status_ref)
    if mode == 0 and gpu.gis:
        raise Ret(pynvml.NVML_ERROR_IN_USE)
    if mode != gpu.mig_mode and sim_vgpu.placed(state, gpu.address):
        raise Ret(pynvml.NVML_ERROR_IN_USE)  # vGPUs on the GPU: no mode change under them
    v = state.vgpu.get(gpu.address)
    if mode == 0 and gpu.mig_mode and v is not None and v.vfs:
        # `nvidia-smi -mig 0` is refused while SR-IOV VFs exist (docs/hardware/sriov.md): VFs first
        raise Ret(pynvml.NVML_ERROR_IN_USE)
    gpu.mig_pending = mode
    if mode == gpu.mig_mode:
        status.value = SUCCESS
    elif busy(state, gpu):
        status.value = pynvml.NVML_ERROR_IN_USE
    elif model.mode_change_needs_reset:
        status.value = pynvml.NVML_ERROR_RESET_REQUIRED
    else:
        gpu.mig_mode = mode
        status.value = SUCCESS


@nvml()
def nvmlDeviceGetMaxMigDeviceCount(lib: Handles, state: SimState, handle: Any, ref: Any) -> None:
    gpu, _ = lib.gpu(state, handle)
    if not model_of(gpu, state.driver_version).mig_capable:
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    deref(ref).value = _MAX_MIG_DEVICES if gpu.mig_mode == 1 else 0


@nvml()
def nvmlDeviceGetMigDeviceHandleByIndex(lib: Handles, state: SimState, handle: Any, index: Any, ref: Any) -> None:
    """An index past the MIG devices that exist, or any index with MIG off, is NOT_FOUND (the real
    H200 answers index 0 with MIG off so: tests/fixtures/h200/nvml-and-files.json)."""
    gpu, _ = lib.gpu(state, handle)
    if not model_of(gpu, state.driver_version).mig_capable:
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    i = as_int(index)
    if gpu.mig_mode == 1 and i >= _MAX_MIG_DEVICES:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    devices = mig_devices(gpu)
    if i >= len(devices):
        raise Ret(pynvml.NVML_ERROR_NOT_FOUND)
    set_ptr(deref(ref), lib.mig_handle(gpu, *devices[i]))


@nvml()
def nvmlDeviceIsMigDeviceHandle(lib: Handles, state: SimState, handle: Any, ref: Any) -> None:
    key = lib.key(handle)
    if key[0] not in ("gpu", "mig"):
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    deref(ref).value = 1 if key[0] == "mig" else 0


@nvml("nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId", by_symbol=True)
def _instance_id(lib: Handles, state: SimState, handle: Any, ref: Any, *, symbol: str) -> None:
    """The GI (or CI) id of a MIG device; a whole-GPU handle is INVALID_ARGUMENT (the real H200,
    MIG off: nvml-and-files.json)."""
    _, mig = lib.gpu(state, handle, allow_mig=True)
    if mig is None:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    deref(ref).value = mig[0].id if symbol == "nvmlDeviceGetGpuInstanceId" else mig[1].id


@nvml("nvmlDeviceGetAttributes_v2", "nvmlDeviceGetAttributes")
def _attributes(lib: Handles, state: SimState, handle: Any, ref: Any) -> None:
    """A MIG device's share of its GPU: its compute instance's SMs and slices, its GPU instance's
    engines, slices and memory (the GI profile's, as NVML reports for the device). A whole GPU is
    NOT_SUPPORTED (the real H200, MIG off: nvml-and-files.json)."""
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    if mig is None:
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    gi, ci = mig
    model = model_of(gpu, state.driver_version)
    prof = profile_of(model, gi.profile_id)
    assert prof is not None
    ci_prof = next((c for c in prof.ci_profiles if c.id == ci.profile_id), None)
    info = deref(ref)
    info.multiprocessorCount = ci_prof.sms if ci_prof is not None else prof.sms
    info.sharedCopyEngineCount = prof.copy_engines
    info.sharedDecoderCount = prof.decoders
    info.sharedEncoderCount = prof.encoders
    info.sharedJpegCount = prof.jpegs
    info.sharedOfaCount = prof.ofas
    info.gpuInstanceSliceCount = prof.slices
    info.computeInstanceSliceCount = ci_prof.slices if ci_prof is not None else prof.slices
    info.memorySizeMB = prof.memory_mb


@nvml()
def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(lib: Handles, state: SimState, handle: Any, ref: Any) -> None:
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    if mig is None:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    set_ptr(deref(ref), lib.gpu_handle(gpu))


# --- GPU instance profiles and placements -------------------------------------------------------


def _mig_model(lib: Handles, state: SimState, handle: Any) -> tuple[SimGpu, ModelInfo]:
    gpu, _ = lib.gpu(state, handle)
    model = model_of(gpu, state.driver_version)
    if not model.mig_capable:
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return gpu, model


class _GiProfileInfoV3(ctypes.Structure):
    """nvmlGpuInstanceProfileInfo_v3_t (nvml.h): no isP2pSupported, a capabilities field at the
    end; the same size as v2, so only its version number tells the driver which one it got."""

    _fields_ = [("version", ctypes.c_uint), ("id", ctypes.c_uint), ("sliceCount", ctypes.c_uint),
                ("instanceCount", ctypes.c_uint), ("multiprocessorCount", ctypes.c_uint),
                ("copyEngineCount", ctypes.c_uint), ("decoderCount", ctypes.c_uint), ("encoderCount", ctypes.c_uint),
                ("jpegCount", ctypes.c_uint), ("ofaCount", ctypes.c_uint), ("memorySizeMB", ctypes.c_ulonglong),
                ("name", ctypes.c_char * pynvml.NVML_DEVICE_NAME_V2_BUFFER_SIZE), ("capabilities", ctypes.c_uint)]


_GI_INFO_V2 = pynvml.nvmlGpuInstanceProfileInfo_v2
_GI_INFO_V3 = ctypes.sizeof(_GiProfileInfoV3) | (3 << 24)


def _fill_gi_profile(info: Any, prof: MigProfile) -> None:
    """Write `prof` into the caller's struct as the real H200 does (tests/fixtures/h200/2026-12-04):
    v1 (the unversioned symbol) has no version; v2 gets the name; v3 is accepted with the name
    left empty and capabilities 0; after either versioned answer the driver has written 0 into the
    struct's version field, so a caller that reuses the struct gets INVALID_ARGUMENT next time.
    Any other version is INVALID_ARGUMENT (captured: 0, and the v1 size with version 1)."""
    versioned = any(f[0] == "version" for f in type(info)._fields_)
    if versioned and info.version == _GI_INFO_V3:
        info = _GiProfileInfoV3.from_address(ctypes.addressof(info))
        info.name = b""
        info.capabilities = 0
    elif versioned and info.version != _GI_INFO_V2:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    elif versioned:
        info.isP2pSupported = 0
        info.name = f"MIG {prof.name}".encode()
    else:
        info.isP2pSupported = 0
    info.id = prof.id
    info.sliceCount = prof.slices
    info.instanceCount = prof.instance_count
    info.multiprocessorCount = prof.sms
    info.copyEngineCount = prof.copy_engines
    info.decoderCount = prof.decoders
    info.encoderCount = prof.encoders
    info.jpegCount = prof.jpegs
    info.ofaCount = prof.ofas
    info.memorySizeMB = prof.memory_mb
    if versioned:
        info.version = 0


def _profile_by_index(model: ModelInfo, index: int) -> MigProfile:
    if index >= pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT or index in _INVALID_GI_INDEXES:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    # Each model answers an index constant with its own profile id (the A30's 1-slice is id 14).
    pid = next((p for p, i in model.gi_index.items() if i == index), None)
    prof = profile_of(model, pid) if pid is not None else None
    if prof is None:
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return prof


def _answer_gi_profile(lib: Handles, state: SimState, handle: Any, ref: Any, find: Callable[[ModelInfo], MigProfile]) -> None:
    """Both GI profile info calls: MIG-capable GPU, the profile `find` picks from the model (it
    raises NVML's error when there is none), then the caller's struct by its version."""
    _, model = _mig_model(lib, state, handle)
    prof = find(model)
    _fill_gi_profile(deref(ref), prof)


@nvml("nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstanceProfileInfoV")
def _gi_profile_info(lib: Handles, state: SimState, handle: Any, index: Any, ref: Any) -> None:
    """Takes the profile *index* constant; answers with MIG disabled too (as the H200 does)."""
    _answer_gi_profile(lib, state, handle, ref, lambda model: _profile_by_index(model, as_int(index)))


@nvml()
def nvmlDeviceGetGpuInstanceProfileInfoByIdV(lib: Handles, state: SimState, handle: Any, profile_id: Any, ref: Any) -> None:
    """Takes the profile *id*; an id the model lacks answers as _known_profile says."""
    _answer_gi_profile(lib, state, handle, ref, lambda model: _known_profile(model, profile_id, "info"))


# Profile ids the driver knows that the model has no profile for, and how each call answers them
# (the real H200, driver 580.159.04: tests/fixtures/h200/2026-12-04/nvml-real.json). "absent": the
# info call NOT_FOUND, capacity and placements NOT_SUPPORTED; "empty": info NOT_FOUND, capacity and
# placements answer 0; both list 0 GPU instances. Every other id is INVALID_ARGUMENT to every call.
# Other models: no capture, so every id they lack is INVALID_ARGUMENT (unknown).
_DRIVER_IDS_ABSENT: dict[str, dict[int, str]] = {"h200": {6: "absent", 10: "absent", 21: "absent", 32: "empty"}}

_ABSENT_ANSWER = {  # (kind, call) -> NVML error, or None: the call answers an empty result
    ("absent", "info"): pynvml.NVML_ERROR_NOT_FOUND, ("empty", "info"): pynvml.NVML_ERROR_NOT_FOUND,
    ("absent", "capacity"): pynvml.NVML_ERROR_NOT_SUPPORTED, ("empty", "capacity"): None,
    ("absent", "placements"): pynvml.NVML_ERROR_NOT_SUPPORTED, ("empty", "placements"): None,
    ("absent", "instances"): None, ("empty", "instances"): None,
}


def _known_profile(model: ModelInfo, profile_id: Any, call: str = "create") -> MigProfile | Any:
    """The model's profile `profile_id`. One it lacks: INVALID_ARGUMENT, unless the driver knows
    the id (_DRIVER_IDS_ABSENT): then the captured answer of `call`, or None for an empty one."""
    prof = profile_of(model, as_int(profile_id))
    if prof is not None:
        return prof
    kind = _DRIVER_IDS_ABSENT.get(model.key, {}).get(as_int(profile_id))
    if kind is None or call == "create":
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    error = _ABSENT_ANSWER[(kind, call)]
    if error is not None:
        raise Ret(error)
    return None


def _fill_placements(placements: Any, count_ref: Any, items: list[tuple[int, int]], *, short_ok: bool = False) -> int:
    """NVML's caller-allocated two-call pattern for placement lists: a NULL array asks for the
    count. An array with a count shorter than the list: the CI call (no capture) answers
    INSUFFICIENT_SIZE and the count; the GI call (`short_ok`) ignores the count, as the real H200
    does (nvml-real.json: count 0 or 1 given, every placement written, SUCCESS, the true count)."""
    count = deref(count_ref)
    if placements is None:
        count.value = len(items)
        return SUCCESS
    arr = c_array(placements)
    if count.value < len(items) and not short_ok:
        count.value = len(items)
        raise Ret(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    if isinstance(arr, ctypes.Array) and len(arr) < len(items):
        raise ValueError(f"placement array of {len(arr)} for {len(items)} placements: the driver writes past its end")
    for i, (start, size) in enumerate(items):
        arr[i].start = start
        arr[i].size = size
    count.value = len(items)
    return SUCCESS


@nvml("nvmlDeviceGetGpuInstancePossiblePlacements_v2", "nvmlDeviceGetGpuInstancePossiblePlacements", by_symbol=True)
def _possible_placements(lib: Handles, state: SimState, handle: Any, profile_id: Any, placements: Any, count_ref: Any, *,
                         symbol: str) -> int:
    """Caller-allocated two-call pattern: NULL array -> count only. Works with MIG disabled. The
    unversioned symbol refuses the media-extension profiles (+me) with NOT_SUPPORTED, as the real
    H200 does for id 20 (nvml-real.json); the _v2 symbol lists them."""
    _, model = _mig_model(lib, state, handle)
    prof = _known_profile(model, profile_id, "placements")
    if prof is not None and symbol == "nvmlDeviceGetGpuInstancePossiblePlacements" and prof.name.endswith("+me"):
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    items = [] if prof is None else [(pl.start, pl.size) for pl in prof.placements]
    return _fill_placements(placements, count_ref, items, short_ok=True)


@nvml()
def nvmlDeviceGetGpuInstanceRemainingCapacity(lib: Handles, state: SimState, handle: Any, profile_id: Any, ref: Any) -> None:
    gpu, model = _mig_model(lib, state, handle)
    prof = _known_profile(model, profile_id, "capacity")
    deref(ref).value = 0 if prof is None else rules.gi_capacity(gpu, prof)


def _create_gi(lib: Handles, gpu: SimGpu, model: ModelInfo, profile_id: Any, start: int | None, size: int | None,
               out_ref: Any) -> None:
    rules.require_mig_on(gpu)
    gi = rules.create_gi(gpu, model, _known_profile(model, profile_id, "create"), start, size)
    set_ptr(deref(out_ref), lib.gi_handle(gpu, gi))


@nvml()
def nvmlDeviceCreateGpuInstance(lib: Handles, state: SimState, handle: Any, profile_id: Any, out_ref: Any) -> None:
    """Without a placement the driver takes the first free start of its preference order."""
    gpu, model = _mig_model(lib, state, handle)
    _create_gi(lib, gpu, model, profile_id, None, None, out_ref)


@nvml()
def nvmlDeviceCreateGpuInstanceWithPlacement(lib: Handles, state: SimState, handle: Any, profile_id: Any, placement: Any,
                                             out_ref: Any) -> None:
    gpu, model = _mig_model(lib, state, handle)
    _create_gi(lib, gpu, model, profile_id, *placement_arg(placement), out_ref)


@nvml()
def nvmlDeviceGetGpuInstances(lib: Handles, state: SimState, handle: Any, profile_id: Any, arr: Any, count_ref: Any) -> None:
    """With MIG disabled the real H200 answers count 0 (fixture), not NOT_SUPPORTED."""
    gpu, model = _mig_model(lib, state, handle)
    prof = _known_profile(model, profile_id, "instances")
    count = deref(count_ref)
    gis = [] if prof is None else sorted((g for g in gpu.gis if g.profile_id == prof.id), key=lambda g: g.id)
    if arr is None:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    out = deref(arr)
    if isinstance(out, ctypes.Array) and len(out) < len(gis):
        count.value = len(gis)
        raise Ret(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    for i, gi in enumerate(gis):
        set_ptr(out, lib.gi_handle(gpu, gi), offset=i * ctypes.sizeof(ctypes.c_void_p))
    count.value = len(gis)


@nvml()
def nvmlDeviceGetGpuInstanceById(lib: Handles, state: SimState, handle: Any, gi_id: Any, out_ref: Any) -> None:
    """No such GPU instance, MIG off included, is NOT_FOUND (the real H200: nvml-and-files.json)."""
    gpu, _ = _mig_model(lib, state, handle)
    gi = next((g for g in gpu.gis if g.id == as_int(gi_id)), None)
    if gi is None:
        raise Ret(pynvml.NVML_ERROR_NOT_FOUND)
    set_ptr(deref(out_ref), lib.gi_handle(gpu, gi))


@nvml()
def nvmlGpuInstanceGetInfo(lib: Handles, state: SimState, gi_handle: Any, ref: Any) -> None:
    gpu, gi = lib.gi(state, gi_handle)
    info = deref(ref)
    set_ptr(info, lib.gpu_handle(gpu), offset=type(info).device.offset)
    info.id = gi.id
    info.profileId = gi.profile_id
    info.placement.start = gi.start
    info.placement.size = gi.size


@nvml()
def nvmlGpuInstanceDestroy(lib: Handles, state: SimState, gi_handle: Any) -> None:
    gpu, gi = lib.gi(state, gi_handle)
    if gi.cis or any(on_gi == gi.id for _, on_gi in sim_vgpu.placed(state, gpu.address)):
        raise Ret(pynvml.NVML_ERROR_IN_USE)  # compute instances, or a MIG-backed vGPU, live on it
    gpu.gis.remove(gi)


# --- compute instances --------------------------------------------------------------------------


@nvml("nvmlGpuInstanceGetComputeInstanceProfileInfo", "nvmlGpuInstanceGetComputeInstanceProfileInfoV")
def _ci_profile_info(lib: Handles, state: SimState, gi_handle: Any, index: Any, eng_profile: Any, ref: Any) -> None:
    gpu, gi = lib.gi(state, gi_handle)
    idx, eng = as_int(index), as_int(eng_profile)
    if idx >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT or eng >= pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    prof = rules.gi_profile(model_of(gpu, state.driver_version), gi)
    ci_prof = next((c for c in prof.ci_profiles if c.id == idx), None)  # CI ids equal their index
    if ci_prof is None:
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    info = deref(ref)
    check_version(info, pynvml.nvmlComputeInstanceProfileInfo_v2)
    info.id = ci_prof.id
    info.sliceCount = ci_prof.slices
    info.instanceCount = ci_prof.instance_count
    info.multiprocessorCount = ci_prof.sms
    info.sharedCopyEngineCount = prof.copy_engines
    info.sharedDecoderCount = prof.decoders
    info.sharedEncoderCount = prof.encoders
    info.sharedJpegCount = prof.jpegs
    info.sharedOfaCount = prof.ofas
    if any(f[0] == "name" for f in type(info)._fields_):
        info.name = f"MIG {device_name(prof, ci_prof.slices)}".encode()


@nvml()
def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(lib: Handles, state: SimState, gi_handle: Any, ci_profile_id: Any,
                                                       ref: Any) -> None:
    gpu, gi = lib.gi(state, gi_handle)
    deref(ref).value = rules.ci_capacity(model_of(gpu, state.driver_version), gi, as_int(ci_profile_id))


@nvml()
def nvmlGpuInstanceGetComputeInstancePossiblePlacements(lib: Handles, state: SimState, gi_handle: Any, ci_profile_id: Any,
                                                        placements: Any, count_ref: Any) -> int:
    """Caller-allocated two-call pattern, like the GI call: NULL array -> count only. Every
    placement of the profile, taken or not (NVML API reference: "only returns all the possible
    placements"), in compute slices."""
    gpu, gi = lib.gi(state, gi_handle)
    pid = as_int(ci_profile_id)
    if pid >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    ci_prof = rules.ci_profile(model_of(gpu, state.driver_version), gi, pid)
    return _fill_placements(placements, count_ref, [(start, ci_prof.slices) for start in ci_prof.starts])


def _create_ci(lib: Handles, state: SimState, gi_handle: Any, ci_profile_id: Any, start: int | None, size: int | None,
               out_ref: Any) -> None:
    """Both CI creates (gpud.sim.gpu_rules.create_ci says where a CI goes)."""
    gpu, gi = lib.gi(state, gi_handle)
    rules.require_mig_on(gpu)
    pid = as_int(ci_profile_id)
    if pid >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    ci = rules.create_ci(model_of(gpu, state.driver_version), gi, pid, start, size)
    set_ptr(deref(out_ref), lib.ci_handle(gpu, gi, ci))


@nvml()
def nvmlGpuInstanceCreateComputeInstance(lib: Handles, state: SimState, gi_handle: Any, ci_profile_id: Any, out_ref: Any) -> None:
    _create_ci(lib, state, gi_handle, ci_profile_id, None, None, out_ref)


@nvml()
def nvmlGpuInstanceCreateComputeInstanceWithPlacement(lib: Handles, state: SimState, gi_handle: Any, ci_profile_id: Any,
                                                      placement: Any, out_ref: Any) -> None:
    _create_ci(lib, state, gi_handle, ci_profile_id, *placement_arg(placement), out_ref)


@nvml()
def nvmlGpuInstanceGetComputeInstances(lib: Handles, state: SimState, gi_handle: Any, ci_profile_id: Any, arr: Any,
                                       count_ref: Any) -> None:
    gpu, gi = lib.gi(state, gi_handle)
    pid = as_int(ci_profile_id)
    if pid >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT or arr is None:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    count = deref(count_ref)
    cis = sorted((c for c in gi.cis if c.profile_id == pid), key=lambda c: c.id)
    out = deref(arr)
    if isinstance(out, ctypes.Array) and len(out) < len(cis):
        count.value = len(cis)
        raise Ret(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    for i, ci in enumerate(cis):
        set_ptr(out, lib.ci_handle(gpu, gi, ci), offset=i * ctypes.sizeof(ctypes.c_void_p))
    count.value = len(cis)


@nvml()
def nvmlGpuInstanceGetComputeInstanceById(lib: Handles, state: SimState, gi_handle: Any, ci_id: Any, out_ref: Any) -> None:
    gpu, gi = lib.gi(state, gi_handle)
    ci = next((c for c in gi.cis if c.id == as_int(ci_id)), None)
    if ci is None:
        raise Ret(pynvml.NVML_ERROR_NOT_FOUND)
    set_ptr(deref(out_ref), lib.ci_handle(gpu, gi, ci))


@nvml("nvmlComputeInstanceGetInfo_v2", "nvmlComputeInstanceGetInfo")
def _ci_info(lib: Handles, state: SimState, ci_handle: Any, ref: Any) -> None:
    gpu, gi, ci = lib.ci(state, ci_handle)
    model = model_of(gpu, state.driver_version)
    info = deref(ref)
    set_ptr(info, lib.gpu_handle(gpu), offset=type(info).device.offset)
    set_ptr(info, lib.gi_handle(gpu, gi), offset=type(info).gpuInstance.offset)
    info.id = ci.id
    info.profileId = ci.profile_id
    info.placement.start = ci.start
    info.placement.size = ci_slices(model, gi, ci)


@nvml()
def nvmlComputeInstanceDestroy(lib: Handles, state: SimState, ci_handle: Any) -> None:
    _, gi, ci = lib.ci(state, ci_handle)
    if mig_processes(state, ci):
        raise Ret(pynvml.NVML_ERROR_IN_USE)
    gi.cis.remove(ci)
