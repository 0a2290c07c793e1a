"""NVML adapter: the only module in gpud that imports pynvml.

Reads every GPU NVML can see into `gpud.model.NvmlGpu` records and performs the five MIG mutations
the executor needs. Traps handled here, once (docs/hardware/mig-nvml.md):
- GI profiles are queried by *index* constant but everything is keyed by the returned `.id`;
- placements are caller-allocated (two calls) and the create placement goes `byref`;
- `nvmlDeviceIsMigDeviceHandle` returns a c_uint object, so it is tested with bool().
Every mutating method passes `refuse_if` before touching NVML, so read-only mode cannot change a
host even through a bug further down.
"""

from __future__ import annotations

import logging
import threading
from ctypes import byref, c_uint
from typing import Any

import pynvml

from gpud.host.procs import process_name
from gpud.host.readonly import refuse_if
from gpud.model import (
    CiProfile,
    ComputeInstance,
    GpuInstance,
    Holder,
    MigProfile,
    NvmlGpu,
    Placement,
)
from gpud.pci import normalize_pci
from gpud.profiles import NOT_IN_MIG_INSTANCE

log = logging.getLogger(__name__)

_MIB = 1 << 20
_SKIP = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT)


class NvmlError(Exception):
    """An NVML call failed: which call, on which GPU, with NVML's code and message."""

    def __init__(self, code: int, function: str, pci: str | None = None, message: str = ""):
        self.code = code
        self.function = function
        self.pci = pci
        self.message = message or _error_string(code)
        where = f" on {pci}" if pci else ""
        super().__init__(f"{function}{where}: {self.message} (NVML error {code})")


def _error_string(code: int) -> str:
    try:
        return str(pynvml.NVMLError(code))
    except Exception:  # noqa: BLE001 - the message is a nicety; the code is what matters
        return f"NVML error {code}"


