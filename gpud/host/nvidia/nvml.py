"""NVML adapter: the only module in gpud that imports pynvml.

Reads every GPU NVML can see into `gpud.model.NvmlGpu` records and performs the five MIG mutations
the executor needs. Traps handled here, once (docs/hardware/mig-nvml.md):
- GI profiles are queried by *index* constant but everything is keyed by the returned `.id`;
- placements are caller-allocated (two calls) and the create placement goes `byref`;
- a MIG device handle comes only from `nvmlDeviceGetMigDeviceHandleByIndex` (so it needs no
  `nvmlDeviceIsMigDeviceHandle`, whose c_uint answer is true even when `== 1` is not).
Every mutating method passes `refuse_if` before touching NVML, so read-only mode cannot change a
host even through a bug further down.

What cannot change while the session and the GPU stay the same (identity, profile tables,
placements, the session's device list) is read once per session (gpud.host.nvidia.nvml_static); an
observation asks only for what changes. `close` drops it all: every re-init, reset, rebind and
hot-plug goes through a closed session.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Iterable
from ctypes import byref, c_uint
from typing import Any, TypeVar

import msgspec
import pynvml

from gpud.host.kernel.procs import process_name
from gpud.host.nvidia.nvml_static import GpuStatic, SessionCache
from gpud.host.nvidia.nvml_users import SessionUsers
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
    """A public NVML operation: a re-open of the session waits until it is done (host/nvidia/nvml_users)."""

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
        self._cache = SessionCache()  # what the session need not read twice (dropped by close)
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
            self._cache.clear()  # a GPU may be reset, rebound or swapped before the next session
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
        out = []
        for i, (handle, pci) in enumerate(self._enumerate()):
            try:  # one lost GPU (Xid, fallen off the bus) must not hide the others
                out.append(self._read(handle, pci))
            except NvmlError as e:
                if e.code == pynvml.NVML_ERROR_UNINITIALIZED or self._suspended:
                    raise  # the session was closed under us: nothing read is a complete view
                log.warning("NVML GPU %d unreadable (%s): %s", i, pci, e)
        return out

    def _enumerate(self) -> list[tuple[Any, str]]:
        """The session's GPUs in NVML index order, (handle, PCI address). NVML enumerates at nvmlInit
        (docs/hardware/nvml-enumeration.md), so the list is read once per session; one with a GPU
        that could not be read is not kept, and the next read tries again."""
        self._ensure_open()
        cache = self._cache
        known = cache.enumerated
        if known is not None:
            return known
        generation = cache.generation
        n = self._call("nvmlDeviceGetCount", None, pynvml.nvmlDeviceGetCount)
        found: list[tuple[Any, str]] = []
        for i in range(n):
            try:
                handle = self._call("nvmlDeviceGetHandleByIndex", None, pynvml.nvmlDeviceGetHandleByIndex, i)
                found.append((handle, self._pci_of(handle)))
            except NvmlError as e:
                if e.code == pynvml.NVML_ERROR_UNINITIALIZED or self._suspended:
                    raise
                log.warning("NVML GPU %d unreadable: %s", i, e)
        if len(found) == n:
            cache.store_if(generation, lambda: setattr(cache, "enumerated", found))
        return found

    @_in_session
    def gpu(self, pci: str, *, details: bool = True) -> NvmlGpu | None:
        """One GPU now. `details=False` reads its layout only (MIG mode, GIs, CIs with their
        placements): no MIG UUIDs, no holders, no processes, for checking a step's effect."""
        handle = self._handle(pci, missing_ok=True)
        if handle is None:
            return None
        return self._read(handle, pci if self._cache.handle_of(pci) is not None else None, details=details)

    def _handle(self, pci: str, *, missing_ok: bool = False) -> Any:
        self._ensure_open()
        known = self._cache.handle_of(pci)
        if known is not None:
            return known
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(pci)
        except pynvml.NVMLError as e:
            if missing_ok and e.value == pynvml.NVML_ERROR_NOT_FOUND:
                return None
            raise NvmlError(e.value, "nvmlDeviceGetHandleByPciBusId", pci) from e

    def _pci_of(self, h: Any) -> str:
        info = self._call("nvmlDeviceGetPciInfo", None, pynvml.nvmlDeviceGetPciInfo, h)
        bus_id = info.busId.decode() if isinstance(info.busId, bytes) else info.busId
        return normalize_pci(bus_id) or bus_id.lower()

    def _read(self, h: Any, pci: str | None = None, *, details: bool = True) -> NvmlGpu:
        """One GPU now: its static part from the session's cache, the rest asked (`gpu`)."""
        if pci is None:
            pci = self._pci_of(h)
        static = self._cache.gpus.get(pci)
        mode = self._optional(pci, "nvmlDeviceGetMigMode", h) if static is None or static.mig_capable else None
        if static is None:
            static = self._read_static(h, pci, mig_capable=mode is not None)
        elif pci in self._cache.memory_stale:
            static = self._memory_again(h, static)
        current, pending = (mode if mode is not None else (None, None))
        profiles: tuple[MigProfile, ...] = ()
        instances: tuple[GpuInstance, ...] = ()
        if mode is not None:
            if current == 1:
                instances = self._instances(pci, h, static)
                if details:
                    instances = self._attach_ci_details(pci, h, instances)
            profiles = self._profiles(pci, static, instances)
        processes = () if not details else tuple(
            Holder(pid=p.pid, name=self._process_name(p.pid), device=pci)
            for p in self._query(pci, h, "nvmlDeviceGetComputeRunningProcesses")
            if p.gpuInstanceId in (NOT_IN_MIG_INSTANCE, None)  # processes inside MIG devices are listed per device
        )
        return NvmlGpu(pci=pci, uuid=static.uuid, name=static.name, minor=static.minor, memory_mb=static.memory_mb,
                       compute_capability=static.compute_capability,
                       mig_capable=mode is not None, mig_mode=current, mig_pending=pending,
                       profiles=profiles, instances=instances, processes=processes)

    def _read_static(self, h: Any, pci: str, *, mig_capable: bool) -> GpuStatic:
        """What the GPU answers the same for the whole session (gpud.host.nvidia.nvml_static), read and kept."""
        generation = self._cache.generation
        try:  # only node labels use it: an older driver without it must not hide the GPU
            compute = self._optional(pci, "nvmlDeviceGetCudaComputeCapability", h)
        except NvmlError:
            compute = None
        static = GpuStatic(
            pci=pci, uuid=self._query(pci, h, "nvmlDeviceGetUUID"), name=self._query(pci, h, "nvmlDeviceGetName"),
            minor=self._optional(pci, "nvmlDeviceGetMinorNumber", h),
            memory_mb=self._query(pci, h, "nvmlDeviceGetMemoryInfo").total // _MIB,
            compute_capability=(int(compute[0]), int(compute[1])) if compute is not None else None,
            mig_capable=mig_capable, profiles=self._gi_profiles(pci, h) if mig_capable else ())
        self._cache.store_if(generation, lambda: self._cache.gpus.__setitem__(pci, static))
        return static

    def _memory_again(self, h: Any, static: GpuStatic) -> GpuStatic:
        generation = self._cache.generation
        fresh = dataclasses.replace(static, memory_mb=self._query(static.pci, h, "nvmlDeviceGetMemoryInfo").total // _MIB)

        def put() -> None:
            self._cache.gpus[static.pci] = fresh
            self._cache.memory_stale.discard(static.pci)

        self._cache.store_if(generation, put)
        return fresh

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

    def _gi_profiles(self, pci: str, h: Any) -> tuple[MigProfile, ...]:
        """The GI profiles with their possible placements, asked by every index constant NVML knows
        and keyed by the profile *id* they answer with; CI profiles are added per read (`_profiles`)."""
        raw: dict[int, Any] = {}
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
            except pynvml.NVMLError as e:
                if e.value in _SKIP:
                    continue
                raise NvmlError(e.value, "nvmlDeviceGetGpuInstanceProfileInfo", pci) from e
            raw.setdefault(info.id, info)
        out = []
        for info in raw.values():
            name = info.name.decode() if isinstance(info.name, bytes) else info.name
            out.append(MigProfile(
                id=info.id, name=name.removeprefix("MIG "), slices=info.sliceCount,
                memory_mb=info.memorySizeMB, sms=info.multiprocessorCount,
                instance_count=info.instanceCount, placements=self._placements(pci, h, info.id),
                copy_engines=info.copyEngineCount, decoders=info.decoderCount,
                encoders=info.encoderCount, jpegs=info.jpegCount, ofas=info.ofaCount))
        return tuple(out)

    def _profiles(self, pci: str, static: GpuStatic, instances: tuple[GpuInstance, ...]) -> tuple[MigProfile, ...]:
        """The GI profiles, each with the CI profiles NVML lists for it. NVML answers those only
        through a live GI of that profile; without one they are absent (the planner fills them from
        the model's table: gpud.profiles.with_model_ci_profiles), learned or not."""
        live = {gi.profile_id for gi in instances}
        return tuple(
            msgspec.structs.replace(p, ci_profiles=tuple(self._cache.ci_profiles.get((pci, p.id), {}).values()))
            if p.id in live else p
            for p in static.profiles)

    def _placements(self, pci: str, h: Any, profile_id: int) -> tuple[Placement, ...]:
        count = c_uint(0)
        fn = "nvmlDeviceGetGpuInstancePossiblePlacements"
        self._call(fn, pci, pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, profile_id, None, byref(count))
        if count.value == 0:
            return ()
        arr = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        self._call(fn, pci, pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, profile_id, arr, byref(count))
        return tuple(sorted(Placement(arr[i].start, arr[i].size) for i in range(count.value)))

    def _ci_profiles(self, pci: str, gi_handle: Any, gi_profile_id: int) -> dict[int, CiProfile]:
        """The CI profiles of GI profile `gi_profile_id`, asked through one of its GIs once a session
        (the same for every GI of the profile: docs/hardware/nvml-static-reads.md)."""
        key = (pci, gi_profile_id)
        known = self._cache.ci_profiles.get(key)
        if known is not None:
            return known
        generation = self._cache.generation
        found = self._gi_ci_profiles(pci, gi_handle)
        self._cache.store_if(generation, lambda: self._cache.ci_profiles.__setitem__(key, found))
        return found

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

    def _instances(self, pci: str, h: Any, static: GpuStatic) -> tuple[GpuInstance, ...]:
        """GIs with their CIs (uuids and holders are filled in by `_attach_ci_details`)."""
        gis: list[GpuInstance] = []
        used: set[int] = set()  # memory slices of the GIs found so far
        for prof in static.profiles:
            if prof.placements and all(used & set(range(p.start, p.start + p.size)) for p in prof.placements):
                continue  # GIs never share a memory slice (nvml.h): no GI of this profile can exist
            for gi_handle in self._listed(pci, "nvmlDeviceGetGpuInstances", pynvml.nvmlDeviceGetGpuInstances,
                                          pynvml.c_nvmlGpuInstance_t, prof.instance_count, h, prof.id):
                gi_info = self._call("nvmlGpuInstanceGetInfo", pci, pynvml.nvmlGpuInstanceGetInfo, gi_handle)
                if any(g.id == gi_info.id for g in gis):
                    continue
                gis.append(GpuInstance(
                    id=gi_info.id, profile_id=gi_info.profileId,
                    placement=Placement(gi_info.placement.start, gi_info.placement.size),
                    cis=self._cis(pci, gi_handle, gi_info.profileId)))
                used.update(range(gi_info.placement.start, gi_info.placement.start + gi_info.placement.size))
        return tuple(sorted(gis, key=lambda g: g.id))

    def _listed(self, pci: str, function: str, fn: Any, ctype: Any, capacity: int, *args: Any) -> list[Any]:
        """NVML's caller-allocated list: `fn(*args, array, &count)` with room for `capacity` handles
        (at least one), the handles it filled."""
        count = c_uint(0)
        arr = (ctype * max(capacity, 1))()
        self._call(function, pci, fn, *args, arr, byref(count))
        return [arr[i] for i in range(count.value)]

    def _cis(self, pci: str, gi_handle: Any, gi_profile_id: int) -> tuple[ComputeInstance, ...]:
        cis: list[ComputeInstance] = []
        for ci_prof in self._ci_profiles(pci, gi_handle, gi_profile_id).values():
            for ci_handle in self._listed(pci, "nvmlGpuInstanceGetComputeInstances",
                                          pynvml.nvmlGpuInstanceGetComputeInstances, pynvml.c_nvmlComputeInstance_t,
                                          ci_prof.instance_count, gi_handle, ci_prof.id):
                info = self._call("nvmlComputeInstanceGetInfo", pci, pynvml.nvmlComputeInstanceGetInfo, ci_handle)
                cis.append(ComputeInstance(id=info.id, profile_id=info.profileId, slices=ci_prof.slices, uuid="",
                                           start=info.placement.start))
        return tuple(sorted(cis, key=lambda c: c.id))

    def _attach_ci_details(self, pci: str, h: Any, gis: tuple[GpuInstance, ...]) -> tuple[GpuInstance, ...]:
        """MIG UUIDs and processes come from the MIG device handles, matched by (GI id, CI id)."""
        details: dict[tuple[int, int], tuple[str, tuple[Holder, ...]]] = {}
        wanted = {(gi.id, ci.id) for gi in gis for ci in gi.cis}
        for i in range(self._max_mig_devices(pci, h)):
            if wanted <= details.keys():
                break  # every CI listed has its MIG device: what further indices hold is not in `gis`
            try:
                m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except pynvml.NVMLError as e:
                if e.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    continue
                raise NvmlError(e.value, "nvmlDeviceGetMigDeviceHandleByIndex", pci) from e
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

    @_in_session
    def mig_device(self, pci: str, gi_id: int, ci_id: int) -> tuple[str, tuple[Holder, ...]] | None:
        """The MIG device of one CI: its UUID and the processes in it (None: no such CI), without
        reading the whole GPU (a lease's answer, a release's busy check)."""
        h = self._handle(pci)
        probe = GpuInstance(id=gi_id, profile_id=-1, placement=Placement(0, 0),
                            cis=(ComputeInstance(id=ci_id, profile_id=-1, slices=0, uuid=""),))
        ci = self._attach_ci_details(pci, h, (probe,))[0].cis[0]
        return (ci.uuid, ci.holders) if ci.uuid else None

    def _max_mig_devices(self, pci: str, h: Any) -> int:
        """nvmlDeviceGetMaxMigDeviceCount with MIG on: the GPU's most MIG devices, kept for the session
        (with MIG off it answers 0, so it is asked only with MIG on, and a mode change drops it)."""
        known = self._cache.max_mig_devices.get(pci)
        if known is not None:
            return known
        generation = self._cache.generation
        n = int(self._call("nvmlDeviceGetMaxMigDeviceCount", pci, pynvml.nvmlDeviceGetMaxMigDeviceCount, h))
        self._cache.store_if(generation, lambda: self._cache.max_mig_devices.__setitem__(pci, n))
        return n

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
        self._cache.mode_changed(pci)  # what may move with the mode is asked again
        return int(self._call("nvmlDeviceSetMigMode", pci, pynvml.nvmlDeviceSetMigMode, h, mode))

    @_in_session
    def create_gpu_instance(self, pci: str, profile_id: int, start: int) -> int:
        """Creates a GI at an explicit placement (never by preference order) and returns its id."""
        refuse_if(self.read_only, "create_gpu_instance", pci)
        h = self._handle(pci)
        static = self._cache.gpus.get(pci)
        placements = next((p.placements for p in static.profiles if p.id == profile_id), ()) if static else ()
        if not placements:
            placements = self._placements(pci, h, profile_id)
        if not placements:
            raise NvmlError(pynvml.NVML_ERROR_INVALID_ARGUMENT, "nvmlDeviceGetGpuInstancePossiblePlacements",
                            pci, f"profile id {profile_id} has no placements")
        size = placements[0].size
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
            gi_profile = self._call("nvmlGpuInstanceGetInfo", pci, pynvml.nvmlGpuInstanceGetInfo, gi).profileId
            prof = self._ci_profiles(pci, gi, gi_profile).get(ci_profile_id)
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
