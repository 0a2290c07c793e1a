"""An NVML library that replays one read-only capture of a real GPU, and nothing more.

The simulator's fake library (gpud.sim.nvml_lib) serves values from gpud's own model tables, so a
test on it can only show that gpud agrees with those tables. This library is installed at the same
seam (`pynvml.nvmlLib`), but every value it serves was read from a real GPU by a read-only probe
(tests/fixtures/h200/nvml-sysfs-readonly.json: one H200, driver 580.159.04; README, "Real GPU, read-only").
A daemon on it (`gpud --sim DIR --replay CAPTURE --read-only`) therefore shows how gpud reads a
real H200, and its output can be compared with what gpud printed on that hardware.

It refuses what it has no capture for, as the real library refuses what it cannot do:
- a C symbol with no captured answer is absent: pynvml raises FUNCTION_NOT_FOUND (what an older
  driver does for a newer symbol); that covers every mutation, so the replay is read-only;
- a profile index the probe saw refused returns the captured NVML error code;
- a handle it did not hand out is INVALID_ARGUMENT, an unknown PCI bus id NOT_FOUND, every call
  before nvmlInit UNINITIALIZED.
`host(CAPTURE, DIR)` lays out the sysfs tree of the captured PCI function (vendor, device, class,
NUMA node, driver from the capture's sysfs read-out) with the simulator's renderer, so the daemon
sees one host, not a real NVML view next to a made-up PCI one.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from gpud.pci import normalize_pci
from gpud.sim.nvml_abi import ERROR_STRINGS, Ret, as_int, deref, write_str
from gpud.sim.nvml_lib import swap_in
from gpud.sim.nvml_lib import uninstall as uninstall  # the one restore, re-exported for callers of install

_REQUIRED = {
    "driver": str, "nvml_version": str, "cuda_driver": int, "device": dict,
    "gpu_instance_profiles": dict, "gpu_instance_possible_placements": dict,
    "gpu_instances_existing": dict, "remaining_capacity": dict, "sysfs_pci_device": dict,
}
_DEVICE_REQUIRED = {"name": str, "uuid": str, "mig_mode": list, "minor": int, "pci": dict,
                    "memory": dict, "procs": list, "max_mig": int}
_GI_INFO_FIELDS = ("id", "isP2pSupported", "sliceCount", "instanceCount", "multiprocessorCount",
                   "copyEngineCount", "decoderCount", "encoderCount", "jpegCount", "ofaCount",
                   "memorySizeMB")


class CaptureError(ValueError):
    """The capture file cannot be replayed: which file, which key, what was expected."""


def _need(where: str, data: dict, key: str, kind: type) -> Any:
    if key not in data:
        raise CaptureError(f"{where}.{key}: missing (expected {kind.__name__})")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CaptureError(f"{where}.{key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


class Capture:
    """A validated capture: one GPU as the probe read it. Keys are checked on load, so a replay
    never fails half-way on a missing value."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CaptureError(f"{path}: cannot read capture: {e}") from e
        if not isinstance(data, dict):
            raise CaptureError(f"{path}: expected a JSON object at the top")
        for key, kind in _REQUIRED.items():
            _need(str(path), data, key, kind)
        for key, kind in _DEVICE_REQUIRED.items():
            _need(f"{path}: device", data["device"], key, kind)
        if data["device"]["procs"]:
            raise CaptureError(f"{path}: device.procs: processes are not replayed (expected [])")
        existing = {k: v for k, v in data["gpu_instances_existing"].items() if v}
        if existing:
            # The probe records only counts: GI placements and CIs would have to be invented.
            raise CaptureError(f"{path}: gpu_instances_existing: {existing}: GPU instances are not "
                               "captured, only their count (expected every count 0)")
        self.data = data
        self.device = data["device"]
        address = normalize_pci(self.device["pci"].get("busId", ""))
        if address is None:
            raise CaptureError(f"{path}: device.pci.busId: expected a PCI bus id, "
                               f"got {self.device['pci'].get('busId')!r}")
        self.address: str = address
        self.gi_profiles: dict[int, dict] = {}  # profile index constant -> info or error
        for name, info in data["gpu_instance_profiles"].items():
            index = getattr(pynvml, name, None)
            if not isinstance(index, int):
                raise CaptureError(f"{path}: gpu_instance_profiles.{name}: not an NVML profile index constant")
            if "code" not in info:
                for field in (*_GI_INFO_FIELDS, "name"):
                    _need(f"{path}: gpu_instance_profiles.{name}", info, field, str if field == "name" else int)
            self.gi_profiles[index] = info
        self.placements: dict[int, list[dict]] = {}
        for key, placements in data["gpu_instance_possible_placements"].items():
            where = f"{path}: gpu_instance_possible_placements.{key}"
            if not key.isdigit() or not isinstance(placements, list):
                raise CaptureError(f"{where}: expected a profile id and a list of placements")
            for pl in placements:
                if not isinstance(pl, dict):
                    raise CaptureError(f"{where}: expected {{start, size}} objects")
                _need(where, pl, "start", int)
                _need(where, pl, "size", int)
            self.placements[int(key)] = placements
        self.remaining = {}
        for name, count in data["remaining_capacity"].items():
            info = self.gi_profiles.get(getattr(pynvml, name, -1))
            if info is None or "id" not in info:
                raise CaptureError(f"{path}: remaining_capacity.{name}: no captured profile of that index")
            self.remaining[info["id"]] = count

    def profile_ids(self) -> set[int]:
        return {info["id"] for info in self.gi_profiles.values() if "id" in info}


