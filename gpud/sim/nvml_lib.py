"""A fake NVML C library: the object installed as `pynvml.nvmlLib` on a simulated host.

Only the library object is replaced, so nvidia-ml-py's own wrappers, ctypes structures, byref
marshalling and NVMLError classes run unchanged: the adapter under test is exercised exactly as on
a real host, traps included (profile index vs id, placement passed by value, c_uint booleans).

Every fake function takes the host lock, counts itself in `state.calls[<C symbol>]`, consumes a
matching `state.faults` entry (`gpud-sim fault`), and returns an int NVML return code. The state
lives on disk (gpud.sim.state), so several processes share one simulated GPU host. Handles are
process-local, as with the real library: real ctypes objects whose addresses map back to an
identity (PCI address, GI, CI / MIG device).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

import pynvml

from gpud.layout.names import device_name
from gpud.model import CiProfile, MigProfile
from gpud.profiles import NOT_IN_MIG_INSTANCE, ModelInfo
from gpud.sim import gi_ids
from gpud.sim import vgpu as sim_vgpu
from gpud.sim.gpu_rules import (
    MIB,
    busy,
    ci_slices,
    gpu_processes,
    is_free,
    memory_slices,
    mig_devices,
    mig_name,
    mig_processes,
    model_of,
    profile_of,
    used_slices,
    visible_gpus,
)
from gpud.sim.state import SimCi, SimGi, SimGpu, SimSession, SimState, locked
from gpud.sim.sysfs_tree import render

SUCCESS = pynvml.NVML_SUCCESS
_MAX_MIG_DEVICES = 7

_ERROR_STRINGS = {
    0: "Success",
    1: "Uninitialized",
    2: "Invalid Argument",
    3: "Not Supported",
    4: "Insufficient Permissions",
    5: "Already Initialized",
    6: "Not Found",
    7: "Insufficient Size",
    9: "Driver Not Loaded",
    13: "Function Not Found",
    15: "GPU is lost",
    16: "GPU requires restart",
    19: "In use by another client",
    23: "Insufficient Resources",
    25: "Argument version mismatch",
    999: "Unknown Error",
}

# Index constants the real H200 answers with INVALID_ARGUMENT rather than NOT_SUPPORTED (fixture).
_INVALID_GI_INDEXES = {pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX}

# Where the driver puts a GI created without a placement (inferred, not documented: docs/hardware/mig-nvml.md): first free start
# in this order. Profiles not listed take their allowed starts in ascending order.
_PREFERENCE: dict[int, tuple[int, ...]] = {
    19: (6, 4, 5, 0, 1, 2, 3),
    20: (6, 4, 5, 0, 1, 2, 3),
    15: (6, 4, 0, 2),  # inferred by analogy with 1g and 2g
    14: (4, 0, 2),
    9: (4, 0),
}

# C symbols that work before nvmlInit.
_NO_INIT = {"nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags", "nvmlErrorString"}


class _Ret(Exception):
    """Raised inside a fake function to return an NVML error code."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


# --- ctypes helpers -----------------------------------------------------------------------------

_CArgObject = type(ctypes.byref(ctypes.c_int()))


def _int(x: Any) -> int:
    return int(x.value) if hasattr(x, "value") else int(x)


def _deref(ref: Any) -> Any:
    """The ctypes object an output/input pointer argument refers to (byref or pointer())."""
    if ref is None:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if isinstance(ref, _CArgObject):
        return ref._obj  # type: ignore[attr-defined]
    if isinstance(ref, ctypes._Pointer):
        if not ref:
            raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ref.contents
    if isinstance(ref, ctypes.Array):
        return ref
    raise TypeError(f"expected a pointer argument, got {type(ref).__name__}")


def _array(ref: Any) -> Any:
    """A caller's array argument, indexable: a ctypes array (pynvml) or a pointer to its first
    element (a C caller, through gpud.sim.nvmlc)."""
    if ref is None:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if isinstance(ref, _CArgObject):
        return ref._obj  # type: ignore[attr-defined]
    return ref


def _addr(handle: Any) -> int | None:
    if handle is None:
        return None
    if isinstance(handle, int):
        return handle
    if isinstance(handle, (ctypes._Pointer, ctypes.c_void_p)):
        return ctypes.cast(handle, ctypes.c_void_p).value
    raise TypeError(f"expected an NVML handle, got {type(handle).__name__}")


def _set_ptr(obj: Any, addr: int, offset: int = 0) -> None:
    """Store a handle (pointer value) into a ctypes pointer object or a pointer-typed field."""
    ctypes.c_void_p.from_address(ctypes.addressof(obj) + offset).value = addr


