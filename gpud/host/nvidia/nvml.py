"""NVML adapter: with its siblings nvml_profiles (the MIG profile tables), nvml_instances (GIs, CIs
and MIG devices) and nvml_errors, the only code in gpud that imports pynvml.

Reads every GPU NVML can see into `gpud.model.NvmlGpu` records and performs the five MIG mutations
the executor needs. Traps handled here, once (docs/hardware/mig-nvml.md):
- GI profiles are queried by *index* constant but everything is keyed by the returned `.id`
  (nvml_profiles);
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
from ctypes import byref
from typing import Any, TypeVar

import msgspec
import pynvml

from gpud.host.nvidia.driver_params import coherent_memory_mode
from gpud.host.nvidia.nvml_errors import NvmlError, call
from gpud.host.nvidia.nvml_instances import MigReader
from gpud.host.nvidia.nvml_profiles import gi_profiles, possible_placements
from gpud.host.nvidia.nvml_static import GpuStatic, SessionCache
from gpud.host.nvidia.nvml_users import SessionUsers
from gpud.host.readonly import refuse_if
from gpud.model import (
    GpuInstance,
    Holder,
    MigProfile,
    NvmlGpu,
)
from gpud.pci import normalize_pci
from gpud.profiles import NOT_IN_MIG_INSTANCE

log = logging.getLogger(__name__)

_MIB = 1 << 20


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
        self._mig = MigReader(self._cache, proc_root)  # instances and MIG devices (nvml_instances)

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

    _call = staticmethod(call)  # an NVML call; NvmlError naming it on failure

    def _ensure_open(self) -> None:
        if not self._open:
            self.open()

    # reads --------------------------------------------------------------------------------------
    @_in_session
    def persistence_mode(self, pci: str) -> bool | None:
        """Whether persistence mode is on for the GPU (None: NVML cannot say)."""
        try:
            return self._call("nvmlDeviceGetPersistenceMode", pci, pynvml.nvmlDeviceGetPersistenceMode,
                              self._handle(pci)) == pynvml.NVML_FEATURE_ENABLED
        except NvmlError:
            return None

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
        procs = self._query(pci, h, "nvmlDeviceGetComputeRunningProcesses") if details else []
        profiles: tuple[MigProfile, ...] = ()
        instances: tuple[GpuInstance, ...] = ()
        if mode is not None:
            if current == 1:
                instances = (self._mig.instances_with_devices(pci, h, static, self._mig.in_mig_devices(procs)) if details
                             else self._mig.instances(pci, h, static))
            profiles = self._profiles(pci, static, instances)
        processes = tuple(Holder(pid=p.pid, name=self._mig.process_name(p.pid), device=pci)
                          for p in procs if getattr(p, "gpuInstanceId", None) in (NOT_IN_MIG_INSTANCE, None))
        return NvmlGpu(pci=pci, uuid=static.uuid, name=static.name, minor=static.minor, memory_mb=static.memory_mb,
                       compute_capability=static.compute_capability,
                       mig_capable=mode is not None, mig_mode=current, mig_pending=pending,
                       profiles=profiles, instances=instances, processes=processes,
                       coherent_memory_mode=coherent_memory_mode(self.proc_root))

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
            mig_capable=mig_capable, profiles=gi_profiles(pci, h) if mig_capable else ())
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

    def _profiles(self, pci: str, static: GpuStatic, instances: tuple[GpuInstance, ...]) -> tuple[MigProfile, ...]:
        """The GI profiles, each with the CI profiles NVML lists for it. NVML answers those only
        through a live GI of that profile; without one they are absent (the planner fills them from
        the model's table: gpud.profiles.with_model_ci_profiles), learned or not."""
        live = {gi.profile_id for gi in instances}
        return tuple(
            msgspec.structs.replace(p, ci_profiles=tuple(self._cache.ci_profiles.get((pci, p.id), {}).values()))
            if p.id in live else p
            for p in static.profiles)

    @_in_session
    def mig_device(self, pci: str, gi_id: int, ci_id: int) -> tuple[str, tuple[Holder, ...]] | None:
        """The MIG device of one CI: its UUID and the processes in it (None: no such CI), without
        reading the whole GPU (a lease's answer, a release's busy check)."""
        return self._mig.mig_device(pci, self._handle(pci), gi_id, ci_id)

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
            placements = possible_placements(pci, h, profile_id)
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
            prof = self._mig.ci_profiles(pci, gi, gi_profile).get(ci_profile_id)
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
        try:
            self._call("nvmlComputeInstanceDestroy", pci, pynvml.nvmlComputeInstanceDestroy, ci)
        finally:
            self._cache.instances_changed(pci)  # its MIG device may come back under the same ids

    @_in_session
    def destroy_gpu_instance(self, pci: str, gi_id: int) -> None:
        refuse_if(self.read_only, "destroy_gpu_instance", pci)
        gi = self._gi(pci, gi_id)
        try:
            self._call("nvmlGpuInstanceDestroy", pci, pynvml.nvmlGpuInstanceDestroy, gi)
        finally:
            self._cache.instances_changed(pci)

    def _gi(self, pci: str, gi_id: int) -> Any:
        h = self._handle(pci)
        return self._call("nvmlDeviceGetGpuInstanceById", pci, pynvml.nvmlDeviceGetGpuInstanceById, h, gi_id)