# --- the library object -------------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])
_IMPLS: dict[str, Callable[..., Any]] = {}
_NO_INIT = {"nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags", "nvmlErrorString"}


def _symbol(*names: str) -> Callable[[F], F]:
    def deco(fn: F) -> F:
        for n in names or (fn.__name__,):
            _IMPLS[n] = fn
        return fn

    return deco


class ReplayNvmlLib:
    """Stands in for `CDLL("libnvidia-ml.so.1")` with the captured answers of one GPU."""

    def __init__(self, capture: Capture):
        self.capture = capture
        self._inits = 0
        self._device = ctypes.c_uint64(1)  # the one device handle points here
        self._mutex = threading.Lock()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        impl = _IMPLS.get(name) if not name.startswith("_") else None
        if impl is None:
            raise AttributeError(name)  # pynvml: NVML_ERROR_FUNCTION_NOT_FOUND

        def fn(*args: Any) -> Any:
            with self._mutex:
                if name not in _NO_INIT and self._inits <= 0:
                    return pynvml.NVML_ERROR_UNINITIALIZED
                try:
                    ret = impl(self, *args)
                except Ret as r:
                    return r.code
                return pynvml.NVML_SUCCESS if ret is None else ret

        fn.__name__ = name
        return fn

    @property
    def handle(self) -> int:
        return ctypes.addressof(self._device)

    def check(self, handle: Any) -> dict:
        """The captured device a handle names; only the handle this library gave out is one."""
        addr = handle if isinstance(handle, int) else ctypes.cast(handle, ctypes.c_void_p).value
        if addr != self.handle:
            raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.capture.device


@_symbol("nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags")
def _init(lib: ReplayNvmlLib, flags: Any = 0) -> None:
    lib._inits += 1


@_symbol()
def nvmlShutdown(lib: ReplayNvmlLib) -> None:
    lib._inits -= 1


@_symbol()
def nvmlErrorString(lib: ReplayNvmlLib, result: Any) -> bytes:
    return ERROR_STRINGS.get(as_int(result), "Unknown Error").encode()


@_symbol()
def nvmlSystemGetDriverVersion(lib: ReplayNvmlLib, buf: Any, length: Any) -> None:
    write_str(buf, length, lib.capture.data["driver"])


@_symbol()
def nvmlSystemGetNVMLVersion(lib: ReplayNvmlLib, buf: Any, length: Any) -> None:
    write_str(buf, length, lib.capture.data["nvml_version"])


@_symbol("nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2")
def _cuda(lib: ReplayNvmlLib, ref: Any) -> None:
    deref(ref).value = lib.capture.data["cuda_driver"]


@_symbol("nvmlDeviceGetCount", "nvmlDeviceGetCount_v2")
def _count(lib: ReplayNvmlLib, ref: Any) -> None:
    deref(ref).value = 1  # a capture is of one GPU


