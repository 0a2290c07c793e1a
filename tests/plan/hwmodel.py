"""A pure model of a MIG GPU that enforces NVML's rules, and a fake Nvml adapter on top of it.

Written from docs/hardware/mig-nvml.md and docs/hardware/mig-ids.md (not from the planner and not
the product simulator) so tests judge the planner and executor against an independent statement of
the hardware rules:
- GI create: MIG must be on (NOT_SUPPORTED 3), start in the profile's list (INVALID_ARGUMENT 2),
  no memory-slice overlap and per-profile count (INSUFFICIENT_RESOURCES 23);
- CI create: the CI profile must belong to the GI profile (2), compute slices and the CI profile's
  count must fit (23); ids are the lowest free ones, so ids are reused; a CI of c slices may sit at
  0, c, 2c ... (as many slots as its instance count); an explicit start off that list is 2, a taken
  slot 23; without a start the lowest free slot is taken;
- destroy: unknown id NOT_FOUND 6; a CI with processes, or a GI with CIs, IN_USE 19;
- set MIG mode: Hopper applies at once when idle (else pending, activation IN_USE); Ampere stays
  pending until a reset; disabling with instances present is IN_USE.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from gpud.model import (
    ComputeInstance,
    GpuInstance,
    Holder,
    MigProfile,
    NvmlGpu,
    Placement,
)

NOT_SUPPORTED, INVALID_ARGUMENT, NOT_FOUND, TIMEOUT, IN_USE, INSUFFICIENT, UNKNOWN = 3, 2, 6, 10, 19, 23, 999
MESSAGES = {3: "Not Supported", 2: "Invalid Argument", 6: "Not Found", 10: "Timeout", 19: "In use by another client",
            23: "Insufficient Resources", 999: "Unknown Error"}


class HwError(Exception):
    """Same shape as gpud.host.nvidia.nvml.NvmlError: .code, .function, .pci."""

    def __init__(self, code: int, function: str = "", pci: str | None = None) -> None:
        self.message = MESSAGES.get(code, f"error {code}")
        super().__init__(self.message)
        self.code, self.function, self.pci = code, function, pci


@dataclass
class HwCi:
    profile_id: int
    slices: int
    uuid: str
    holders: tuple[Holder, ...] = ()
    start: int = 0


@dataclass
class HwGi:
    profile_id: int
    placement: Placement
    cis: dict[int, HwCi] = field(default_factory=dict)


@dataclass
class HwGpu:
    pci: str
    name: str
    profiles: tuple[MigProfile, ...]
    arch: str = "hopper"
    mode: int = 1
    pending: int = 1
    gis: dict[int, HwGi] = field(default_factory=dict)
    processes: tuple[Holder, ...] = ()  # compute processes outside MIG devices
    serial: int = 0
    resets: int = 0

    def profile(self, pid: int) -> MigProfile | None:
        return next((p for p in self.profiles if p.id == pid), None)

    def busy(self) -> bool:
        return bool(self.processes) or any(c.holders for g in self.gis.values() for c in g.cis.values())

    # ---- NVML operations --------------------------------------------------------------------
    def set_mig_mode(self, enabled: bool) -> int:
        want = int(enabled)
        if not want and self.gis:
            raise HwError(IN_USE, "nvmlDeviceSetMigMode", self.pci)
        self.pending = want
        if self.mode == want:
            return 0
        if self.arch == "ampere":
            return 0  # applied by the next reset
        if self.busy():
            return IN_USE
        self.mode = want
        return 0

    def reset(self) -> None:
        if self.busy():
            raise OSError(16, "Device or resource busy")
        self.resets += 1
        self.mode = self.pending
        self.gis.clear()

    def create_gi(self, pid: int, start: int) -> int:
        fn = "nvmlDeviceCreateGpuInstanceWithPlacement"
        if self.mode != 1:
            raise HwError(NOT_SUPPORTED, fn, self.pci)
        p = self.profile(pid)
        if p is None:
            raise HwError(INVALID_ARGUMENT, fn, self.pci)
        pl = next((x for x in p.placements if x.start == start), None)
        if pl is None:
            raise HwError(INVALID_ARGUMENT, fn, self.pci)
        used = set().union(*(g.placement.slices for g in self.gis.values())) if self.gis else set()
        if pl.slices & used or sum(g.profile_id == pid for g in self.gis.values()) >= p.instance_count:
            raise HwError(INSUFFICIENT, fn, self.pci)
        gid = next(i for i in itertools.count(1) if i not in self.gis)
        self.gis[gid] = HwGi(pid, pl)
        return gid

    def create_ci(self, gid: int, ci_pid: int, start: int | None = None) -> int:
        fn = "nvmlGpuInstanceCreateComputeInstance" + ("WithPlacement" if start is not None else "")
        if self.mode != 1:
            raise HwError(NOT_SUPPORTED, fn, self.pci)
        gi = self.gis.get(gid)
        if gi is None:
            raise HwError(NOT_FOUND, fn, self.pci)
        gp = self.profile(gi.profile_id)
        assert gp is not None
        cp = next((c for c in gp.ci_profiles if c.id == ci_pid), None)
        if cp is None:
            raise HwError(INVALID_ARGUMENT, fn, self.pci)
        slots = [i * cp.slices for i in range(cp.instance_count)]
        if start is not None and start not in slots:
            raise HwError(INVALID_ARGUMENT, fn, self.pci)
        used = {s for c in gi.cis.values() for s in range(c.start, c.start + c.slices)}
        free = [s for s in slots if not used & set(range(s, s + cp.slices))]
        if sum(c.profile_id == ci_pid for c in gi.cis.values()) >= cp.instance_count or not free:
            raise HwError(INSUFFICIENT, fn, self.pci)
        if start is None:
            start = free[0]
        elif start not in free:
            raise HwError(INSUFFICIENT, fn, self.pci)
        cid = next(i for i in itertools.count(0) if i not in gi.cis)
        self.serial += 1
        gi.cis[cid] = HwCi(ci_pid, cp.slices, f"MIG-{self.pci}-{self.serial:04d}", start=start)
        return cid

    def destroy_ci(self, gid: int, cid: int) -> None:
        fn = "nvmlComputeInstanceDestroy"
        gi = self.gis.get(gid)
        if gi is None or cid not in gi.cis:
            raise HwError(NOT_FOUND, fn, self.pci)
        if gi.cis[cid].holders:
            raise HwError(IN_USE, fn, self.pci)
        del gi.cis[cid]

    def destroy_gi(self, gid: int) -> None:
        fn = "nvmlGpuInstanceDestroy"
        gi = self.gis.get(gid)
        if gi is None:
            raise HwError(NOT_FOUND, fn, self.pci)
        if gi.cis:
            raise HwError(IN_USE, fn, self.pci)
        del self.gis[gid]

    # ---- observation ------------------------------------------------------------------------
    def snapshot(self) -> NvmlGpu:
        insts = tuple(
            GpuInstance(gid, g.profile_id, g.placement,
                        tuple(ComputeInstance(cid, c.profile_id, c.slices, c.uuid, c.holders, c.start)
                              for cid, c in sorted(g.cis.items())))
            for gid, g in sorted(self.gis.items())
        ) if self.mode == 1 else ()
        return NvmlGpu(self.pci, f"GPU-{self.pci}", self.name, 0, 0, True, self.mode, self.pending,
                       self.profiles, insts, self.processes)

    def layout(self) -> list[tuple[int, tuple[int, ...]]]:
        """Sorted (GI profile id, sorted CI profile ids) of every GI."""
        return sorted((g.profile_id, tuple(sorted(c.profile_id for c in g.cis.values()))) for g in self.gis.values())

    def uuids(self) -> dict[str, tuple[int, Placement]]:
        return {c.uuid: (gid, g.placement) for gid, g in self.gis.items() for c in g.cis.values()}


def apply_steps(hw: HwGpu, steps: Sequence) -> None:
    """Apply plan steps straight to the model (no executor): create-ci finds its GI by placement."""
    for s in steps:
        if s.action == "set-mig-mode":
            hw.set_mig_mode(bool(s.enabled))
            if hw.mode != hw.pending:
                hw.reset()
        elif s.action == "destroy-ci":
            hw.destroy_ci(s.gi, s.ci)
        elif s.action == "destroy-gi":
            hw.destroy_gi(s.gi)
        elif s.action == "create-gi":
            hw.create_gi(s.profile_id, s.placement.start)
        elif s.action == "create-ci":
            gid = next(i for i, g in hw.gis.items() if g.placement == s.placement and g.profile_id == s.profile_id)
            if s.gi is not None:
                assert gid == s.gi
            hw.create_ci(gid, s.ci_profile_id, s.ci_placement.start if s.ci_placement is not None else None)
        else:
            raise AssertionError(s.action)


class FakeNvml:
    """The gpud.host.nvidia.nvml.Nvml contract over HwGpu models, with fault injection.

    `faults[method]` is a list of (code, applied) consumed one per call: the call raises HwError(code),
    after doing its work first when `applied` (a timeout that hides a success)."""

    def __init__(self, gpus: Sequence[HwGpu], *, read_only: bool = False) -> None:
        self.hw = {g.pci: g for g in gpus}
        self.read_only = read_only
        self.faults: dict[str, list[tuple[int, bool]]] = {}
        self.calls: list[tuple] = []

    def _do(self, name: str, pci: str, fn, *args):
        from gpud.host.readonly import refuse_if

        refuse_if(self.read_only, name, pci)
        self.calls.append((name, pci) + args)
        queue = self.faults.get(name)
        if queue:
            code, applied = queue.pop(0)
            if applied:
                fn(*args)
            raise HwError(code, name, pci)
        return fn(*args)

    def gpus(self, *, on_nvidia=None) -> list[NvmlGpu]:  # a model without NVML's enumeration at init
        return [g.snapshot() for g in self.hw.values()]

    def gpu(self, pci: str, *, details: bool = True) -> NvmlGpu | None:
        g = self.hw.get(pci)
        if g is None:
            return None
        snap = g.snapshot()
        if details:
            return snap
        # the layout only, as gpud.host.nvidia.nvml answers it: no MIG UUIDs, holders or processes
        bare = tuple(msgspec.structs.replace(gi, cis=tuple(msgspec.structs.replace(c, uuid="", holders=())
                                                               for c in gi.cis)) for gi in snap.instances)
        return msgspec.structs.replace(snap, instances=bare, processes=())

    def set_mig_mode(self, pci: str, enabled: bool) -> int:
        return self._do("set_mig_mode", pci, self.hw[pci].set_mig_mode, enabled)

    def create_gpu_instance(self, pci: str, profile_id: int, start: int) -> int:
        return self._do("create_gpu_instance", pci, self.hw[pci].create_gi, profile_id, start)

    def create_compute_instance(self, pci: str, gi_id: int, ci_profile_id: int, start: int | None = None) -> int:
        if start is None:
            return self._do("create_compute_instance", pci, self.hw[pci].create_ci, gi_id, ci_profile_id)
        return self._do("create_compute_instance", pci, self.hw[pci].create_ci, gi_id, ci_profile_id, start)

    def destroy_compute_instance(self, pci: str, gi_id: int, ci_id: int) -> None:
        return self._do("destroy_compute_instance", pci, self.hw[pci].destroy_ci, gi_id, ci_id)

    def destroy_gpu_instance(self, pci: str, gi_id: int) -> None:
        return self._do("destroy_gpu_instance", pci, self.hw[pci].destroy_gi, gi_id)


def clone(hw: HwGpu) -> HwGpu:
    return copy.deepcopy(hw)


SEVEN_SLICE = ("a100-40gb", "a100-80gb", "h100-80gb", "h100-nvl", "h200")
# Every MIG model the simulator offers, 4-slice A30 and 12-memory-slice RTX PRO 6000 included.
MIG_MODELS = SEVEN_SLICE + ("a30", "rtx-pro-6000")


def make_hw(model: str = "h100-80gb", pci: str = "0000:3b:00.0", *, mode: int = 1) -> HwGpu:
    from gpud.profiles import MODELS

    m = MODELS[model]
    return HwGpu(pci, m.name, m.profiles, m.arch, mode=mode, pending=mode)


def gpu_of(hw: HwGpu, index: int = 0, *, model: str | None = None):
    """The observed Gpu record the planner gets for this model GPU."""
    from gpud.model import Gpu, PciFunction
    from gpud.profiles import MODELS

    m = MODELS[model] if model else next(x for x in MODELS.values() if x.name == hw.name)
    fn = PciFunction(hw.pci, 0x10DE, m.device, 0x10DE, m.subsystem_device or 0, 0x030200, "nvidia")
    return Gpu(index, fn, nvml=hw.snapshot())


def build(hw: HwGpu, layout: Sequence[tuple[str, int] | tuple[str, int, Sequence[str]]]) -> dict[int, int]:
    """Create GIs by (GI name, start[, CI names]) with full CIs by default; returns start -> GI id."""
    ids = {}
    for item in layout:
        name, start = item[0], item[1]
        p = next(x for x in hw.profiles if x.name == name)
        gid = hw.create_gi(p.id, start)
        ids[start] = gid
        cis = item[2] if len(item) > 2 else [name]
        for ci in cis:
            c = next(c for c in p.ci_profiles
                     if f"{c.slices}c.{p.name}" == ci or (ci == p.name and c.slices == p.slices))
            hw.create_ci(gid, c.id)
    return ids


def hold(hw: HwGpu, start: int, pid: int = 4242, name: str = "python3") -> Holder:
    """Put a process on every CI of the GI at `start`."""
    gi = next(g for g in hw.gis.values() if g.placement.start == start)
    h = None
    for c in gi.cis.values():
        h = Holder(pid, name, c.uuid)
        c.holders = (h,)
    assert h is not None
    return h


def names_of(profiles: tuple[MigProfile, ...]) -> list[str]:
    """The GI profile names, then the CI-in-GI names (`<c>c.<gi>`) of every smaller CI profile."""
    out = [p.name for p in profiles]
    out += [f"{c.slices}c.{p.name}" for p in profiles for c in p.ci_profiles if c.slices < p.slices]
    return out
