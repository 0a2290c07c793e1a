"""A fake NVML C library: the object installed as `pynvml.nvmlLib` on a simulated host.

Only the library object is replaced, so nvidia-ml-py's own wrappers, ctypes structures, byref
marshalling and NVMLError classes run unchanged: the adapter under test is exercised exactly as on
a real host, traps included (profile index vs id, placement passed by value, c_uint booleans).

Every fake function takes the host lock, counts itself (gpud.sim.call_counts), consumes a
matching `state.faults` entry (`gpud-sim fault`), and returns an int NVML return code. The state
lives on disk (gpud.sim.state), so several processes share one simulated GPU host. Handles are
process-local, as with the real library: real ctypes objects whose addresses map back to an
identity (PCI address, GI, CI / MIG device).
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import pynvml

# The MIG half registers its C symbols on import; the library object serves both halves.
import gpud.sim.nvml_mig  # noqa: F401
from gpud.profiles import NOT_IN_MIG_INSTANCE
from gpud.sim.catalog import RESERVED_BYTES, is_nvswitch
from gpud.sim.gpu_rules import (
    MIB,
    Refused,
    gpu_processes,
    mig_devices,
    mig_name,
    mig_processes,
    model_of,
    profile_of,
    reports_persistent,
    visible_gpus,
)
from gpud.sim.nvml_abi import (
    ERROR_STRINGS,
    IMPLS,
    SUCCESS,
    UNLOCKED,
    Ret,
    as_int,
    c_addr,
    deref,
    fault_matches,
    function_names,
    nvml,
    set_ptr,
    write_str,
)
from gpud.sim.state import SimCi, SimGi, SimGpu, SimSession, SimState, StateCache
from gpud.sim.sysfs_tree import render

__all__ = ["FakeNvmlLib", "fault_matches", "function_names", "install", "swap_in", "uninstall"]

# C symbols that work before nvmlInit.
_NO_INIT = {"nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags", "nvmlErrorString"}

# --- the library object -------------------------------------------------------------------------

# Calls after which the simulated /dev (MIG capability nodes) must be rendered again.
_CHANGES_DEVICES = frozenset({
    "nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstance", "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlGpuInstanceCreateComputeInstance", "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
    "nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy",
})


# Calls that only read the host (getters, by NVML's naming): their state is not compared after the
# call unless checked (gpud.sim.state.StateCache.locked).
_READ_NAME = re.compile(r"nvml(Device|GpuInstance|ComputeInstance|System|Vgpu\w*|Unit)Get|nvmlDeviceIs")


class FakeNvmlLib:
    """Stands in for `CDLL("libnvidia-ml.so.1")`: attribute lookup yields C-like functions."""

    def __init__(self, host_dir: str, *, pid: int | None = None, comm: str | None = None):
        self.host_dir = str(host_dir)
        # the process whose NVML session this is: this one, or the daemon a child serves
        # (gpud.sim.nvml_process), whose session DIR/proc shows under the daemon's pid and name
        self.pid = os.getpid() if pid is None else pid
        self.comm = comm
        self._state = StateCache(self.host_dir)
        self._inits = 0
        self._handles: dict[tuple, Any] = {}  # identity -> ctypes buffer the handle points at
        self._keys: dict[int, tuple] = {}  # address -> identity
        self._fns: dict[str, Callable[..., Any]] = {}
        self._mutex = threading.Lock()
        self._event_sets: list[EventSet] = []
        # PCI address -> which nvidia probe of it the open session enumerated at nvmlInit (index order)
        self.enumerated: dict[str, int] = {}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or name not in IMPLS:
            raise AttributeError(name)
        fn = self._fns.get(name)
        if fn is None:
            impl = IMPLS[name]

            def fn(*args: Any, _name: str = name, _impl: Callable[..., Any] = impl) -> Any:
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
        addr = c_addr(handle)
        key = self._keys.get(addr) if addr else None
        if key is None:
            raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return key

    # dispatch --------------------------------------------------------------------------------
    def _call(self, name: str, impl: Callable[..., Any], args: tuple) -> Any:
        crash: BaseException | None = None
        result: Any = None
        with self._state.locked(name, reads=_READ_NAME.match(name) is not None) as state:
            if name == "nvmlErrorString":
                return impl(self, state, *args)
            for fault in list(state.faults):
                if fault_matches(fault.function, name):
                    self._state.dirty = True
                    fault.seen += 1
                    if fault.seen >= fault.nth:
                        state.faults.remove(fault)
                        return fault.error
            if name not in _NO_INIT and self._inits <= 0:
                return pynvml.NVML_ERROR_UNINITIALIZED
            if name not in UNLOCKED:
                try:
                    ret = impl(self, state, *args)
                    result = SUCCESS if ret is None else ret
                    if result == SUCCESS and name in _CHANGES_DEVICES:
                        # MIG devices come and go as /dev/nvidia-caps nodes: keep the tree in step.
                        render(self.host_dir, state)
                except Ret as r:
                    result = r.code
                except Refused as r:  # a GPU rule's refusal, by NVML's name for it
                    result = getattr(pynvml, f"NVML_ERROR_{r.error}")
                except (TypeError, ValueError) as e:  # what would be a crash or garbage in C
                    crash = e
        if crash is not None:
            raise crash
        if name in UNLOCKED:
            try:
                ret = impl(self, None, *args)
                result = SUCCESS if ret is None else ret
            except Ret as r:
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
                raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
            gpu = self._visible(state, key[1])
            gi, ci = self._find_ci(gpu, key[2], key[3])
            return gpu, (gi, ci)
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _visible(self, state: SimState, address: str) -> SimGpu:
        """A GPU this session enumerated that is still on nvidia; one that left is lost to it."""
        gpu = next((g for g in visible_gpus(state) if g.address == address), None)
        if gpu is None or self.enumerated.get(address) != state.functions[address].nvidia_probes:
            raise Ret(pynvml.NVML_ERROR_GPU_IS_LOST)
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
        raise Ret(pynvml.NVML_ERROR_NOT_FOUND)

    def gi(self, state: SimState, handle: Any) -> tuple[SimGpu, SimGi]:
        key = self.key(handle)
        if key[0] != "gi":
            raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._visible(state, key[1])
        if gpu.mig_mode != 1:
            raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
        for gi in gpu.gis:
            if (gi.id, gi.profile_id, gi.start) == key[2:]:
                return gpu, gi
        raise Ret(pynvml.NVML_ERROR_NOT_FOUND)

    def ci(self, state: SimState, handle: Any) -> tuple[SimGpu, SimGi, SimCi]:
        key = self.key(handle)
        if key[0] != "ci":
            raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
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
            raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
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


@nvml("nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags")
def _init(lib: FakeNvmlLib, state: SimState, flags: Any = 0) -> int:
    if "nvidia" not in state.loaded_modules:
        return pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    lib.enumerate_devices(state)
    lib._inits += 1
    if lib._inits == 1:
        open_session(lib, state)
    return SUCCESS


@nvml()
def nvmlShutdown(lib: FakeNvmlLib, state: SimState) -> int:
    lib._inits -= 1
    lib.forget_devices()
    if lib._inits == 0:
        close_session(lib, state)
    return SUCCESS


# Session tracking: what this library's open session holds, kept in the state file so
# the simulated kernel and nvidia-smi see it from other processes.
def _session_owner(lib: FakeNvmlLib) -> str:
    return f"{lib.pid}:{id(lib):x}"


def open_session(lib: FakeNvmlLib, state: SimState) -> None:
    """The first nvmlInit of this library opens the device node of every GPU on nvidia."""
    gpus = sorted(a for a, f in state.functions.items() if f.present and f.driver == "nvidia" and a in state.gpus)
    owner = _session_owner(lib)
    state.sessions = [s for s in state.sessions if s.owner != owner]
    state.sessions.append(SimSession(owner=owner, pid=lib.pid, name=lib.comm or own_comm(), gpus=gpus))
    _render(lib, state)


def close_session(lib: FakeNvmlLib, state: SimState) -> None:
    owner = _session_owner(lib)
    state.sessions = [s for s in state.sessions if s.owner != owner]
    _render(lib, state)


def own_comm() -> str:
    """This process's name as the kernel keeps it (/proc/self/comm)."""
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return "python3"