@_symbol("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2")
def _by_index(lib: ReplayNvmlLib, index: Any, ref: Any) -> None:
    if as_int(index) != 0:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    ctypes.c_void_p.from_address(ctypes.addressof(deref(ref))).value = lib.handle


@_symbol("nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetHandleByPciBusId_v2")
def _by_pci(lib: ReplayNvmlLib, bus_id: Any, ref: Any) -> None:
    raw = bus_id.value if isinstance(bus_id, ctypes.c_char_p) else bus_id
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    if normalize_pci(text) != lib.capture.address:
        raise Ret(pynvml.NVML_ERROR_NOT_FOUND)
    ctypes.c_void_p.from_address(ctypes.addressof(deref(ref))).value = lib.handle


@_symbol()
def nvmlDeviceGetName(lib: ReplayNvmlLib, handle: Any, buf: Any, length: Any) -> None:
    write_str(buf, length, lib.check(handle)["name"])


@_symbol()
def nvmlDeviceGetUUID(lib: ReplayNvmlLib, handle: Any, buf: Any, length: Any) -> None:
    write_str(buf, length, lib.check(handle)["uuid"])


@_symbol()
def nvmlDeviceGetMinorNumber(lib: ReplayNvmlLib, handle: Any, ref: Any) -> None:
    deref(ref).value = lib.check(handle)["minor"]


@_symbol("nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo")
def _pci_info(lib: ReplayNvmlLib, handle: Any, ref: Any) -> None:
    info, pci = deref(ref), lib.check(handle)["pci"]
    for field, _ in type(info)._fields_:
        if field not in pci:
            raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a struct layout the probe did not read
        value = pci[field]
        setattr(info, field, value.encode() if isinstance(value, str) else value)


@_symbol()
def nvmlDeviceGetCudaComputeCapability(lib: ReplayNvmlLib, handle: Any, major_ref: Any, minor_ref: Any) -> None:
    major, minor = lib.check(handle)["cc"]
    deref(major_ref).value, deref(minor_ref).value = major, minor


@_symbol()
def nvmlDeviceGetMemoryInfo(lib: ReplayNvmlLib, handle: Any, ref: Any) -> None:
    """The v1 struct only: the probe read total/free/used, not v2's `reserved`."""
    info, memory = deref(ref), lib.check(handle)["memory"]
    info.total, info.free, info.used = memory["total"], memory["free"], memory["used"]


@_symbol("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
         "nvmlDeviceGetComputeRunningProcesses")
def _processes(lib: ReplayNvmlLib, handle: Any, count_ref: Any, infos: Any) -> None:
    lib.check(handle)  # the capture holds no processes (checked on load)
    deref(count_ref).value = 0


@_symbol()
def nvmlDeviceGetMigMode(lib: ReplayNvmlLib, handle: Any, current_ref: Any, pending_ref: Any) -> None:
    current, pending = lib.check(handle)["mig_mode"]
    deref(current_ref).value = current
    deref(pending_ref).value = pending


@_symbol()
def nvmlDeviceGetMaxMigDeviceCount(lib: ReplayNvmlLib, handle: Any, ref: Any) -> None:
    deref(ref).value = lib.check(handle)["max_mig"]