def _write_str(buf: Any, length: Any, text: str) -> None:
    data = text.encode() + b"\0"
    if buf is None:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if len(data) > _int(length):
        raise _Ret(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    ctypes.memmove(buf, data, len(data))


def _placement_arg(placement: Any) -> tuple[int, int]:
    """(start, size) of a placement the caller passed by pointer, as NVML's C API takes it."""
    if isinstance(placement, ctypes.Structure):
        raise TypeError("placement passed by value: the real libnvidia-ml reads a pointer here and crashes; "
                        "pass byref(placement)")
    pl = _deref(placement)
    return int(pl.start), int(pl.size)


def _check_version(info: Any, expected: int) -> None:
    if any(f[0] == "version" for f in type(info)._fields_) and info.version != expected:
        raise _Ret(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)


# --- the library object -------------------------------------------------------------------------

_IMPLS: dict[str, Callable[..., Any]] = {}


# C symbols whose work waits (an event wait): counted and checked for faults under the host lock,
# run without it, so a wait never holds up other processes' NVML calls.
_UNLOCKED: set[str] = set()


def _nvml(*names: str, unlocked: bool = False):
    def deco(fn):
        for n in names or (fn.__name__,):
            _IMPLS[n] = fn
            if unlocked:
                _UNLOCKED.add(n)
        return fn

    return deco


def function_names() -> list[str]:
    """C symbols the fake library implements (for `gpud-sim fault` validation)."""
    return sorted(_IMPLS)


def fault_matches(fault_function: str, symbol: str) -> bool:
    """A fault named after the pynvml-level name also hits its versioned C symbol."""
    return symbol == fault_function or symbol in (fault_function + "_v2", fault_function + "_v3",
                                                  fault_function + "V")


# Calls after which the simulated /dev (MIG capability nodes) must be rendered again.
_CHANGES_DEVICES = frozenset({
    "nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstance", "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlGpuInstanceCreateComputeInstance", "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
    "nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy",
})


class FakeNvmlLib:
    """Stands in for `CDLL("libnvidia-ml.so.1")`: attribute lookup yields C-like functions."""

    def __init__(self, host_dir: str):
        self.host_dir = str(host_dir)
        self._inits = 0
        self._handles: dict[tuple, Any] = {}  # identity -> ctypes buffer the handle points at
        self._keys: dict[int, tuple] = {}  # address -> identity
        self._fns: dict[str, Callable[..., Any]] = {}
        self._mutex = threading.Lock()
        self._event_sets: list[EventSet] = []
        # PCI address -> which nvidia probe of it the open session enumerated at nvmlInit (index order)
        self.enumerated: dict[str, int] = {}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or name not in _IMPLS:
            raise AttributeError(name)
        fn = self._fns.get(name)
        if fn is None:
            impl = _IMPLS[name]

            def fn(*args, _name=name, _impl=impl):
                return self._call(_name, _impl, args)

            fn.__name__ = name
            self._fns[name] = fn
        return fn

    # handles ---------------------------------------------------------------------------------
    def handle(self, key: tuple) -> int:
        with self._mutex:
            buf = self._handles.get(key)
            if buf is None:
                buf = ctypes.c_uint64(len(self._handles) + 1)
                self._handles[key] = buf
                self._keys[ctypes.addressof(buf)] = key
            return ctypes.addressof(buf)

    def key(self, handle: Any) -> tuple:
        addr = _addr(handle)
        key = self._keys.get(addr) if addr else None
        if key is None:
            raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return key

    # dispatch --------------------------------------------------------------------------------
    def _call(self, name: str, impl: Callable[..., Any], args: tuple) -> Any:
        crash: BaseException | None = None
        result: Any = None
        with locked(self.host_dir) as state:
            state.calls[name] = state.calls.get(name, 0) + 1
            if name == "nvmlErrorString":
                return impl(self, state, *args)
            for fault in list(state.faults):
                if fault_matches(fault.function, name):
                    fault.seen += 1
                    if fault.seen >= fault.nth:
                        state.faults.remove(fault)
                        return fault.error
            if name not in _NO_INIT and self._inits <= 0:
                return pynvml.NVML_ERROR_UNINITIALIZED
            if name not in _UNLOCKED:
                try:
                    ret = impl(self, state, *args)
                    result = SUCCESS if ret is None else ret
                    if result == SUCCESS and name in _CHANGES_DEVICES:
                        # MIG devices come and go as /dev/nvidia-caps nodes: keep the tree in step.
                        render(self.host_dir, state)
                except _Ret as r:
                    result = r.code
                except (TypeError, ValueError) as e:  # what would be a crash or garbage in C
                    crash = e
        if crash is not None:
            raise crash
        if name in _UNLOCKED:
            try:
                ret = impl(self, None, *args)
                result = SUCCESS if ret is None else ret
            except _Ret as r:
                result = r.code
        return result

    # resolution ------------------------------------------------------------------------------
    def gpu(self, state: SimState, handle: Any, *, allow_mig: bool = False) -> tuple[SimGpu, tuple | None]:
        """The GPU a handle names, plus (gi, ci) when it is a MIG device handle."""
        key = self.key(handle)
        if key[0] == "gpu":
            gpu = self._visible(state, key[1])
            return gpu, None
        if key[0] == "mig":
            if not allow_mig:
                raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
            gpu = self._visible(state, key[1])
            gi, ci = self._find_ci(gpu, key[2], key[3])
            return gpu, (gi, ci)
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _visible(self, state: SimState, address: str) -> SimGpu:
        """A GPU this session enumerated that is still on nvidia; one that left is lost to it."""
        gpu = next((g for g in visible_gpus(state) if g.address == address), None)
        if gpu is None or self.enumerated.get(address) != state.functions[address].nvidia_probes:
            raise _Ret(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    # enumeration: a snapshot per session, as the real library takes at nvmlInit -----------------
    def enumerate_devices(self, state: SimState) -> None:
        """At the session's first nvmlInit: the GPUs on nvidia now are the session's devices, in
        index order. A GPU that comes to nvidia later stays unknown until nvmlShutdown + nvmlInit
        (docs/hardware/nvml-enumeration.md)."""
        if self._inits == 0:
            self.enumerated = {g.address: state.functions[g.address].nvidia_probes for g in visible_gpus(state)}

    def forget_devices(self) -> None:
        """At the last nvmlShutdown: the session's device list goes with it."""
        if self._inits <= 0:
            self.enumerated = {}

    @staticmethod
    def _find_ci(gpu: SimGpu, gi_id: int, uuid: str) -> tuple[SimGi, SimCi]:
        for gi in gpu.gis:
            if gi.id == gi_id:
                for ci in gi.cis:
                    if ci.uuid == uuid:
                        return gi, ci
        raise _Ret(pynvml.NVML_ERROR_NOT_FOUND)

    def gi(self, state: SimState, handle: Any) -> tuple[SimGpu, SimGi]:
        key = self.key(handle)
        if key[0] != "gi":
            raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._visible(state, key[1])
        if gpu.mig_mode != 1:
            raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
        for gi in gpu.gis:
            if (gi.id, gi.profile_id, gi.start) == key[2:]:
                return gpu, gi
        raise _Ret(pynvml.NVML_ERROR_NOT_FOUND)

    def ci(self, state: SimState, handle: Any) -> tuple[SimGpu, SimGi, SimCi]:
        key = self.key(handle)
        if key[0] != "ci":
            raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._visible(state, key[1])
        gi, ci = self._find_ci(gpu, key[2], key[3])
        return gpu, gi, ci

    def new_event_set(self) -> int:
        with self._mutex:
            self._event_sets.append(EventSet())
            n = len(self._event_sets) - 1
        return self.handle(("eventset", n))

    def event_set(self, handle: Any) -> EventSet:
        key = self.key(handle)
        if key[0] != "eventset" or self._event_sets[key[1]].freed:
            raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._event_sets[key[1]]

    def free_event_set(self, handle: Any) -> None:
        es = self.event_set(handle)
        with es.cond:
            es.freed = True
            es.cond.notify_all()

    def gpu_handle(self, gpu: SimGpu) -> int:
        return self.handle(("gpu", gpu.address))

    def gi_handle(self, gpu: SimGpu, gi: SimGi) -> int:
        return self.handle(("gi", gpu.address, gi.id, gi.profile_id, gi.start))

    def ci_handle(self, gpu: SimGpu, gi: SimGi, ci: SimCi) -> int:
        return self.handle(("ci", gpu.address, gi.id, ci.uuid))

    def mig_handle(self, gpu: SimGpu, gi: SimGi, ci: SimCi) -> int:
        return self.handle(("mig", gpu.address, gi.id, ci.uuid))


# --- system -------------------------------------------------------------------------------------


@_nvml("nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags")
def _init(lib: FakeNvmlLib, state: SimState, flags: Any = 0) -> int:
    if "nvidia" not in state.loaded_modules:
        return pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    lib.enumerate_devices(state)
    lib._inits += 1
    if lib._inits == 1:
        open_session(lib, state)
    return SUCCESS


@_nvml()
def nvmlShutdown(lib: FakeNvmlLib, state: SimState) -> int:
    lib._inits -= 1
    lib.forget_devices()
    if lib._inits == 0:
        close_session(lib, state)
    return SUCCESS


# Session tracking: what this library's open session holds, kept in the state file so
# the simulated kernel and nvidia-smi see it from other processes.
def _session_owner(lib: FakeNvmlLib) -> str:
    return f"{os.getpid()}:{id(lib):x}"


def open_session(lib: FakeNvmlLib, state: SimState) -> None:
    """The first nvmlInit of this library opens the device node of every GPU on nvidia."""
    gpus = sorted(a for a, f in state.functions.items() if f.present and f.driver == "nvidia" and a in state.gpus)
    owner = _session_owner(lib)
    state.sessions = [s for s in state.sessions if s.owner != owner]
    state.sessions.append(SimSession(owner=owner, pid=os.getpid(), name=_comm(), gpus=gpus))
    _render(lib, state)


def close_session(lib: FakeNvmlLib, state: SimState) -> None:
    owner = _session_owner(lib)
    state.sessions = [s for s in state.sessions if s.owner != owner]
    _render(lib, state)


def _comm() -> str:
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return "python3"


def _render(lib: FakeNvmlLib, state: SimState) -> None:
    render(lib.host_dir, state)  # the session's open nodes show in DIR/proc


@_nvml()
def nvmlErrorString(lib: FakeNvmlLib, state: SimState, result: Any) -> bytes:
    return _ERROR_STRINGS.get(_int(result), "Unknown Error").encode()


@_nvml()
def nvmlSystemGetDriverVersion(lib, state, buf, length):
    _write_str(buf, length, state.driver_version)


@_nvml()
def nvmlSystemGetNVMLVersion(lib, state, buf, length):
    _write_str(buf, length, f"{state.cuda_version // 1000}.{state.driver_version}")


@_nvml("nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2")
def _cuda_version(lib, state, ref):
    _deref(ref).value = state.cuda_version


@_nvml()
def nvmlSystemGetProcessName(lib, state, pid, buf, length):
    proc = next((p for p in state.processes if p.pid == _int(pid)), None)
    if proc is None:
        raise _Ret(pynvml.NVML_ERROR_NOT_FOUND)
    _write_str(buf, length, proc.name)


# --- device enumeration and identity ------------------------------------------------------------


@_nvml("nvmlDeviceGetCount", "nvmlDeviceGetCount_v2")
def _count(lib, state, ref):
    _deref(ref).value = len(lib.enumerated)


@_nvml("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2")
def _by_index(lib, state, index, ref):
    i = _int(index)
    if i >= len(lib.enumerated):
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    _set_ptr(_deref(ref), lib.gpu_handle(lib._visible(state, list(lib.enumerated)[i])))


def _norm_bus_id(text: str) -> str:
    """Any of "00000000:3B:00.0", "0000:3b:00.0", "3b:00.0" -> "0000:3b:00.0"."""
    parts = text.strip().lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    try:
        domain = int(parts[0], 16)
        bus = int(parts[1], 16)
        dev, fn = parts[2].split(".")
        device, function = int(dev, 16), int(fn, 16)
    except ValueError:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
    # A GPU is function 0: the real H200 answers INVALID_ARGUMENT for any other function, and
    # NOT_FOUND for a well-formed address no GPU has (tests/fixtures/h200-goprobe/handle-lookups.txt).
    if function != 0:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function}"


@_nvml("nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetHandleByPciBusId_v2")
def _by_pci(lib, state, bus_id, ref):
    text = bus_id.value if isinstance(bus_id, ctypes.c_char_p) else bus_id
    if not text:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    address = _norm_bus_id(text.decode() if isinstance(text, bytes) else text)
    if address not in lib.enumerated:
        raise _Ret(pynvml.NVML_ERROR_NOT_FOUND)
    _set_ptr(_deref(ref), lib.gpu_handle(lib._visible(state, address)))


@_nvml()
def nvmlDeviceGetHandleByUUID(lib, state, uuid, ref):
    text = uuid.value if isinstance(uuid, ctypes.c_char_p) else uuid
    if text is None:  # a NULL string; an empty one is only a UUID no GPU has (the real H200: NOT_FOUND)
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    text = text.decode() if isinstance(text, bytes) else text
    for gpu in visible_gpus(state):
        if lib.enumerated.get(gpu.address) != state.functions[gpu.address].nvidia_probes:
            continue
        if gpu.uuid == text:
            _set_ptr(_deref(ref), lib.gpu_handle(gpu))
            return
        for gi, ci in mig_devices(gpu):
            if ci.uuid == text:
                _set_ptr(_deref(ref), lib.mig_handle(gpu, gi, ci))
                return
    raise _Ret(pynvml.NVML_ERROR_NOT_FOUND)


@_nvml()
def nvmlDeviceGetIndex(lib, state, handle, ref):
    gpu, _ = lib.gpu(state, handle)
    _deref(ref).value = list(lib.enumerated).index(gpu.address)


@_nvml()
def nvmlDeviceGetName(lib, state, handle, buf, length):
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    model = model_of(gpu)
    name = model.name if mig is None else f"{model.name} MIG {mig_name(model, *mig)}"
    _write_str(buf, length, name)


@_nvml()
def nvmlDeviceGetCudaComputeCapability(lib, state, handle, major_ref, minor_ref):
    gpu, _ = lib.gpu(state, handle)
    major, minor = model_of(gpu).compute_capability
    _deref(major_ref).value = major
    _deref(minor_ref).value = minor


@_nvml()
def nvmlDeviceGetUUID(lib, state, handle, buf, length):
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    _write_str(buf, length, gpu.uuid if mig is None else mig[1].uuid)


@_nvml()
def nvmlDeviceGetSerial(lib, state, handle, buf, length):
    gpu, _ = lib.gpu(state, handle)
    if not gpu.serial:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    _write_str(buf, length, gpu.serial)


@_nvml()
def nvmlDeviceGetMinorNumber(lib, state, handle, ref):
    gpu, _ = lib.gpu(state, handle)
    _deref(ref).value = gpu.minor


@_nvml("nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo")
def _pci_info(lib, state, handle, ref):
    gpu, _ = lib.gpu(state, handle, allow_mig=True)  # a MIG handle reports its parent's bus
    f = state.functions[gpu.address]
    info = _deref(ref)
    domain, bus, rest = gpu.address.split(":")
    dev = int(rest.split(".")[0], 16)
    legacy = f"{int(domain, 16):04X}:{int(bus, 16):02X}:{dev:02X}.{rest.split('.')[1]}"
    full = f"{int(domain, 16):08X}:{int(bus, 16):02X}:{dev:02X}.{rest.split('.')[1]}"
    info.domain = int(domain, 16)
    info.bus = int(bus, 16)
    info.device = dev
    info.pciDeviceId = (f.device << 16) | f.vendor
    info.pciSubSystemId = (f.subsystem_device << 16) | f.subsystem_vendor
    names = [x[0] for x in type(info)._fields_]
    if "busIdLegacy" in names:
        info.busIdLegacy = legacy.encode()
        info.busId = full.encode()
    else:
        info.busId = full.encode()


@_nvml("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2")
def _memory(lib, state, handle, ref):
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    info = _deref(ref)
    if any(f[0] == "version" for f in type(info)._fields_):
        _check_version(info, pynvml.nvmlMemory_v2)
    model = model_of(gpu)
    if mig is None:
        total = model.memory_mb * MIB
        used = sum(p.used_mb for p in gpu_processes(state, gpu)) * MIB
    else:
        prof = profile_of(model, mig[0].profile_id)
        total = (prof.memory_mb if prof else 0) * MIB
        used = sum(p.used_mb for p in mig_processes(state, mig[1])) * MIB
    info.total = total
    info.used = min(used, total)
    info.free = total - info.used


# --- processes ----------------------------------------------------------------------------------


@_nvml("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
       "nvmlDeviceGetComputeRunningProcesses")
def _processes(lib, state, handle, count_ref, infos):
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    if mig is None:
        rows = [(p, NOT_IN_MIG_INSTANCE, NOT_IN_MIG_INSTANCE) for p in gpu_processes(state, gpu)]
    else:
        gi, ci = mig
        rows = [(p, gi.id, ci.id) for p in mig_processes(state, ci)]
    count = _deref(count_ref)
    if infos is None or count.value < len(rows):
        count.value = len(rows)
        return SUCCESS if not rows else pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    for i, (p, gi_id, ci_id) in enumerate(rows):
        infos[i].pid = p.pid
        infos[i].usedGpuMemory = p.used_mb * MIB
        infos[i].gpuInstanceId = gi_id
        infos[i].computeInstanceId = ci_id
    count.value = len(rows)
    return SUCCESS


# --- events -------------------------------------------------------------------------------------

# What the real H200 answers to nvmlDeviceGetSupportedEventTypes (0xff9f: nvml-and-files.json);
# served for every simulated GPU, no other model's answer having been captured.
SUPPORTED_EVENT_TYPES = 0xFF9F


class EventSet:
    """An nvmlEventSet_t: the GPUs and event types registered on it. The simulated host raises no
    events (no XIDs, no ECC errors), so a wait always ends at its timeout, waking only early when
    the set is freed; waiters sleep on a condition, never poll."""

    def __init__(self) -> None:
        self.registered: dict[str, int] = {}  # PCI address -> event type mask
        self.freed = False
        self.cond = threading.Condition()


@_nvml()
def nvmlEventSetCreate(lib, state, ref):
    _set_ptr(_deref(ref), lib.new_event_set())


@_nvml()
def nvmlDeviceGetSupportedEventTypes(lib, state, handle, ref):
    lib.gpu(state, handle)
    _deref(ref).value = SUPPORTED_EVENT_TYPES


@_nvml()
def nvmlDeviceRegisterEvents(lib, state, handle, event_types, set_handle):
    """Types the GPU does not support are NOT_SUPPORTED, as NVML's reference says of this call."""
    gpu, _ = lib.gpu(state, handle)
    types = _int(event_types)
    if types & ~SUPPORTED_EVENT_TYPES:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    es = lib.event_set(set_handle)
    es.registered[gpu.address] = es.registered.get(gpu.address, 0) | types


@_nvml("nvmlEventSetWait_v2", "nvmlEventSetWait", unlocked=True)
def _event_wait(lib, state, set_handle, data_ref, timeout_ms):
    """Blocks for the timeout (no event ever comes), then NVML_ERROR_TIMEOUT."""
    es = lib.event_set(set_handle)
    _deref(data_ref)
    with es.cond:
        es.cond.wait_for(lambda: es.freed, _int(timeout_ms) / 1000)
        if es.freed:
            raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    raise _Ret(pynvml.NVML_ERROR_TIMEOUT)


@_nvml()
def nvmlEventSetFree(lib, state, set_handle):
    lib.free_event_set(set_handle)


# --- MIG mode -----------------------------------------------------------------------------------


@_nvml()
def nvmlDeviceGetMigMode(lib, state, handle, current_ref, pending_ref):
    gpu, _ = lib.gpu(state, handle)
    if not model_of(gpu).mig_capable:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    current, pending = _deref(current_ref), _deref(pending_ref)
    current.value = gpu.mig_mode
    pending.value = gpu.mig_pending


@_nvml()
def nvmlDeviceSetMigMode(lib, state, handle, mode, status_ref):
    """Hopper applies a change at once when idle; Ampere keeps it pending until a reset.

    Activation status: SUCCESS when applied (or nothing to change), IN_USE when processes keep the
    change pending, RESET_REQUIRED for an idle Ampere GPU (inferred: the change waits for a reset).
    """
    gpu, _ = lib.gpu(state, handle)
    model = model_of(gpu)
    if not model.mig_capable:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    mode = _int(mode)
    if mode not in (0, 1):
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    status = _deref(status_ref)
    if mode == 0 and gpu.gis:
        raise _Ret(pynvml.NVML_ERROR_IN_USE)
    if mode != gpu.mig_mode and sim_vgpu.placed(state, gpu.address):
        raise _Ret(pynvml.NVML_ERROR_IN_USE)  # vGPUs on the GPU: no mode change under them
    v = state.vgpu.get(gpu.address)
    if mode == 0 and gpu.mig_mode and v is not None and v.vfs:
        # `nvidia-smi -mig 0` is refused while SR-IOV VFs exist (docs/hardware/sriov.md): VFs first
        raise _Ret(pynvml.NVML_ERROR_IN_USE)
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


@_nvml()
def nvmlDeviceGetMaxMigDeviceCount(lib, state, handle, ref):
    gpu, _ = lib.gpu(state, handle)
    if not model_of(gpu).mig_capable:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    _deref(ref).value = _MAX_MIG_DEVICES if gpu.mig_mode == 1 else 0


@_nvml()
def nvmlDeviceGetMigDeviceHandleByIndex(lib, state, handle, index, ref):
    """An index past the MIG devices that exist, or any index with MIG off, is NOT_FOUND (the real
    H200 answers index 0 with MIG off so: tests/fixtures/h200/nvml-and-files.json)."""
    gpu, _ = lib.gpu(state, handle)
    if not model_of(gpu).mig_capable:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    i = _int(index)
    if gpu.mig_mode == 1 and i >= _MAX_MIG_DEVICES:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    devices = mig_devices(gpu)
    if i >= len(devices):
        raise _Ret(pynvml.NVML_ERROR_NOT_FOUND)
    _set_ptr(_deref(ref), lib.mig_handle(gpu, *devices[i]))


@_nvml()
def nvmlDeviceIsMigDeviceHandle(lib, state, handle, ref):
    key = lib.key(handle)
    if key[0] not in ("gpu", "mig"):
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    _deref(ref).value = 1 if key[0] == "mig" else 0


@_nvml()
def nvmlDeviceGetGpuInstanceId(lib, state, handle, ref):
    """A whole-GPU handle is INVALID_ARGUMENT (the real H200, MIG off: nvml-and-files.json)."""
    _, mig = lib.gpu(state, handle, allow_mig=True)
    if mig is None:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    _deref(ref).value = mig[0].id


@_nvml()
def nvmlDeviceGetComputeInstanceId(lib, state, handle, ref):
    """A whole-GPU handle is INVALID_ARGUMENT (the real H200: nvml-and-files.json)."""
    _, mig = lib.gpu(state, handle, allow_mig=True)
    if mig is None:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    _deref(ref).value = mig[1].id


@_nvml("nvmlDeviceGetAttributes_v2", "nvmlDeviceGetAttributes")
def _attributes(lib, state, handle, ref):
    """A MIG device's share of its GPU: its compute instance's SMs and slices, its GPU instance's
    engines, slices and memory (the GI profile's, as NVML reports for the device). A whole GPU is
    NOT_SUPPORTED (the real H200, MIG off: nvml-and-files.json)."""
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    if mig is None:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    gi, ci = mig
    model = model_of(gpu)
    prof = profile_of(model, gi.profile_id)
    assert prof is not None
    ci_prof = next((c for c in prof.ci_profiles if c.id == ci.profile_id), None)
    info = _deref(ref)
    info.multiprocessorCount = ci_prof.sms if ci_prof is not None else prof.sms
    info.sharedCopyEngineCount = prof.copy_engines
    info.sharedDecoderCount = prof.decoders
    info.sharedEncoderCount = prof.encoders
    info.sharedJpegCount = prof.jpegs
    info.sharedOfaCount = prof.ofas
    info.gpuInstanceSliceCount = prof.slices
    info.computeInstanceSliceCount = ci_prof.slices if ci_prof is not None else prof.slices
    info.memorySizeMB = prof.memory_mb


@_nvml()
def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(lib, state, handle, ref):
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    if mig is None:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    _set_ptr(_deref(ref), lib.gpu_handle(gpu))


# --- GPU instance profiles and placements -------------------------------------------------------


def _mig_model(lib, state, handle) -> tuple[SimGpu, ModelInfo]:
    gpu, _ = lib.gpu(state, handle)
    model = model_of(gpu)
    if not model.mig_capable:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return gpu, model


def _fill_gi_profile(info: Any, prof: MigProfile) -> None:
    info.id = prof.id
    info.isP2pSupported = 0
    info.sliceCount = prof.slices
    info.instanceCount = prof.instance_count
    info.multiprocessorCount = prof.sms
    info.copyEngineCount = prof.copy_engines
    info.decoderCount = prof.decoders
    info.encoderCount = prof.encoders
    info.jpegCount = prof.jpegs
    info.ofaCount = prof.ofas
    info.memorySizeMB = prof.memory_mb
    if any(f[0] == "name" for f in type(info)._fields_):
        info.name = f"MIG {prof.name}".encode()


def _profile_by_index(model: ModelInfo, index: int) -> MigProfile:
    if index >= pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT or index in _INVALID_GI_INDEXES:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    # Each model answers an index constant with its own profile id (the A30's 1-slice is id 14).
    pid = next((p for p, i in model.gi_index.items() if i == index), None)
    prof = profile_of(model, pid) if pid is not None else None
    if prof is None:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return prof


def _answer_gi_profile(lib, state, handle, ref, find: Callable[[ModelInfo], MigProfile]) -> None:
    """Both GI profile info calls: MIG-capable GPU, versioned struct, then the profile `find`
    picks from the model (it raises NVML's error when there is none)."""
    _, model = _mig_model(lib, state, handle)
    info = _deref(ref)
    _check_version(info, pynvml.nvmlGpuInstanceProfileInfo_v2)
    _fill_gi_profile(info, find(model))


@_nvml("nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstanceProfileInfoV")
def _gi_profile_info(lib, state, handle, index, ref):
    """Takes the profile *index* constant; answers with MIG disabled too (as the H200 does)."""
    _answer_gi_profile(lib, state, handle, ref, lambda model: _profile_by_index(model, _int(index)))


@_nvml()
def nvmlDeviceGetGpuInstanceProfileInfoByIdV(lib, state, handle, profile_id, ref):
    """Takes the profile *id*; an id the model does not have is INVALID_ARGUMENT."""
    _answer_gi_profile(lib, state, handle, ref, lambda model: _known_profile(model, profile_id))


def _known_profile(model: ModelInfo, profile_id: Any) -> MigProfile:
    prof = profile_of(model, _int(profile_id))
    if prof is None:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return prof


def _fill_placements(placements, count_ref, items: list[tuple[int, int]]) -> int:
    """NVML's caller-allocated two-call pattern for placement lists (GI and CI alike): a NULL array
    asks for the count; an array shorter than the list gets INSUFFICIENT_SIZE and the count."""
    count = _deref(count_ref)
    if placements is None:
        count.value = len(items)
        return SUCCESS
    arr = _array(placements)
    if count.value < len(items):
        count.value = len(items)
        raise _Ret(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    for i, (start, size) in enumerate(items):
        arr[i].start = start
        arr[i].size = size
    count.value = len(items)
    return SUCCESS


@_nvml("nvmlDeviceGetGpuInstancePossiblePlacements_v2", "nvmlDeviceGetGpuInstancePossiblePlacements")
def _possible_placements(lib, state, handle, profile_id, placements, count_ref):
    """Caller-allocated two-call pattern: NULL array -> count only. Works with MIG disabled."""
    _, model = _mig_model(lib, state, handle)
    prof = _known_profile(model, profile_id)
    return _fill_placements(placements, count_ref, [(pl.start, pl.size) for pl in prof.placements])


def _free_placements(gpu: SimGpu, prof: MigProfile) -> list[int]:
    used = used_slices(gpu)
    return [pl.start for pl in prof.placements if not (used & pl.slices)]


@_nvml()
def nvmlDeviceGetGpuInstanceRemainingCapacity(lib, state, handle, profile_id, ref):
    gpu, model = _mig_model(lib, state, handle)
    prof = _known_profile(model, profile_id)
    existing = sum(1 for g in gpu.gis if g.profile_id == prof.id)
    _deref(ref).value = max(0, min(len(_free_placements(gpu, prof)), prof.instance_count - existing))


def _require_mig_on(gpu: SimGpu) -> None:
    if gpu.mig_mode != 1 or gpu.mig_pending != 1:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)


def _create_gi(lib: FakeNvmlLib, gpu: SimGpu, model: ModelInfo, profile_id: Any, start: int | None,
               size: int | None, out_ref: Any) -> None:
    _require_mig_on(gpu)
    prof = _known_profile(model, profile_id)
    pl_size = prof.placements[0].size
    starts = [pl.start for pl in prof.placements]
    if start is not None and (start not in starts or size != pl_size):
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if sum(1 for g in gpu.gis if g.profile_id == prof.id) >= prof.instance_count:
        raise _Ret(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    if start is None:
        # The inferred order comes from 8-memory-slice GPUs (A100, H100, H200), where these ids are
        # 1g, 2g and 3g; on 4-slice GPUs (A30, RTX PRO 6000) id 14 is 1g and the order does not apply.
        preferred = _PREFERENCE.get(prof.id, ()) if memory_slices(model) == 8 else ()
        order = tuple(preferred) + tuple(sorted(s for s in starts if s not in preferred))
        start = next((s for s in order if s in starts and is_free(gpu, s, pl_size)), None)
        if start is None:
            raise _Ret(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    elif not is_free(gpu, start, pl_size):
        raise _Ret(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    out = _deref(out_ref)
    # The id follows the memory placement, as the driver numbers it (gpud.sim.gi_ids).
    gi_id = gi_ids.gi_id(gpu.gi_id_order, start, pl_size, memory_slices(model))
    gi = SimGi(id=gi_id, profile_id=prof.id, start=start, size=pl_size)
    gpu.gis.append(gi)
    _set_ptr(out, lib.gi_handle(gpu, gi))


@_nvml()
def nvmlDeviceCreateGpuInstance(lib, state, handle, profile_id, out_ref):
    """Without a placement the driver takes the first free start of its preference order."""
    gpu, model = _mig_model(lib, state, handle)
    _create_gi(lib, gpu, model, profile_id, None, None, out_ref)


@_nvml()
def nvmlDeviceCreateGpuInstanceWithPlacement(lib, state, handle, profile_id, placement, out_ref):
    gpu, model = _mig_model(lib, state, handle)
    _create_gi(lib, gpu, model, profile_id, *_placement_arg(placement), out_ref)


@_nvml()
def nvmlDeviceGetGpuInstances(lib, state, handle, profile_id, arr, count_ref):
    """With MIG disabled the real H200 answers count 0 (fixture), not NOT_SUPPORTED."""
    gpu, model = _mig_model(lib, state, handle)
    prof = _known_profile(model, profile_id)
    count = _deref(count_ref)
    gis = sorted((g for g in gpu.gis if g.profile_id == prof.id), key=lambda g: g.id)
    if arr is None:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    out = _deref(arr)
    if isinstance(out, ctypes.Array) and len(out) < len(gis):
        count.value = len(gis)
        raise _Ret(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    for i, gi in enumerate(gis):
        _set_ptr(out, lib.gi_handle(gpu, gi), offset=i * ctypes.sizeof(ctypes.c_void_p))
    count.value = len(gis)


@_nvml()
def nvmlDeviceGetGpuInstanceById(lib, state, handle, gi_id, out_ref):
    """No such GPU instance, MIG off included, is NOT_FOUND (the real H200: nvml-and-files.json)."""
    gpu, _ = _mig_model(lib, state, handle)
    gi = next((g for g in gpu.gis if g.id == _int(gi_id)), None)
    if gi is None:
        raise _Ret(pynvml.NVML_ERROR_NOT_FOUND)
    _set_ptr(_deref(out_ref), lib.gi_handle(gpu, gi))


@_nvml()
def nvmlGpuInstanceGetInfo(lib, state, gi_handle, ref):
    gpu, gi = lib.gi(state, gi_handle)
    info = _deref(ref)
    _set_ptr(info, lib.gpu_handle(gpu), offset=type(info).device.offset)
    info.id = gi.id
    info.profileId = gi.profile_id
    info.placement.start = gi.start
    info.placement.size = gi.size


@_nvml()
def nvmlGpuInstanceDestroy(lib, state, gi_handle):
    gpu, gi = lib.gi(state, gi_handle)
    if gi.cis or any(on_gi == gi.id for _, on_gi in sim_vgpu.placed(state, gpu.address)):
        raise _Ret(pynvml.NVML_ERROR_IN_USE)  # compute instances, or a MIG-backed vGPU, live on it
    gpu.gis.remove(gi)


# --- compute instances --------------------------------------------------------------------------


def _gi_profile(model: ModelInfo, gi: SimGi) -> MigProfile:
    prof = profile_of(model, gi.profile_id)
    assert prof is not None
    return prof


@_nvml("nvmlGpuInstanceGetComputeInstanceProfileInfo", "nvmlGpuInstanceGetComputeInstanceProfileInfoV")
def _ci_profile_info(lib, state, gi_handle, index, eng_profile, ref):
    gpu, gi = lib.gi(state, gi_handle)
    idx, eng = _int(index), _int(eng_profile)
    if idx >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT or eng >= pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    prof = _gi_profile(model_of(gpu), gi)
    ci_prof = next((c for c in prof.ci_profiles if c.id == idx), None)  # CI ids equal their index
    if ci_prof is None:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    info = _deref(ref)
    _check_version(info, pynvml.nvmlComputeInstanceProfileInfo_v2)
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


def _ci_profile(model: ModelInfo, gi: SimGi, ci_profile_id: int) -> CiProfile:
    ci_prof = next((c for c in _gi_profile(model, gi).ci_profiles if c.id == ci_profile_id), None)
    if ci_prof is None:
        raise _Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return ci_prof


def _ci_used(model: ModelInfo, gi: SimGi) -> set[int]:
    """Compute slices of `gi` its CIs occupy (each CI at its placement)."""
    return {s for c in gi.cis for s in range(c.start, c.start + ci_slices(model, gi, c))}


def _ci_free_starts(model: ModelInfo, gi: SimGi, ci_prof: CiProfile) -> list[int]:
    used = _ci_used(model, gi)
    return [s for s in ci_prof.starts if not used & set(range(s, s + ci_prof.slices))]


def _ci_capacity(model: ModelInfo, gi: SimGi, ci_profile_id: int) -> int:
    """Free placements that do not overlap, bounded by the profile's instance count (as for GIs)."""
    ci_prof = _ci_profile(model, gi, ci_profile_id)
    same = sum(1 for c in gi.cis if c.profile_id == ci_profile_id)
    free, taken = 0, set[int]()
    for start in _ci_free_starts(model, gi, ci_prof):
        slots = set(range(start, start + ci_prof.slices))
        if not slots & taken:
            free += 1
            taken |= slots
    return max(0, min(free, ci_prof.instance_count - same))


@_nvml()
def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(lib, state, gi_handle, ci_profile_id, ref):
    gpu, gi = lib.gi(state, gi_handle)
    _deref(ref).value = _ci_capacity(model_of(gpu), gi, _int(ci_profile_id))


@_nvml()
def nvmlGpuInstanceGetComputeInstancePossiblePlacements(lib, state, gi_handle, ci_profile_id, placements, count_ref):
    """Caller-allocated two-call pattern, like the GI call: NULL array -> count only. Every
    placement of the profile, taken or not (NVML API reference: "only returns all the possible
    placements"), in compute slices."""
    gpu, gi = lib.gi(state, gi_handle)
    pid = _int(ci_profile_id)
    if pid >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    ci_prof = _ci_profile(model_of(gpu), gi, pid)
    return _fill_placements(placements, count_ref, [(start, ci_prof.slices) for start in ci_prof.starts])


def _create_ci(lib: FakeNvmlLib, state: SimState, gi_handle: Any, ci_profile_id: Any, start: int | None,
               size: int | None, out_ref: Any) -> None:
    """Both CI creates. A placement must be one the profile offers (else INVALID_ARGUMENT, as a GI
    start outside its list); a taken slot, or no free one, is INSUFFICIENT_RESOURCES."""
    import uuid as _uuid

    gpu, gi = lib.gi(state, gi_handle)
    _require_mig_on(gpu)
    pid = _int(ci_profile_id)
    if pid >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    model = model_of(gpu)
    ci_prof = _ci_profile(model, gi, pid)
    if start is not None and (start not in ci_prof.starts or size != ci_prof.slices):
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if _ci_capacity(model, gi, pid) < 1:
        raise _Ret(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    free = _ci_free_starts(model, gi, ci_prof)
    if start is None:
        start = free[0]  # lowest free slot (inferred: docs/hardware/mig-ids.md)
    elif start not in free:
        raise _Ret(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    out = _deref(out_ref)
    ids = {c.id for c in gi.cis}
    ci = SimCi(id=next(i for i in range(len(ids) + 1) if i not in ids), profile_id=pid,
               uuid=f"MIG-{_uuid.uuid4()}", start=start)
    gi.cis.append(ci)
    _set_ptr(out, lib.ci_handle(gpu, gi, ci))


@_nvml()
def nvmlGpuInstanceCreateComputeInstance(lib, state, gi_handle, ci_profile_id, out_ref):
    _create_ci(lib, state, gi_handle, ci_profile_id, None, None, out_ref)


@_nvml()
def nvmlGpuInstanceCreateComputeInstanceWithPlacement(lib, state, gi_handle, ci_profile_id, placement, out_ref):
    _create_ci(lib, state, gi_handle, ci_profile_id, *_placement_arg(placement), out_ref)


@_nvml()
def nvmlGpuInstanceGetComputeInstances(lib, state, gi_handle, ci_profile_id, arr, count_ref):
    gpu, gi = lib.gi(state, gi_handle)
    pid = _int(ci_profile_id)
    if pid >= pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT or arr is None:
        raise _Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    count = _deref(count_ref)
    cis = sorted((c for c in gi.cis if c.profile_id == pid), key=lambda c: c.id)
    out = _deref(arr)
    if isinstance(out, ctypes.Array) and len(out) < len(cis):
        count.value = len(cis)
        raise _Ret(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    for i, ci in enumerate(cis):
        _set_ptr(out, lib.ci_handle(gpu, gi, ci), offset=i * ctypes.sizeof(ctypes.c_void_p))
    count.value = len(cis)


@_nvml()
def nvmlGpuInstanceGetComputeInstanceById(lib, state, gi_handle, ci_id, out_ref):
    gpu, gi = lib.gi(state, gi_handle)
    ci = next((c for c in gi.cis if c.id == _int(ci_id)), None)
    if ci is None:
        raise _Ret(pynvml.NVML_ERROR_NOT_FOUND)
    _set_ptr(_deref(out_ref), lib.ci_handle(gpu, gi, ci))


@_nvml("nvmlComputeInstanceGetInfo_v2", "nvmlComputeInstanceGetInfo")
def _ci_info(lib, state, ci_handle, ref):
    gpu, gi, ci = lib.ci(state, ci_handle)
    model = model_of(gpu)
    info = _deref(ref)
    _set_ptr(info, lib.gpu_handle(gpu), offset=type(info).device.offset)
    _set_ptr(info, lib.gi_handle(gpu, gi), offset=type(info).gpuInstance.offset)
    info.id = ci.id
    info.profileId = ci.profile_id
    info.placement.start = ci.start
    info.placement.size = ci_slices(model, gi, ci)


@_nvml()
def nvmlComputeInstanceDestroy(lib, state, ci_handle):
    _, gi, ci = lib.ci(state, ci_handle)
    if mig_processes(state, ci):
        raise _Ret(pynvml.NVML_ERROR_IN_USE)
    gi.cis.remove(ci)


# --- install ------------------------------------------------------------------------------------

_saved: list[Any] = []


def swap_in(lib: Any) -> None:
    """Put `lib` where pynvml keeps its C library object, so all of pynvml's own marshalling runs
    against it; `uninstall` puts back what was there. Shared by the simulator and the replay."""
    _saved.append(pynvml.nvmlLib)
    pynvml.nvmlLib = lib
    pynvml._nvmlGetFunctionPointer_cache.clear()


def install(host_dir: str) -> FakeNvmlLib:
    """Make pynvml talk to the simulated host in `host_dir` (restored by `uninstall`)."""
    lib = FakeNvmlLib(host_dir)
    swap_in(lib)
    return lib


def uninstall() -> None:
    if not _saved:
        return
    pynvml.nvmlLib = _saved.pop()
    pynvml._nvmlGetFunctionPointer_cache.clear()
    if pynvml.nvmlLib is None:
        pynvml._nvmlLib_refcount = 0