def _render(lib: FakeNvmlLib, state: SimState) -> None:
    render(lib.host_dir, state)  # the session's open nodes show in DIR/proc


@nvml()
def nvmlErrorString(lib: FakeNvmlLib, state: SimState, result: Any) -> bytes:
    return ERROR_STRINGS.get(as_int(result), "Unknown Error").encode()


@nvml()
def nvmlSystemGetDriverVersion(lib: FakeNvmlLib, state: SimState, buf: Any, length: Any) -> None:
    write_str(buf, length, state.driver_version)


@nvml()
def nvmlSystemGetNVMLVersion(lib: FakeNvmlLib, state: SimState, buf: Any, length: Any) -> None:
    write_str(buf, length, f"{state.cuda_version // 1000}.{state.driver_version}")


@nvml("nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2")
def _cuda_version(lib: FakeNvmlLib, state: SimState, ref: Any) -> None:
    deref(ref).value = state.cuda_version


@nvml()
def nvmlSystemGetProcessName(lib: FakeNvmlLib, state: SimState, pid: Any, buf: Any, length: Any) -> None:
    """The name of any process, as the real library answers for pid 1 (its command line's first
    word: "/process_api", nvml-real.json): a simulated holder's name, else the machine's own
    process (the simulated host shares its process table: `gpud-sim exec` links /proc), else
    NOT_FOUND."""
    n = as_int(pid)
    proc = next((p for p in state.processes if p.pid == n), None)
    if proc is not None:
        write_str(buf, length, proc.name)
        return
    try:
        with open(f"/proc/{n}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        argv0 = ""
    if not argv0:
        raise Ret(pynvml.NVML_ERROR_NOT_FOUND)
    write_str(buf, length, argv0)


@nvml()
def nvmlGetExcludedDeviceCount(lib: FakeNvmlLib, state: SimState, ref: Any) -> None:
    """No GPU is excluded on a simulated host (the real H200's host answers 0)."""
    deref(ref).value = 0


# --- device enumeration and identity ------------------------------------------------------------


@nvml("nvmlDeviceGetCount", "nvmlDeviceGetCount_v2")
def _count(lib: FakeNvmlLib, state: SimState, ref: Any) -> None:
    deref(ref).value = len(lib.enumerated)


@nvml("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2")
def _by_index(lib: FakeNvmlLib, state: SimState, index: Any, ref: Any) -> None:
    i = as_int(index)
    if i >= len(lib.enumerated):
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    set_ptr(deref(ref), lib.gpu_handle(lib._visible(state, list(lib.enumerated)[i])))


def _norm_bus_id(text: str) -> str:
    """Any of "00000000:3B:00.0", "0000:3b:00.0", "3b:00.0" -> "0000:3b:00.0"."""
    parts = text.strip().lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    try:
        domain = int(parts[0], 16)
        bus = int(parts[1], 16)
        dev, fn = parts[2].split(".")
        device, function = int(dev, 16), int(fn, 16)
    except ValueError:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
    # A GPU is function 0: the real H200 answers INVALID_ARGUMENT for any other function, and
    # NOT_FOUND for a well-formed address no GPU has (tests/fixtures/h200-goprobe/handle-lookups.txt).
    if function != 0:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function}"