class Nvml:
    """NVML session. `proc_root` is where process names are looked up (DIR/proc on the simulator)."""

    def __init__(self, *, read_only: bool = False, proc_root: str = "/proc"):
        self.read_only = read_only
        self.proc_root = proc_root
        self._open = False
        self._suspended = False
        self._session = threading.RLock()  # open/close/suspend from the loop and worker threads
        # (pci, GI profile id) -> size in memory slices, learned from the possible placements
        self._sizes: dict[tuple[str, int], int] = {}

    # session ------------------------------------------------------------------------------------
    def open(self) -> None:
        with self._session:
            if self._suspended:
                raise NvmlError(pynvml.NVML_ERROR_UNINITIALIZED, "nvmlInit", None,
                                "NVML is closed while a GPU is being rebound")
            if not self._open:
                self._call("nvmlInit", None, pynvml.nvmlInit)
                self._open = True

    def close(self) -> None:
        """nvmlShutdown: our own NVML client must not be what keeps a GPU busy during an unbind."""
        with self._session:
            self._sizes.clear()  # a GPU may be swapped (unplug/plug) before the next session
            if self._open:
                self._open = False
                self._call("nvmlShutdown", None, pynvml.nvmlShutdown)

    def suspend(self) -> None:
        """Close, and refuse to reopen until `resume`: nvmlInit opens every GPU, so a read from
        another thread during an unbind would make gpud the holder its own unbind waits for."""
        with self._session:
            self._suspended = True
        self.close()

    def resume(self) -> None:
        with self._session:
            self._suspended = False

    @property
    def suspended(self) -> bool:
        return self._suspended

    def __enter__(self) -> Nvml:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, function: str, pci: str | None, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError as e:
            raise NvmlError(e.value, function, pci) from e

    def _ensure_open(self) -> None:
        if not self._open:
            self.open()

    # reads --------------------------------------------------------------------------------------
    def driver_version(self) -> str:
        self._ensure_open()
        return self._call("nvmlSystemGetDriverVersion", None, pynvml.nvmlSystemGetDriverVersion)

    def nvml_version(self) -> str:
        self._ensure_open()
        return self._call("nvmlSystemGetNVMLVersion", None, pynvml.nvmlSystemGetNVMLVersion)

    def gpus(self) -> list[NvmlGpu]:
        """Every GPU NVML sees, in NVML index order (PCI-address order)."""
        self._ensure_open()
        n = self._call("nvmlDeviceGetCount", None, pynvml.nvmlDeviceGetCount)
        out = []
        for i in range(n):
            try:  # one lost GPU (Xid, fallen off the bus) must not hide the others
                out.append(self._read(self._call("nvmlDeviceGetHandleByIndex", None,
                                                 pynvml.nvmlDeviceGetHandleByIndex, i)))
            except NvmlError as e:
                if e.code == pynvml.NVML_ERROR_UNINITIALIZED or self._suspended:
                    raise  # the session was closed under us: nothing read is a complete view
                log.warning("NVML GPU %d unreadable: %s", i, e)
        return out

    def gpu(self, pci: str) -> NvmlGpu | None:
        handle = self._handle(pci, missing_ok=True)
        return None if handle is None else self._read(handle)

    def _handle(self, pci: str, *, missing_ok: bool = False) -> Any:
        self._ensure_open()
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(pci)
        except pynvml.NVMLError as e:
            if missing_ok and e.value == pynvml.NVML_ERROR_NOT_FOUND:
                return None
            raise NvmlError(e.value, "nvmlDeviceGetHandleByPciBusId", pci) from e

    def _read(self, h: Any) -> NvmlGpu:
        info = self._call("nvmlDeviceGetPciInfo", None, pynvml.nvmlDeviceGetPciInfo, h)
        bus_id = info.busId.decode() if isinstance(info.busId, bytes) else info.busId
        pci = normalize_pci(bus_id) or bus_id.lower()
        uuid = self._query(pci, h, "nvmlDeviceGetUUID")
        name = self._query(pci, h, "nvmlDeviceGetName")
        minor = self._optional(pci, "nvmlDeviceGetMinorNumber", h)
        memory_mb = self._query(pci, h, "nvmlDeviceGetMemoryInfo").total // _MIB
        mode = self._optional(pci, "nvmlDeviceGetMigMode", h)
        current, pending = (mode if mode is not None else (None, None))
        profiles: tuple[MigProfile, ...] = ()
        instances: tuple[GpuInstance, ...] = ()
        if mode is not None:
            raw = self._raw_profiles(pci, h)
            if current == 1:
                instances = self._attach_ci_details(pci, h, self._instances(pci, h, raw))
            profiles = self._profiles(pci, h, raw, instances)
        processes = tuple(
            Holder(pid=p.pid, name=self._process_name(p.pid), device=pci)
            for p in self._query(pci, h, "nvmlDeviceGetComputeRunningProcesses")
            if p.gpuInstanceId in (NOT_IN_MIG_INSTANCE, None)  # processes inside MIG devices are listed per device
        )
        return NvmlGpu(pci=pci, uuid=uuid, name=name, minor=minor, memory_mb=memory_mb,
                       mig_capable=mode is not None, mig_mode=current, mig_pending=pending,
                       profiles=profiles, instances=instances, processes=processes)

    def _query(self, pci: str, h: Any, name: str) -> Any:
        """pynvml.<name>(h) for GPU `pci`; NvmlError naming the call on failure."""
        return self._call(name, pci, getattr(pynvml, name), h)

    def _optional(self, pci: str, name: str, *args: Any) -> Any:
        """A query a GPU may not support: None on NOT_SUPPORTED."""
        try:
            return getattr(pynvml, name)(*args)
        except pynvml.NVMLError as e:
            if e.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                return None
            raise NvmlError(e.value, name, pci) from e

    def _raw_profiles(self, pci: str, h: Any) -> dict[int, Any]:
        """GI profile infos by profile *id*, asked by every index constant NVML knows."""
        out: dict[int, Any] = {}
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
            except pynvml.NVMLError as e:
                if e.value in _SKIP:
                    continue
                raise NvmlError(e.value, "nvmlDeviceGetGpuInstanceProfileInfo", pci) from e
            out.setdefault(info.id, info)
        return out

    def _profiles(self, pci: str, h: Any, raw: dict[int, Any],
                  instances: tuple[GpuInstance, ...]) -> tuple[MigProfile, ...]:
        out = []
        for info in raw.values():
            placements = self._placements(pci, h, info.id)
            if placements:
                self._sizes[(pci, info.id)] = placements[0].size
            name = info.name.decode() if isinstance(info.name, bytes) else info.name
            out.append(MigProfile(
                id=info.id, name=name.removeprefix("MIG "), slices=info.sliceCount,
                memory_mb=info.memorySizeMB, sms=info.multiprocessorCount,
                instance_count=info.instanceCount, placements=placements,
                ci_profiles=self._ci_profiles_for(pci, h, info.id, instances),
                copy_engines=info.copyEngineCount, decoders=info.decoderCount,
                encoders=info.encoderCount, jpegs=info.jpegCount, ofas=info.ofaCount))
        return tuple(out)

    def _placements(self, pci: str, h: Any, profile_id: int) -> tuple[Placement, ...]:
        count = c_uint(0)
        fn = "nvmlDeviceGetGpuInstancePossiblePlacements"
        self._call(fn, pci, pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, profile_id, None, byref(count))
        if count.value == 0:
            return ()
        arr = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        self._call(fn, pci, pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, profile_id, arr, byref(count))
        return tuple(sorted(Placement(arr[i].start, arr[i].size) for i in range(count.value)))

    def _ci_profiles_for(self, pci: str, h: Any, profile_id: int,
                         instances: tuple[GpuInstance, ...]) -> tuple[CiProfile, ...]:
        """What NVML says about the CI profiles of GI profile `profile_id`. NVML answers only
        through a live GI of that profile; without one they are absent (the planner fills them
        from the model's table: gpud.profiles.with_model_ci_profiles)."""
        gi = next((g for g in instances if g.profile_id == profile_id), None)
        if gi is None:
            return ()
        gi_handle = self._call("nvmlDeviceGetGpuInstanceById", pci, pynvml.nvmlDeviceGetGpuInstanceById, h, gi.id)
        return tuple(self._gi_ci_profiles(pci, gi_handle).values())

    def _gi_ci_profiles(self, pci: str, gi_handle: Any) -> dict[int, CiProfile]:
        out: dict[int, CiProfile] = {}
        for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi_handle, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            except pynvml.NVMLError as e:
                if e.value in _SKIP:
                    continue
                raise NvmlError(e.value, "nvmlGpuInstanceGetComputeInstanceProfileInfo", pci) from e
            out.setdefault(info.id, CiProfile(id=info.id, slices=info.sliceCount,
                                              instance_count=info.instanceCount, sms=info.multiprocessorCount))
        return out

    def _instances(self, pci: str, h: Any, raw: dict[int, Any]) -> tuple[GpuInstance, ...]:
        """GIs with their CIs (uuids and holders are filled in by `_attach_ci_details`)."""
        gis: list[GpuInstance] = []
        for prof in raw.values():
            count = c_uint(0)
            arr = (pynvml.c_nvmlGpuInstance_t * max(prof.instanceCount, 1))()
            self._call("nvmlDeviceGetGpuInstances", pci, pynvml.nvmlDeviceGetGpuInstances,
                       h, prof.id, arr, byref(count))
            for i in range(count.value):
                gi_info = self._call("nvmlGpuInstanceGetInfo", pci, pynvml.nvmlGpuInstanceGetInfo, arr[i])
                if any(g.id == gi_info.id for g in gis):
                    continue
                gis.append(GpuInstance(
                    id=gi_info.id, profile_id=gi_info.profileId,
                    placement=Placement(gi_info.placement.start, gi_info.placement.size),
                    cis=self._cis(pci, arr[i])))
        return tuple(sorted(gis, key=lambda g: g.id))

    def _cis(self, pci: str, gi_handle: Any) -> tuple[ComputeInstance, ...]:
        cis: list[ComputeInstance] = []
        for ci_prof in self._gi_ci_profiles(pci, gi_handle).values():
            count = c_uint(0)
            arr = (pynvml.c_nvmlComputeInstance_t * max(ci_prof.instance_count, 1))()
            self._call("nvmlGpuInstanceGetComputeInstances", pci, pynvml.nvmlGpuInstanceGetComputeInstances,
                       gi_handle, ci_prof.id, arr, byref(count))
            for i in range(count.value):
                info = self._call("nvmlComputeInstanceGetInfo", pci, pynvml.nvmlComputeInstanceGetInfo, arr[i])
                cis.append(ComputeInstance(id=info.id, profile_id=info.profileId, slices=ci_prof.slices, uuid=""))
        return tuple(sorted(cis, key=lambda c: c.id))

    def _attach_ci_details(self, pci: str, h: Any, gis: tuple[GpuInstance, ...]) -> tuple[GpuInstance, ...]:
        """MIG UUIDs and processes come from the MIG device handles, matched by (GI id, CI id)."""
        details: dict[tuple[int, int], tuple[str, tuple[Holder, ...]]] = {}
        n = self._call("nvmlDeviceGetMaxMigDeviceCount", pci, pynvml.nvmlDeviceGetMaxMigDeviceCount, h)
        for i in range(n):
            try:
                m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except pynvml.NVMLError as e:
                if e.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise NvmlError(e.value, "nvmlDeviceGetMigDeviceHandleByIndex", pci) from e
            if not bool(self._call("nvmlDeviceIsMigDeviceHandle", pci, pynvml.nvmlDeviceIsMigDeviceHandle, m)):
                continue
            gi_id = self._call("nvmlDeviceGetGpuInstanceId", pci, pynvml.nvmlDeviceGetGpuInstanceId, m)
            ci_id = self._call("nvmlDeviceGetComputeInstanceId", pci, pynvml.nvmlDeviceGetComputeInstanceId, m)
            uuid = self._call("nvmlDeviceGetUUID", pci, pynvml.nvmlDeviceGetUUID, m)
            procs = self._call("nvmlDeviceGetComputeRunningProcesses", pci,
                               pynvml.nvmlDeviceGetComputeRunningProcesses, m)
            holders = tuple(sorted(Holder(pid=p.pid, name=self._process_name(p.pid), device=uuid) for p in procs))
            details[(gi_id, ci_id)] = (uuid, holders)
        out = []
        for gi in gis:
            cis = []
            for ci in gi.cis:
                uuid, holders = details.get((gi.id, ci.id), ("", ()))
                cis.append(ComputeInstance(id=ci.id, profile_id=ci.profile_id, slices=ci.slices,
                                           uuid=uuid, holders=holders))
            out.append(GpuInstance(id=gi.id, profile_id=gi.profile_id, placement=gi.placement, cis=tuple(cis)))
        return tuple(out)

    def _process_name(self, pid: int) -> str:
        name = process_name(self.proc_root, pid)
        if name:
            return name
        try:
            return pynvml.nvmlSystemGetProcessName(pid) or "?"
        except pynvml.NVMLError:
            return "?"

    # mutations ----------------------------------------------------------------------------------
    def set_mig_mode(self, pci: str, enabled: bool) -> int:
        """Returns NVML's activation status: 0 applied, IN_USE / RESET_REQUIRED when left pending."""
        refuse_if(self.read_only, "set_mig_mode", pci)
        h = self._handle(pci)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return int(self._call("nvmlDeviceSetMigMode", pci, pynvml.nvmlDeviceSetMigMode, h, mode))

    def create_gpu_instance(self, pci: str, profile_id: int, start: int) -> int:
        """Creates a GI at an explicit placement (never by preference order) and returns its id."""
        refuse_if(self.read_only, "create_gpu_instance", pci)
        h = self._handle(pci)
        size = self._sizes.get((pci, profile_id))
        if size is None:
            placements = self._placements(pci, h, profile_id)
            if not placements:
                raise NvmlError(pynvml.NVML_ERROR_INVALID_ARGUMENT, "nvmlDeviceGetGpuInstancePossiblePlacements",
                                pci, f"profile id {profile_id} has no placements")
            size = self._sizes[(pci, profile_id)] = placements[0].size
        placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
        gi = self._call("nvmlDeviceCreateGpuInstanceWithPlacement", pci,
                        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, h, profile_id, byref(placement))
        return int(self._call("nvmlGpuInstanceGetInfo", pci, pynvml.nvmlGpuInstanceGetInfo, gi).id)

    def create_compute_instance(self, pci: str, gi_id: int, ci_profile_id: int) -> int:
        refuse_if(self.read_only, "create_compute_instance", pci)
        gi = self._gi(pci, gi_id)
        ci = self._call("nvmlGpuInstanceCreateComputeInstance", pci,
                        pynvml.nvmlGpuInstanceCreateComputeInstance, gi, ci_profile_id)
        return int(self._call("nvmlComputeInstanceGetInfo", pci, pynvml.nvmlComputeInstanceGetInfo, ci).id)

    def destroy_compute_instance(self, pci: str, gi_id: int, ci_id: int) -> None:
        refuse_if(self.read_only, "destroy_compute_instance", pci)
        gi = self._gi(pci, gi_id)
        ci = self._call("nvmlGpuInstanceGetComputeInstanceById", pci,
                        pynvml.nvmlGpuInstanceGetComputeInstanceById, gi, ci_id)
        self._call("nvmlComputeInstanceDestroy", pci, pynvml.nvmlComputeInstanceDestroy, ci)

    def destroy_gpu_instance(self, pci: str, gi_id: int) -> None:
        refuse_if(self.read_only, "destroy_gpu_instance", pci)
        gi = self._gi(pci, gi_id)
        self._call("nvmlGpuInstanceDestroy", pci, pynvml.nvmlGpuInstanceDestroy, gi)

    def _gi(self, pci: str, gi_id: int) -> Any:
        h = self._handle(pci)
        return self._call("nvmlDeviceGetGpuInstanceById", pci, pynvml.nvmlDeviceGetGpuInstanceById, h, gi_id)
