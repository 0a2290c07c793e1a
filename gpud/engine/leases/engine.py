"""The lease engine: MIG instances made when a job asks and removed when it ends, on the GPUs the
layout marks `mig-devices: dynamic`. The socket (gpud.api.handlers) is one caller; the Kubernetes
DRA driver calls the same methods (lease with owner=claim, exactly a placement it chose, release,
list).

What it keeps consistent:
- **No placement booked twice.** A lease is chosen (gpud.plan.lease_placement, pure) and reserved in
  the book on the event loop without an await between the two, so concurrent requests each see
  every earlier reservation; NVML work then runs in a worker thread under a per-GPU lock.
- **Never waits behind a static apply.** Leases take neither the host-wide apply lock nor the pass:
  only the per-GPU lock and the NVML session gate's "open" side, which MIG work on any other GPU
  shares (only a rebind of a GPU leaving nvidia closes NVML, for its bounded unbind).
- **Never takes what is not its own.** Only GIs of its own records are ever destroyed; foreign
  instances are occupied slices to the placement rule.
- **Nothing is killed.** A release of a busy instance waits for its processes (naming them) or, under
  `policy.on-busy: fail`, is refused.
- **MIG mode follows leases on Hopper and later**: on at the first lease, off after the last release
  when nothing else is on the GPU (`policy.lease-mig-mode: keep-on` keeps it on); Ampere needs a
  reset, so there the static pass keeps it as `mig-enabled` says (gpud.plan.lease_placement.dynamic_mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from gpud.engine.events import EventBus
from gpud.engine.gpu_tasks import NvmlSessionGate
from gpud.engine.leases import executor, startup
from gpud.engine.leases.records import LeaseBook, LeaseRecord, new_id
from gpud.engine.observe.holder_watch import HolderWatch, process_key
from gpud.engine.ports import Hardware
from gpud.host.files.state_files import Problems
from gpud.host.nvidia.nvml import NvmlError
from gpud.layout.desired import DesiredGpu
from gpud.layout.schema import Policy
from gpud.model import Gpu, Holder, NvmlGpu, Placement
from gpud.plan.lease_placement import (
    Choice,
    NoRoom,
    Room,
    UnknownProfile,
    asked,
    capacity,
    choose,
    exact,
    resolve_name,
)
from gpud.plan.mig import GpuPlan
from gpud.profiles import by_device, model_name, with_model_ci_profiles

log = logging.getLogger(__name__)

INSUFFICIENT_RESOURCES = 7  # nvml.h: the placement was taken meanwhile (an instance made outside gpud)
RECHECK_S = 5.0  # a busy release re-reads its holders at least this often (holders NVML lists but /proc hides)


class LeaseRefused(Exception):
    """A lease or release refused; `code` is the wire error code (gpudctl's exit code follows it)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class LeaseEngine:
    """`dynamic()`: the dynamic GPUs as the last observation shows them, with their layout entries;
    `policy()`: the layout in force's policy; `reread()`: re-read the host (the observation status,
    labels and metrics are made of); `observed_at()`: when the observation in force began (monotonic)."""

    def __init__(self, hw: Hardware, bus: EventBus, *, state_dir: str | None, problems: Problems,
                 gate: NvmlSessionGate, dynamic: Callable[[], list[tuple[Gpu, DesiredGpu]]],
                 policy: Callable[[], Policy | None], reread: Callable[[], Coroutine[Any, Any, object]],
                 observed_at: Callable[[], float], read_only: bool = False) -> None:
        self.hw = hw
        self.bus = bus
        self.book = LeaseBook(state_dir if not read_only else None, problems)
        self.gate = gate
        self._dynamic = dynamic
        self._policy = policy
        self._reread_host = reread
        self._observed_at = observed_at
        self._rereading: asyncio.Task[None] | None = None
        self._reread_wanted = False  # a change came after the read under way began
        self.read_only = read_only
        self._locks: dict[str, asyncio.Lock] = {}
        self._destroyed: dict[tuple[str, int], float] = {}  # (pci, GI id) -> when (monotonic) we destroyed it
        self._releasing: set[str] = set()
        self.holder_watch = HolderWatch(self._pid_exited)
        self._wake = asyncio.Event()
        self._mode: dict[str, tuple[int, float]] = {}  # MIG mode this engine last set per GPU, and when
        self._last_seen: dict[str, NvmlGpu] = {}  # each dynamic GPU's last NVML view (see _rooms)
        self.demand: dict[str, float] = {}  # GI profiles asked for lately (gpud.plan.lease_placement.asked)
        self.on_stage: Callable[[LeaseRecord, str], None] = lambda rec, stage: None  # tests: kill -9 at a stage

    # ---- what callers read ---------------------------------------------------------------------
    def leases(self) -> list[LeaseRecord]:
        """Every lease, oldest first (those still being made included)."""
        return sorted(self.book.records.values(), key=lambda r: (r.created, r.id))

    def on(self, pci: str) -> list[LeaseRecord]:
        return [r for r in self.leases() if r.gpu == pci]

    def free(self) -> dict[str, dict[str, int]]:
        """Per dynamic GPU (PCI address), how many more leases of each GI profile fit now (metrics)."""
        rooms, _ = self._rooms(None)
        return {r.pci: capacity(r) for r in rooms}

    def taken_by(self, plan: GpuPlan) -> str | None:
        """Why a static MIG plan may not run: it destroys leased instances (a GPU changed from
        dynamic to static with leases on it), the leases named; None when it keeps every one."""
        doomed = {d.placement for d in plan.destroyed}
        hit = [r for r in self.on(plan.pci) if r.state != "vanished"
               and ((r.placement is not None and r.placement in doomed) or (r.kind == "gpu" and plan.steps))]
        if not hit:
            return None
        names = ", ".join(f"{r.id} ({r.profile}{' at ' + _at(r) if r.placement else ''}, owner "
                          f"{r.owner or 'uid ' + str(r.uid)})" for r in hit)
        return (f"leases on this GPU: {names}; the layout would take them (mig-devices: dynamic keeps them, "
                "or a static layout that keeps every leased instance); release them first")

    # ---- start ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Records against NVML (gpud.engine.leases.startup); holders' pids watched again."""
        self.book.load()
        if self.read_only or not self.book.records:
            return
        async with self.gate.hold("open"):
            gpus = await asyncio.to_thread(lambda: {g.pci: g for g in self.hw.nvml.gpus()})
            said: list[tuple[str, str, str]] = []
            await asyncio.to_thread(startup.reconcile, self.hw.nvml, self.book, gpus,
                                    lambda pci, gi, ci: self._devices(pci, gi, ci, gpus.get(pci)),
                                    lambda *report: said.append(report))
        for kind, message, pci in said:
            log.info("%s", message)
            self.bus.publish(kind, message, gpu=pci)
        if said:
            self._refresh()
        for rec in self.leases():
            if rec.pid is not None and rec.state == "held":
                self._watch(rec)

    # ---- lease -----------------------------------------------------------------------------------
    async def lease(self, profile: str, *, gpu: str | None = None, owner: str = "", uid: int = 0,
                    pid: int | None = None, start: int | None = None) -> LeaseRecord:
        """One MIG device of `profile` on a dynamic GPU (`gpu`: that one only; `start`: exactly
        that placement, as a DRA scheduler chose it). Raises LeaseRefused."""
        self._writable()
        pid_start = self._holder(pid)
        if profile == "gpu":
            return await self._lease_gpu(gpu, owner=owner, uid=uid, pid=pid, pid_start=pid_start)
        for attempt in range(3):
            rooms, notes = self._rooms(gpu)
            if attempt == 0 and rooms and (found := resolve_name(profile, rooms[0].profiles)) is not None:
                self.demand = asked(self.demand, found[0].name)
            if start is not None:
                if len(rooms) != 1:
                    raise LeaseRefused("bad-args", "an exact placement needs one dynamic GPU (--gpu)")
                got = exact(profile, rooms[0], start)
            else:
                policy = self._policy()
                got = choose(profile, rooms, spread=policy is not None and policy.lease_placement == "spread",
                             demand=self.demand)
            if isinstance(got, UnknownProfile):
                raise LeaseRefused("no-room", got.message + (f" ({'; '.join(notes)})" if notes else ""))
            if isinstance(got, NoRoom):
                raise LeaseRefused("no-room", got.message + (f"; {'; '.join(notes)}" if notes else ""))
            rec = self._reserve(got, owner=owner, uid=uid, pid=pid, pid_start=pid_start)
            try:
                return await self._make(rec)
            except executor.LeaseFailed as e:
                if e.nvml_error is not None and e.nvml_error.code == INSUFFICIENT_RESOURCES and attempt < 2:
                    await self._reread_host()  # an instance made outside gpud took it: look again
                    continue
                raise LeaseRefused("failed", str(e)) from e
        raise AssertionError("unreachable")

    def _reserve(self, got: Choice, *, owner: str, uid: int, pid: int | None, pid_start: int | None) -> LeaseRecord:
        rec = LeaseRecord(id=new_id(), kind="mig", gpu=got.pci, profile=got.name, owner=owner, uid=uid, pid=pid,
                          pid_start=pid_start, created=time.time(), gi_profile_id=got.profile.id,
                          ci_profile_id=got.ci.id, placement=got.placement)
        self.book.reserve(rec)
        return rec

    async def _make(self, rec: LeaseRecord) -> LeaseRecord:
        try:
            async with self._lock(rec.gpu), self.gate.hold("open"):
                gpu = self._gpu(rec.gpu)
                mode_on = gpu is not None and gpu.nvml is not None and self._mig_mode(gpu.pci, gpu.nvml.mig_mode) != 1
                done = await asyncio.to_thread(self._make_sync, rec, mode_on)
                self._mode[rec.gpu] = (1, time.monotonic())
        except BaseException:
            if rec.id in self.book.records and self.book.records[rec.id].state == "intent":
                await asyncio.to_thread(self._forget, rec.id)
            raise
        self.bus.publish("lease", f"lease {done.id}: {done.profile} at {_at(done)} ({done.uuid}) for "
                                  f"{done.owner or 'uid ' + str(done.uid)}", gpu=done.gpu,
                         lease=msgspec.to_builtins(done))
        self._watch(done)
        self._refresh()
        return done

    def _make_sync(self, rec: LeaseRecord, mode_on: bool) -> LeaseRecord:
        self.on_stage(rec, "before-intent")
        try:
            self.book.put(rec)  # the intent, before any NVML change
        except OSError as e:
            self.book.forget(rec.id)
            raise LeaseRefused("failed", f"the lease record could not be written ({e}); nothing leased") from e
        self.on_stage(rec, "intent")
        return executor.make(self.hw.nvml, self.book, rec, mode_on=mode_on,
                             on_stage=lambda stage: self.on_stage(rec, stage),
                             devices=lambda gi, ci: self._devices(rec.gpu, gi, ci, None))

    def _forget(self, lease_id: str) -> None:
        rec = self.book.records.get(lease_id)
        if rec is not None and rec.state == "intent":
            try:
                self.book.drop(lease_id)
            except OSError:
                self.book.forget(lease_id)

    async def _lease_gpu(self, selector: str | None, *, owner: str, uid: int, pid: int | None,
                         pid_start: int | None) -> LeaseRecord:
        """The whole GPU: refused while a MIG lease or any instance is on it, and the other way round."""
        if not selector:
            raise LeaseRefused("bad-args", "a whole-GPU lease names its GPU (--gpu)")
        candidates = [g for g, _ in self._dynamic() if _selects(g, selector)]
        if not candidates:
            raise LeaseRefused("not-found", f"no dynamic GPU (mig-devices: dynamic) matches {selector!r}")
        gpu = candidates[0]
        if self.on(gpu.pci):
            raise LeaseRefused("conflict", f"{_where(gpu)} has leases: " + ", ".join(
                f"{r.id} ({r.profile})" for r in self.on(gpu.pci)))
        nv = gpu.nvml
        if nv is None:
            raise LeaseRefused("failed", f"{_where(gpu)} is not seen by NVML")
        if nv.mig_mode == 1 and nv.instances:
            raise LeaseRefused("conflict", f"{_where(gpu)} holds {len(nv.instances)} MIG instance(s) gpud did not "
                                           "make; a whole-GPU lease needs none")
        if nv.mig_mode == 1 and not self._mode_follows(gpu):
            raise LeaseRefused("conflict", f"{_where(gpu)} stays in MIG mode (Ampere needs a reset to leave it, "
                                           "or policy.lease-mig-mode: keep-on); a whole-GPU lease needs it off")
        rec = LeaseRecord(id=new_id(), kind="gpu", gpu=gpu.pci, profile="gpu", owner=owner, uid=uid, pid=pid,
                          pid_start=pid_start, created=time.time(), state="held", uuid=nv.uuid,
                          devices=(f"/dev/nvidia{nv.minor}",) if nv.minor is not None else ())
        self.book.reserve(rec)
        try:
            async with self._lock(gpu.pci), self.gate.hold("open"):
                await asyncio.to_thread(self._gpu_sync, rec, nv.mig_mode == 1)
        except BaseException:
            self.book.forget(rec.id)
            raise
        self.bus.publish("lease", f"lease {rec.id}: the whole GPU for {owner or 'uid ' + str(uid)}", gpu=gpu.pci,
                         lease=msgspec.to_builtins(rec))
        self._watch(rec)
        self._refresh()
        return rec

    def _gpu_sync(self, rec: LeaseRecord, mode_off: bool) -> None:
        if mode_off and self.hw.nvml.set_mig_mode(rec.gpu, False) != 0:
            raise LeaseRefused("busy", f"MIG mode on {rec.gpu} could not be turned off now (processes hold it)")
        try:
            self.book.put(rec)
        except OSError as e:
            raise LeaseRefused("failed", f"the lease record could not be written ({e}); nothing leased") from e

    # ---- release ---------------------------------------------------------------------------------
    async def release(self, lease_id: str, *, uid: int = 0, why: str = "released", wait: bool = True) -> LeaseRecord:
        """Destroy the lease's CI and GI (never anything else); busy: wait for its processes (naming
        them) or, under on-busy: fail (or wait=False), refuse. Raises LeaseRefused."""
        self._writable()
        rec = self.book.records.get(lease_id)
        if rec is None:
            raise LeaseRefused("not-found", f"no lease {lease_id!r}")
        if uid != 0 and rec.uid != uid:
            raise LeaseRefused("forbidden", f"lease {lease_id} belongs to uid {rec.uid}; only it and root may release it")
        if rec.state in ("intent", "gi-made"):
            raise LeaseRefused("conflict", f"lease {lease_id} is still being made")
        if lease_id in self._releasing:
            raise LeaseRefused("conflict", f"lease {lease_id} is already being released")
        self._releasing.add(lease_id)
        try:
            while True:
                async with self._lock(rec.gpu), self.gate.hold("open"):
                    holders = await asyncio.to_thread(self._busy, rec)
                    if not holders:
                        mode_off = await asyncio.to_thread(self._unmake, rec)
                        if mode_off:
                            self._mode[rec.gpu] = (0, time.monotonic())
                        break
                names = ", ".join(f"pid {h.pid} {h.name}" for h in holders)
                policy = self._policy()
                if not wait or (policy is not None and policy.on_busy == "fail"):
                    raise LeaseRefused("busy", f"lease {lease_id} ({rec.uuid}) is in use by {names}; nothing was "
                                               f"killed{' (on-busy: fail)' if wait else ''}")
                self.bus.publish("lease-waiting", f"release of {lease_id} waits for {names}", gpu=rec.gpu)
                self.holder_watch.watch(holders)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), RECHECK_S)
        finally:
            self._releasing.discard(lease_id)
        if rec.gi is not None:
            self._destroyed[(rec.gpu, rec.gi)] = time.monotonic()
        extra = "; MIG mode turned off (no lease left)" if mode_off else ""
        self.bus.publish("release", f"lease {lease_id} ({rec.profile} at {_at(rec)}) {why}{extra}", gpu=rec.gpu,
                         lease=msgspec.to_builtins(rec))
        self._refresh()
        return rec

    def _busy(self, rec: LeaseRecord) -> tuple[Holder, ...]:
        if rec.kind == "gpu" or rec.state == "vanished":
            return ()
        try:
            return executor.busy(self.hw.nvml, rec)
        except NvmlError as e:
            raise LeaseRefused("failed", f"reading who uses lease {rec.id}: {e}") from e

    def _unmake(self, rec: LeaseRecord) -> bool:
        if rec.state == "vanished":
            self.book.drop(rec.id)
            return False
        gpu = self._gpu(rec.gpu)

        def mode_off() -> bool:
            if rec.kind != "mig" or gpu is None or not self._mode_follows(gpu) or self.book.on(rec.gpu):
                return False
            nv = self.hw.nvml.gpu(rec.gpu)
            return nv is not None and nv.mig_mode == 1 and not nv.instances and not nv.processes

        try:
            return executor.unmake(self.hw.nvml, self.book, rec, mode_off=mode_off,
                                   on_stage=lambda stage: self.on_stage(rec, stage))
        except executor.LeaseFailed as e:
            raise LeaseRefused("failed", str(e)) from e

    # ---- holders ---------------------------------------------------------------------------------
    def _holder(self, pid: int | None) -> int | None:
        """The holder pid's start time; a pid that is not running is refused."""
        if pid is None:
            return None
        if pid <= 0:
            raise LeaseRefused("bad-args", f"--pid {pid} is not a process id")
        key = process_key(pid)
        if key[1] is None and not os.path.exists(f"/proc/{pid}"):
            raise LeaseRefused("bad-args", f"--pid {pid}: no such process")
        return key[1]

    def _watch(self, rec: LeaseRecord) -> None:
        if rec.pid is None:
            return
        if process_key(rec.pid)[1] != rec.pid_start or not os.path.exists(f"/proc/{rec.pid}"):
            asyncio.get_running_loop().call_soon(self._pid_exited, rec.pid)  # gone while gpud was away
            return
        self.holder_watch.watch([Holder(pid=rec.pid, name="lease holder", device=rec.id)])

    def _pid_exited(self, pid: int) -> None:
        self._wake.set()  # a busy release re-checks its holders
        for rec in self.leases():
            if rec.pid == pid and rec.state in ("held", "vanished") and rec.id not in self._releasing:
                asyncio.get_running_loop().create_task(self._auto_release(rec, pid))

    async def _auto_release(self, rec: LeaseRecord, pid: int) -> None:
        try:
            await self.release(rec.id, why=f"released: its holder pid {pid} exited")
        except LeaseRefused as e:
            self.bus.publish("error", f"lease {rec.id}: holder pid {pid} exited, but the release failed: {e}",
                             gpu=rec.gpu)

    # ---- rooms ----------------------------------------------------------------------------------
    def _rooms(self, selector: str | None) -> tuple[list[Room], list[str]]:
        """The dynamic GPUs a lease may use now, as rooms (every GI on them, ours being made too),
        and notes on those left out and why."""
        rooms: list[Room] = []
        notes: list[str] = []
        chosen = [(g, d) for g, d in self._dynamic() if selector is None or _selects(g, selector)]
        if selector is not None and not chosen:
            raise LeaseRefused("not-found", f"no dynamic GPU (mig-devices: dynamic) matches {selector!r}")
        for gpu, _ in chosen:
            # A host read that overlapped a lease's or release's NVML calls on this GPU may have
            # found it unreadable (a GI destroyed between two calls): the last good view stands in,
            # our own instances come from the records anyway.
            nv = gpu.nvml or self._last_seen.get(gpu.pci)
            if gpu.nvml is not None:
                self._last_seen[gpu.pci] = gpu.nvml
            mine = self.on(gpu.pci)
            if nv is None or not nv.mig_capable:
                notes.append(f"{_where(gpu)}: not seen by NVML as MIG capable")
                continue
            if any(r.kind == "gpu" for r in mine):
                notes.append(f"{_where(gpu)}: leased whole")
                continue
            if nv.mig_mode != 1 and not self._mode_follows(gpu):
                notes.append(f"{_where(gpu)}: MIG mode is off (pending {nv.mig_pending}); an apply turns it on")
                continue
            used: dict[Placement, int] = {}
            started = self._observed_at()
            for gi in nv.instances if nv.mig_mode == 1 else ():
                if self._destroyed.get((gpu.pci, gi.id), -1.0) < started:
                    used[gi.placement] = gi.profile_id
            for r in mine:
                if r.placement is not None and r.gi_profile_id is not None and r.state != "vanished":
                    used[r.placement] = r.gi_profile_id
            profiles = with_model_ci_profiles(nv.profiles, gpu.function.device)
            rooms.append(Room(gpu.pci, gpu.index, profiles, tuple((pid, pl) for pl, pid in sorted(used.items())),
                              _where(gpu)))
        return rooms, notes

    def _mig_mode(self, pci: str, observed: int | None) -> int | None:
        """The MIG mode now: the one this engine set, unless the observation was read after it."""
        mine = self._mode.get(pci)
        return mine[0] if mine is not None and mine[1] > self._observed_at() else observed

    def _mode_follows(self, gpu: Gpu) -> bool:
        """Hopper and later change MIG mode without a reset; policy.lease-mig-mode may keep it on."""
        arch = by_device(gpu.function.device)
        policy = self._policy()
        return (arch is not None and not arch.mode_change_needs_reset
                and (policy is None or policy.lease_mig_mode == "follow"))

    def _gpu(self, pci: str) -> Gpu | None:
        return next((g for g, _ in self._dynamic() if g.pci == pci), None)

    def _refresh(self) -> None:
        """Re-read the host in the background after a change (one read at a time, not awaited:
        the lease's answer does not wait for it). A read already under way began before this
        change, so another follows it: status and labels must not keep a released instance."""
        self._reread_wanted = True
        if self._rereading is None or self._rereading.done():
            self._rereading = asyncio.get_running_loop().create_task(self._reread_until_current())

    async def _reread_until_current(self) -> None:
        while self._reread_wanted:
            self._reread_wanted = False
            await self._reread_host()

    async def settled(self) -> None:
        """Wait for the background re-read a lease or release started (before NVML is closed)."""
        if self._rereading is not None:
            await asyncio.wait({self._rereading})

    # ---- helpers ---------------------------------------------------------------------------------
    def _lock(self, pci: str) -> asyncio.Lock:
        return self._locks.setdefault(pci, asyncio.Lock())

    def _devices(self, pci: str, gi: int, ci: int, nv: NvmlGpu | None) -> tuple[str, ...]:
        """/dev/nvidiaN and the GI's and CI's access capabilities (what a container or cgroup needs)."""
        if nv is None:
            gpu = self._gpu(pci)
            nv = gpu.nvml if gpu is not None else None
        minor = nv.minor if nv is not None else None
        if minor is None:
            return ()
        procs = self.hw.procs
        return (f"/dev/nvidia{minor}", f"/dev/nvidia-caps/nvidia-cap{procs.mig_cap_minor(minor, gi)}",
                f"/dev/nvidia-caps/nvidia-cap{procs.mig_cap_minor(minor, gi, ci)}")

    def _writable(self) -> None:
        if self.read_only:
            raise LeaseRefused("forbidden", "read-only mode: gpud makes no leases")


def _selects(gpu: Gpu, selector: str) -> bool:
    wanted = selector.lower()
    return wanted in (str(gpu.index), gpu.pci, gpu.pci.removeprefix("0000:")) or (
        gpu.nvml is not None and gpu.nvml.uuid.lower() == wanted)


def _where(gpu: Gpu) -> str:
    return f"GPU {gpu.index} ({gpu.pci}, {model_name(gpu)})"


def _at(rec: LeaseRecord) -> str:
    return f"{rec.placement.start}:{rec.placement.size}" if rec.placement is not None else "-"