@nvml("nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetHandleByPciBusId_v2")
def _by_pci(lib: FakeNvmlLib, state: SimState, bus_id: Any, ref: Any) -> None:
    text = bus_id.value if isinstance(bus_id, ctypes.c_char_p) else bus_id
    if not text:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    address = _norm_bus_id(text.decode() if isinstance(text, bytes) else text)
    if address not in lib.enumerated:
        raise Ret(pynvml.NVML_ERROR_NOT_FOUND)
    set_ptr(deref(ref), lib.gpu_handle(lib._visible(state, address)))


@nvml()
def nvmlDeviceGetHandleByUUID(lib: FakeNvmlLib, state: SimState, uuid: Any, ref: Any) -> None:
    text = uuid.value if isinstance(uuid, ctypes.c_char_p) else uuid
    if text is None:  # a NULL string; an empty one is only a UUID no GPU has (the real H200: NOT_FOUND)
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    text = text.decode() if isinstance(text, bytes) else text
    for gpu in visible_gpus(state):
        if lib.enumerated.get(gpu.address) != state.functions[gpu.address].nvidia_probes:
            continue
        if gpu.uuid == text:
            set_ptr(deref(ref), lib.gpu_handle(gpu))
            return
        for gi, ci in mig_devices(gpu):
            if ci.uuid == text:
                set_ptr(deref(ref), lib.mig_handle(gpu, gi, ci))
                return
    raise Ret(pynvml.NVML_ERROR_NOT_FOUND)


