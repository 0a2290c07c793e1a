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

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from ctypes import byref, c_uint
from typing import Any, TypeVar

import pynvml

from gpud.host.nvml_users import SessionUsers
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


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _in_session(method: _Method) -> _Method:
    """A public NVML operation: a re-open of the session waits until it is done (host/nvml_users)."""

    @functools.wraps(method)
    def wrapper(self: Nvml, *args: Any, **kwargs: Any) -> Any:
        with self._users.use():
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class Nvml:
    """NVML session. `proc_root` is where process names are looked up (DIR/proc on the simulator)."""

    def __init__(self, *, read_only: bool = False, proc_root: str = "/proc"):
        self.read_only = read_only
        self.proc_root = proc_root
        self._open = False
        self._suspended = 0  # rebinds in flight that need NVML closed (several GPUs may rebind at once)
        self._session = threading.RLock()  # open/close/suspend from the loop and worker threads
        # (pci, GI profile id) -> size in memory slices, learned from the possible placements
        self._sizes: dict[tuple[str, int], int] = {}
        self._users = SessionUsers()

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
        """Close, and refuse to reopen until the matching `resume`: nvmlInit opens every GPU, so a
        read from another thread during an unbind would make gpud the holder its own unbind waits
        for. Counted: NVML stays closed until every rebind that suspended it has resumed."""
        with self._session:
            self._suspended += 1
        self.close()

    def resume(self) -> None:
        with self._session:
            self._suspended = max(0, self._suspended - 1)

    @property
    def suspended(self) -> bool:
        return self._suspended > 0

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
    @_in_session
    def driver_version(self) -> str:
        self._ensure_open()
        return self._call("nvmlSystemGetDriverVersion", None, pynvml.nvmlSystemGetDriverVersion)

    @_in_session
    def cuda_driver_version(self) -> int:
        """The CUDA version the driver supports, NVML's way: 12040 is CUDA 12.4."""
        self._ensure_open()
        return self._call("nvmlSystemGetCudaDriverVersion", None, pynvml.nvmlSystemGetCudaDriverVersion)

    @_in_session
    def nvml_version(self) -> str:
        self._ensure_open()
        return self._call("nvmlSystemGetNVMLVersion", None, pynvml.nvmlSystemGetNVMLVersion)

    @_in_session
    def gpus(self, *, on_nvidia: Iterable[str] | None = None) -> list[NvmlGpu]:
        """Every GPU NVML sees, in NVML index order (PCI-address order).

        `on_nvidia`: the PCI addresses sysfs shows bound to nvidia now. NVML enumerates at nvmlInit
        only, so when the GPUs read differ from those, the session is re-opened and read again: a
        GPU rebound from vfio-pci, hot-added or back after a driver reload is seen right away, and
        one that left is no longer a lost handle. At most one re-open per read; a GPU NVML cannot
        read even then (a broken GPU) costs one nvmlShutdown + nvmlInit per read. Remembering "already
        re-opened for this set" instead was wrong: a GPU unplugged and plugged back between the
        sysfs read and the re-open leaves the same set with the new GPU unknown to NVML for good."""
        gpus = self._gpus()
        if on_nvidia is None:
            return gpus
        bound = frozenset(on_nvidia)
        if frozenset(g.pci for g in gpus) == bound:
            return gpus
        if not self._reopen():
            return gpus
        log.info("NVML re-initialised: the GPUs on nvidia changed (now %s)", ", ".join(sorted(bound)) or "none")
        return self._gpus()

    def _reopen(self) -> bool:
        """nvmlShutdown + nvmlInit, once no other thread is inside an NVML operation; never while a
        rebind keeps NVML closed."""

        def close_and_open() -> None:
            with self._session:
                if self._suspended or not self._open:
                    return
                self.close()
                self.open()

        if self._suspended:
            return False
        return self._users.reopen(close_and_open)

    def _gpus(self) -> list[NvmlGpu]:
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

    @_in_session
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
        try:  # only node labels use it: an older driver without it must not hide the GPU
            compute = self._optional(pci, "nvmlDeviceGetCudaComputeCapability", h)
        except NvmlError:
            compute = None
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
                       compute_capability=tuple(compute) if compute is not None else None,
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
            if info.id not in out:
                out[info.id] = CiProfile(id=info.id, slices=info.sliceCount, instance_count=info.instanceCount,
                                         sms=info.multiprocessorCount,
                                         starts=self._ci_starts(pci, gi_handle, info.id))
        return out

    def _ci_starts(self, pci: str, gi_handle: Any, ci_profile_id: int) -> tuple[int, ...]:
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
            if e.value in _SKIP or e.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                return ()
            raise NvmlError(e.value, fn, pci) from e
        return tuple(sorted(arr[i].start for i in range(count.value)))

    def _instances(self, pci: str, h: Any, raw: dict[int, Any]) -> tuple[GpuInstance, ...]:
        """GIs with their CIs (uuids and holders are filled in by `_attach_ci_details`)."""
        gis: list[GpuInstance] = []
        for prof in raw.values():
            for gi in self._listed(pci, "nvmlDeviceGetGpuInstances", pynvml.c_nvmlGpuInstance_t, h, prof.id,
                                   prof.instanceCount):
                gi_info = self._call("nvmlGpuInstanceGetInfo", pci, pynvml.nvmlGpuInstanceGetInfo, gi)
                if any(g.id == gi_info.id for g in gis):
                    continue
                gis.append(GpuInstance(
                    id=gi_info.id, profile_id=gi_info.profileId,
                    placement=Placement(gi_info.placement.start, gi_info.placement.size),
                    cis=self._cis(pci, gi)))
        return tuple(sorted(gis, key=lambda g: g.id))

    def _listed(self, pci: str, name: str, ctype: Any, parent: Any, profile_id: int, capacity: int) -> list[Any]:
        """The instances NVML lists under `parent` for one profile: a GPU's GIs
        (nvmlDeviceGetGpuInstances) or a GI's CIs (nvmlGpuInstanceGetComputeInstances)."""
        count = c_uint(0)
        arr = (ctype * max(capacity, 1))()
        self._call(name, pci, getattr(pynvml, name), parent, profile_id, arr, byref(count))
        return [arr[i] for i in range(count.value)]

    def _cis(self, pci: str, gi_handle: Any) -> tuple[ComputeInstance, ...]:
        cis: list[ComputeInstance] = []
        for ci_prof in self._gi_ci_profiles(pci, gi_handle).values():
            for ci in self._listed(pci, "nvmlGpuInstanceGetComputeInstances", pynvml.c_nvmlComputeInstance_t,
                                   gi_handle, ci_prof.id, ci_prof.instance_count):
                info = self._call("nvmlComputeInstanceGetInfo", pci, pynvml.nvmlComputeInstanceGetInfo, ci)
                cis.append(ComputeInstance(id=info.id, profile_id=info.profileId, slices=ci_prof.slices, uuid="",
                                           start=info.placement.start))
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
                                           uuid=uuid, holders=holders, start=ci.start))
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
    @_in_session
    def set_mig_mode(self, pci: str, enabled: bool) -> int:
        """Returns NVML's activation status: 0 applied, IN_USE / RESET_REQUIRED when left pending."""
        refuse_if(self.read_only, "set_mig_mode", pci)
        h = self._handle(pci)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return int(self._call("nvmlDeviceSetMigMode", pci, pynvml.nvmlDeviceSetMigMode, h, mode))

    @_in_session
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

    @_in_session
    def create_compute_instance(self, pci: str, gi_id: int, ci_profile_id: int, start: int | None = None) -> int:
        """Creates a CI in GI `gi_id` and returns its id: at compute slice `start` when given (the
        placement goes `byref`, as for GIs), else where the driver chooses."""
        refuse_if(self.read_only, "create_compute_instance", pci)
        gi = self._gi(pci, gi_id)
        if start is None:
            ci = self._call("nvmlGpuInstanceCreateComputeInstance", pci,
                            pynvml.nvmlGpuInstanceCreateComputeInstance, gi, ci_profile_id)
        else:
            prof = self._gi_ci_profiles(pci, gi).get(ci_profile_id)
            if prof is None:
                raise NvmlError(pynvml.NVML_ERROR_NOT_SUPPORTED, "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                                pci, f"GI {gi_id} offers no compute instance profile id {ci_profile_id}")
            placement = pynvml.c_nvmlComputeInstancePlacement_t(start, prof.slices)
            ci = self._call("nvmlGpuInstanceCreateComputeInstanceWithPlacement", pci,
                            pynvml.nvmlGpuInstanceCreateComputeInstanceWithPlacement, gi, ci_profile_id,
                            byref(placement))
        return int(self._call("nvmlComputeInstanceGetInfo", pci, pynvml.nvmlComputeInstanceGetInfo, ci).id)

    @_in_session
    def destroy_compute_instance(self, pci: str, gi_id: int, ci_id: int) -> None:
        refuse_if(self.read_only, "destroy_compute_instance", pci)
        gi = self._gi(pci, gi_id)
        ci = self._call("nvmlGpuInstanceGetComputeInstanceById", pci,
                        pynvml.nvmlGpuInstanceGetComputeInstanceById, gi, ci_id)
        self._call("nvmlComputeInstanceDestroy", pci, pynvml.nvmlComputeInstanceDestroy, ci)

    @_in_session
    def destroy_gpu_instance(self, pci: str, gi_id: int) -> None:
        refuse_if(self.read_only, "destroy_gpu_instance", pci)
        gi = self._gi(pci, gi_id)
        self._call("nvmlGpuInstanceDestroy", pci, pynvml.nvmlGpuInstanceDestroy, gi)

    def _gi(self, pci: str, gi_id: int) -> Any:
        h = self._handle(pci)
        return self._call("nvmlDeviceGetGpuInstanceById", pci, pynvml.nvmlDeviceGetGpuInstanceById, h, gi_id)