@_symbol("nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstanceProfileInfoV")
def _gi_profile_info(lib: ReplayNvmlLib, handle: Any, index: Any, ref: Any) -> Any:
    lib.check(handle)
    captured = lib.capture.gi_profiles.get(as_int(index))
    if captured is None:
        raise Ret(pynvml.NVML_ERROR_NOT_SUPPORTED if as_int(index) < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
                   else pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if "code" in captured:
        return captured["code"]  # the real GPU's refusal of this index
    info = deref(ref)
    for field in _GI_INFO_FIELDS:
        setattr(info, field, captured[field])
    if any(f == "name" for f, _ in type(info)._fields_):
        info.name = captured["name"].encode()
    return None


@_symbol("nvmlDeviceGetGpuInstancePossiblePlacements", "nvmlDeviceGetGpuInstancePossiblePlacements_v2")
def _possible_placements(lib: ReplayNvmlLib, handle: Any, profile_id: Any, placements: Any, count_ref: Any) -> Any:
    lib.check(handle)
    captured = lib.capture.placements.get(as_int(profile_id))
    if captured is None:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    count = deref(count_ref)
    if placements is None:
        count.value = len(captured)
        return None
    if count.value < len(captured):
        count.value = len(captured)
        return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    arr = deref(placements)
    for i, pl in enumerate(captured):
        arr[i].start, arr[i].size = pl["start"], pl["size"]
    count.value = len(captured)
    return None


@_symbol()
def nvmlDeviceGetGpuInstances(lib: ReplayNvmlLib, handle: Any, profile_id: Any, arr: Any, count_ref: Any) -> None:
    lib.check(handle)
    if as_int(profile_id) not in lib.capture.profile_ids():
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    deref(count_ref).value = 0  # every captured count is 0 (checked on load)


@_symbol()
def nvmlDeviceGetGpuInstanceRemainingCapacity(lib: ReplayNvmlLib, handle: Any, profile_id: Any, ref: Any) -> None:
    lib.check(handle)
    count = lib.capture.remaining.get(as_int(profile_id))
    if count is None:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    deref(ref).value = count


# --- install and host tree ----------------------------------------------------------------------

def install(capture_path: str | os.PathLike) -> ReplayNvmlLib:
    """Make pynvml talk to the capture (restored by `uninstall`)."""
    lib = ReplayNvmlLib(Capture(capture_path))
    swap_in(lib)
    return lib


def _hex(capture: Capture, attr: str) -> int:
    value = capture.data["sysfs_pci_device"].get(attr)
    try:
        return int(value, 16)
    except (TypeError, ValueError):
        raise CaptureError(f"{capture.path}: sysfs_pci_device.{attr}: expected a hex string, got {value!r}") from None


def host(capture_path: str | os.PathLike, host_dir: str | os.PathLike) -> Path:
    """Lay out DIR as a simulated host holding only the captured PCI function, as its sysfs read
    showed it, for `gpud --sim DIR --replay CAPTURE`. The simulator's NVML state (state.json) gets
    the captured UUID and minor so its /proc and /dev entries name the same GPU."""
    from gpud.sim.state import SimFunction, SimGpu, SimState, state_path
    from gpud.sim.sysfs_tree import lay_out

    capture = Capture(capture_path)
    sysfs = capture.data["sysfs_pci_device"]
    d = Path(host_dir)
    if state_path(d).exists():
        raise CaptureError(f"{d}: already a simulated host")
    driver_link = sysfs.get("driver", "")
    driver = driver_link.rsplit("/", 1)[-1] if driver_link.startswith("->") else None
    try:
        numa = int(sysfs.get("numa_node", "-1"))
    except ValueError:
        raise CaptureError(f"{capture.path}: sysfs_pci_device.numa_node: expected an integer") from None
    groups = capture.data.get("iommu_groups") or []
    function = SimFunction(
        address=capture.address, vendor=_hex(capture, "vendor"), device=_hex(capture, "device"),
        subsystem_vendor=_hex(capture, "subsystem_vendor"), subsystem_device=_hex(capture, "subsystem_device"),
        class_code=_hex(capture, "class"), revision=_hex(capture, "revision"), native_driver=driver,
        driver=driver, iommu_group=None if not groups else int(groups[0]), numa_node=numa)
    gpu = SimGpu(address=capture.address, model="", uuid=capture.device["uuid"], minor=capture.device["minor"],
                 mig_mode=capture.device["mig_mode"][0], mig_pending=capture.device["mig_mode"][1])
    state = SimState(functions={capture.address: function}, gpus={capture.address: gpu},
                     loaded_modules=[m for m in ("nvidia",) if driver == "nvidia"],
                     driver_version=capture.data["driver"], cuda_version=capture.data["cuda_driver"])
    lay_out(d, state)
    return d


def main(argv: list[str] | None = None) -> int:
    """`python -m gpud.sim.replay_nvml CAPTURE DIR`: lay out DIR for a replayed daemon."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m gpud.sim.replay_nvml CAPTURE DIR", file=sys.stderr)
        return 2
    try:
        host(args[0], args[1])
    except CaptureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args[1]}: replay host; run gpud --sim {args[1]} --replay {args[0]} --read-only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