@nvml()
def nvmlDeviceGetIndex(lib: FakeNvmlLib, state: SimState, handle: Any, ref: Any) -> None:
    gpu, _ = lib.gpu(state, handle)
    deref(ref).value = list(lib.enumerated).index(gpu.address)


@nvml()
def nvmlDeviceGetName(lib: FakeNvmlLib, state: SimState, handle: Any, buf: Any, length: Any) -> None:
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    model = model_of(gpu, state.driver_version)
    name = model.name if mig is None else f"{model.name} MIG {mig_name(model, *mig)}"
    write_str(buf, length, name)


@nvml()
def nvmlDeviceGetCudaComputeCapability(lib: FakeNvmlLib, state: SimState, handle: Any, major_ref: Any, minor_ref: Any) -> None:
    gpu, _ = lib.gpu(state, handle)
    major, minor = model_of(gpu, state.driver_version).compute_capability
    deref(major_ref).value = major
    deref(minor_ref).value = minor


@nvml()
def nvmlDeviceGetUUID(lib: FakeNvmlLib, state: SimState, handle: Any, buf: Any, length: Any) -> None:
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    write_str(buf, length, gpu.uuid if mig is None else mig[1].uuid)


@nvml()
def nvmlDeviceGetSerial(lib: FakeNvmlLib, state: SimState, handle: Any, buf: Any, length: Any) -> None:
    gpu, _ = lib.gpu(state, handle)
    if not gpu.serial:
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    write_str(buf, length, gpu.serial)


@nvml()
def nvmlDeviceGetMinorNumber(lib: FakeNvmlLib, state: SimState, handle: Any, ref: Any) -> None:
    gpu, _ = lib.gpu(state, handle)
    deref(ref).value = gpu.minor


@nvml("nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo")
def _pci_info(lib: FakeNvmlLib, state: SimState, handle: Any, ref: Any) -> None:
    gpu, _ = lib.gpu(state, handle, allow_mig=True)  # a MIG handle reports its parent's bus
    f = state.functions[gpu.address]
    info = deref(ref)
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


@nvml("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2")
def _memory(lib: FakeNvmlLib, state: SimState, handle: Any, ref: Any) -> None:
    """Total, used, free and (v2) reserved, as the real H200 splits them (nvml-real.json): the
    driver's reservation (catalog.RESERVED_BYTES) is `used` in v1 and `reserved` in v2, free is what
    is left in both. A v2 struct of another version is FUNCTION_NOT_FOUND (captured: version 0)."""
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    info = deref(ref)
    versioned = any(f[0] == "version" for f in type(info)._fields_)
    if versioned and info.version != pynvml.nvmlMemory_v2:
        raise Ret(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    model = model_of(gpu, state.driver_version)
    if mig is None:
        total = model.memory_mb * MIB
        reserved = RESERVED_BYTES.get(model.key, 0)
        used = sum(p.used_mb for p in gpu_processes(state, gpu)) * MIB
    else:  # no capture of a MIG device's reservation: none (unknown)
        prof = profile_of(model, mig[0].profile_id)
        total = (prof.memory_mb if prof else 0) * MIB
        reserved = 0
        used = sum(p.used_mb for p in mig_processes(state, mig[1])) * MIB
    used = min(used, total - reserved)
    info.total = total
    info.free = total - reserved - used
    if versioned:
        info.reserved = reserved
        info.used = used
    else:
        info.used = used + reserved


# --- modes and capabilities, as the real H200 answers them (nvml-real.json) --------------------------


@nvml()
def nvmlDeviceGetPersistenceMode(lib: FakeNvmlLib, state: SimState, handle: Any, ref: Any) -> None:
    """Enabled for a GPU in persistence mode, by `nvidia-smi -pm 1` or nvidia-persistenced in sight."""
    gpu, _ = lib.gpu(state, handle)
    deref(ref).value = 1 if reports_persistent(state, gpu.address) else 0


@nvml()
def nvmlDeviceGetVirtualizationMode(lib: FakeNvmlLib, state: SimState, handle: Any, ref: Any) -> None:
    """The simulated host is bare metal: NONE, or HOST_VGPU on a GPU set up for vGPU. (The captured
    H200 answers PASSTHROUGH: it sits in a VM, docs/hardware/nvml-h200-diff.md.)"""
    gpu, _ = lib.gpu(state, handle)
    deref(ref).value = (pynvml.NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU if gpu.address in state.vgpu
                        else pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE)


def architecture(compute_capability: tuple[int, int]) -> int:
    """NVML's architecture constant from the compute capability (CUDA's table: 8.0/8.6/8.7
    Ampere, 8.9 Ada, 9.0 Hopper, 10.x and 12.x Blackwell)."""
    major, minor = compute_capability
    if major == 8:
        return pynvml.NVML_DEVICE_ARCH_ADA if minor == 9 else pynvml.NVML_DEVICE_ARCH_AMPERE
    return {9: pynvml.NVML_DEVICE_ARCH_HOPPER, 10: pynvml.NVML_DEVICE_ARCH_BLACKWELL,
            12: pynvml.NVML_DEVICE_ARCH_BLACKWELL}.get(major, pynvml.NVML_DEVICE_ARCH_UNKNOWN)


@nvml()
def nvmlDeviceGetArchitecture(lib: FakeNvmlLib, state: SimState, handle: Any, ref: Any) -> None:
    gpu, _ = lib.gpu(state, handle)
    deref(ref).value = architecture(model_of(gpu, state.driver_version).compute_capability)


@nvml()
def nvmlDeviceGetComputeMode(lib: FakeNvmlLib, state: SimState, handle: Any, ref: Any) -> None:
    """DEFAULT: the simulator has no `nvidia-smi -c`."""
    lib.gpu(state, handle)
    deref(ref).value = pynvml.NVML_COMPUTEMODE_DEFAULT


@nvml()
def nvmlDeviceGetEccMode(lib: FakeNvmlLib, state: SimState, handle: Any, current_ref: Any, pending_ref: Any) -> None:
    """ECC on, nothing pending (the H200's answer; every simulated model is a data-center GPU with
    ECC on by default, an assumption for the others: unknown)."""
    lib.gpu(state, handle)
    deref(current_ref).value = 1
    deref(pending_ref).value = 1


@nvml()
def nvmlDeviceGetDefaultEccMode(lib: FakeNvmlLib, state: SimState, handle: Any, ref: Any) -> None:
    lib.gpu(state, handle)
    deref(ref).value = 1


class _FabricInfoV3(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_uint8 * 16), ("status", ctypes.c_uint),
                ("cliqueId", ctypes.c_uint32), ("state", ctypes.c_uint8), ("healthMask", ctypes.c_uint32),
                ("healthSummary", ctypes.c_uint8)]


@nvml("nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetGpuFabricInfo")
def _fabric_info(lib: FakeNvmlLib, state: SimState, handle: Any, ref: Any) -> None:
    """A GPU outside an NVLink fabric: state NOT_SUPPORTED, status SUCCESS, everything else 0 (the
    real H200, structs v2 and v3 alike; the version is left as given). On a simulated NVSwitch
    host a Hopper or later GPU is COMPLETED while Fabric Manager runs, NOT_STARTED while it is
    stopped (inferred from the states' meaning in NVML's reference; no capture)."""
    gpu, _ = lib.gpu(state, handle)
    info = deref(ref)
    if any(f[0] == "version" for f in type(info)._fields_) and info.version == pynvml.nvmlGpuFabricInfo_v3:
        view = _FabricInfoV3.from_address(ctypes.addressof(info))
        view.healthSummary = 0
    fabric = pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
    switched = any(is_nvswitch(f) for f in state.functions.values() if f.present)
    if model_of(gpu, state.driver_version).compute_capability[0] >= 9 and switched:
        fabric = (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED if state.fabric_manager == "running"
                  else pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED)
    ctypes.memset(ctypes.addressof(info.clusterUuid), 0, 16)
    info.status = SUCCESS
    info.cliqueId = 0
    info.state = fabric
    if any(f[0] == "healthMask" for f in type(info)._fields_):
        info.healthMask = 0


# --- processes ----------------------------------------------------------------------------------


@nvml("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2",
      "nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses_v3",
      "nvmlDeviceGetMPSComputeRunningProcesses_v2", "nvmlDeviceGetMPSComputeRunningProcesses")
def _no_processes(lib: FakeNvmlLib, state: SimState, handle: Any, count_ref: Any, infos: Any) -> None:
    """Graphics and MPS clients: the simulator runs none (its holders are compute processes), so an
    empty list, as the idle H200 answers."""
    lib.gpu(state, handle, allow_mig=True)
    deref(count_ref).value = 0


@nvml("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
       "nvmlDeviceGetComputeRunningProcesses")
def _processes(lib: FakeNvmlLib, state: SimState, handle: Any, count_ref: Any, infos: Any) -> int:
    """A MIG device handle lists the processes in that MIG device. The GPU's own handle lists those on
    the GPU and, with MIG on, those in every MIG device with their GI and CI ids: "In MIG mode, if
    device handle is provided, the API returns aggregate information, only if the caller has
    appropriate privileges" (NVML API reference, nvmlDeviceGetComputeRunningProcesses_v3), and
    nvmlProcessInfo_t's gpuInstanceId/computeInstanceId are valid "if MIG is enabled". What an
    unprivileged caller gets is not documented: the simulator answers every caller in full."""
    gpu, mig = lib.gpu(state, handle, allow_mig=True)
    if mig is None:
        rows = [(p, NOT_IN_MIG_INSTANCE, NOT_IN_MIG_INSTANCE) for p in gpu_processes(state, gpu)]
        rows += [(p, gi.id, ci.id) for gi, ci in mig_devices(gpu) for p in mig_processes(state, ci)]
    else:
        gi, ci = mig
        rows = [(p, gi.id, ci.id) for p in mig_processes(state, ci)]
    count = deref(count_ref)
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


@nvml()
def nvmlEventSetCreate(lib: FakeNvmlLib, state: SimState, ref: Any) -> None:
    set_ptr(deref(ref), lib.new_event_set())


@nvml()
def nvmlDeviceGetSupportedEventTypes(lib: FakeNvmlLib, state: SimState, handle: Any, ref: Any) -> None:
    lib.gpu(state, handle)
    deref(ref).value = SUPPORTED_EVENT_TYPES


@nvml()
def nvmlDeviceRegisterEvents(lib: FakeNvmlLib, state: SimState, handle: Any, event_types: Any, set_handle: Any) -> None:
    """Types the GPU does not support are NOT_SUPPORTED, as NVML's reference says of this call."""
    gpu, _ = lib.gpu(state, handle)
    types = as_int(event_types)
    if types & ~SUPPORTED_EVENT_TYPES:
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)
    es = lib.event_set(set_handle)
    es.registered[gpu.address] = es.registered.get(gpu.address, 0) | types


@nvml("nvmlEventSetWait_v2", "nvmlEventSetWait", unlocked=True)
def _event_wait(lib: FakeNvmlLib, state: SimState, set_handle: Any, data_ref: Any, timeout_ms: Any) -> None:
    """Blocks for the timeout (no event ever comes), then NVML_ERROR_TIMEOUT."""
    es = lib.event_set(set_handle)
    deref(data_ref)
    with es.cond:
        es.cond.wait_for(lambda: es.freed, as_int(timeout_ms) / 1000)
        if es.freed:
            raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    raise Ret(pynvml.NVML_ERROR_TIMEOUT)


@nvml()
def nvmlEventSetFree(lib: FakeNvmlLib, state: SimState, set_handle: Any) -> None:
    lib.free_event_set(set_handle)


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
    close = getattr(pynvml.nvmlLib, "close", None)
    if close is not None:
        close()  # a child serving it (gpud.sim.nvml_process)
    pynvml.nvmlLib = _saved.pop()
    pynvml._nvmlGetFunctionPointer_cache.clear()
    if pynvml.nvmlLib is None:
        pynvml._nvmlLib_refcount = 0
