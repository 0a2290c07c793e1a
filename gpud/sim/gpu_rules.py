"""The simulated GPU's rules over the host state: which GPUs NVML sees, MIG devices and their
names, who is busy on a GPU, what a reset does, how memory slices are taken, and where a new GPU or
compute instance goes and whether it fits.

One home for the GPU's rules, apart from the surfaces that serve them: the NVML library
(gpud/sim/nvml_lib.py and nvml_mig.py, served to pynvml and, through gpud/sim/nvmlc, to any C
program), the simulated kernel (a sysfs `reset`) and the simulated nvidia-smi (`-r`). Pure
functions of SimState and the model tables; no pynvml, no I/O. A refusal is `Refused(<NVML error
name>)`; the NVML surface turns the name into its return code.
"""

from __future__ import annotations

import uuid

from gpud.layout.names import device_name
from gpud.model import CiProfile, MigProfile
from gpud.profiles import ModelInfo
from gpud.sim.gi_ids import gi_id
from gpud.sim.inferred import sim_model
from gpud.sim.state import SimCi, SimGi, SimGpu, SimProcess, SimState

MIB = 1 << 20

def model_of(gpu: SimGpu, driver_version: str) -> ModelInfo:
    """The GPU's model as the simulator serves it under the host's driver (profile names by driver
    branch, inferred cells filled: gpud/sim/inferred.py)."""
    return sim_model(gpu.model, driver_version)


def visible_gpus(state: SimState) -> list[SimGpu]:
    """GPUs NVML enumerates: bound to nvidia, present, with the nvidia module loaded."""
    if "nvidia" not in state.loaded_modules:
        return []
    out = []
    for address in sorted(state.gpus):
        f = state.functions.get(address)
        if f is not None and f.present and f.driver == "nvidia":
            out.append(state.gpus[address])
    return out


def mig_devices(gpu: SimGpu) -> list[tuple[SimGi, SimCi]]:
    """MIG devices in NVML's index order: by GI id, then CI id."""
    if gpu.mig_mode != 1:
        return []
    return [(gi, ci) for gi in sorted(gpu.gis, key=lambda g: g.id) for ci in sorted(gi.cis, key=lambda c: c.id)]


def gpu_processes(state: SimState, gpu: SimGpu) -> list[SimProcess]:
    keys = {gpu.uuid, gpu.address.lower()}
    return [p for p in state.processes if p.device.lower() in keys or p.device in keys]


def mig_processes(state: SimState, ci: SimCi) -> list[SimProcess]:
    return [p for p in state.processes if p.device == ci.uuid]


def busy(state: SimState, gpu: SimGpu) -> bool:
    """Anything running on the GPU or on one of its MIG devices."""
    uuids = {ci.uuid for gi in gpu.gis for ci in gi.cis}
    return bool(gpu_processes(state, gpu)) or any(p.device in uuids for p in state.processes)


def reset_gpu(state: SimState, address: str) -> None:
    """A GPU reset as the driver sees it: a pending MIG mode takes effect; disabling drops GIs.

    Callers hold the host lock: the simulated kernel (sysfs `reset`) and nvidia-smi -r.
    """
    gpu = state.gpus.get(address)
    if gpu is None:
        return
    if gpu.mig_pending != gpu.mig_mode:
        gpu.mig_mode = gpu.mig_pending
    if gpu.mig_mode == 0:
        gpu.gis.clear()


def reports_persistent(state: SimState, address: str) -> bool:
    """What NVML (and so nvidia-smi) reports as the GPU's persistence mode. Where nvidia-persistenced
    runs out of the caller's sight (its socket hidden: another container), persistence reads as
    off although the daemon holds the GPU (NVIDIA/dgx-selinux#3: "Persistence Mode is reported as
    Off" when nvidia-smi cannot reach the socket)."""
    hidden = state.persistence == "daemon" and state.persistenced_socket == "hidden"
    return address in state.persistent and not hidden


def profile_of(model: ModelInfo, profile_id: int) -> MigProfile | None:
    return next((p for p in model.profiles if p.id == profile_id), None)


def used_slices(gpu: SimGpu, skip: SimGi | None = None) -> set[int]:
    return {s for g in gpu.gis if g is not skip for s in range(g.start, g.start + g.size)}


def memory_slices(model: ModelInfo) -> int:
    """The GPU's memory slices: the end of its farthest-reaching placement (8 on A100/H100/H200)."""
    return max(pl.start + pl.size for p in model.profiles for pl in p.placements)


def is_free(gpu: SimGpu, start: int, size: int) -> bool:
    return not (used_slices(gpu) & set(range(start, start + size)))


def mig_name(model: ModelInfo, gi: SimGi, ci: SimCi) -> str:
    prof = profile_of(model, gi.profile_id)
    assert prof is not None
    ci_prof = next((c for c in prof.ci_profiles if c.id == ci.profile_id), None)
    return device_name(prof, ci_prof.slices if ci_prof is not None else None)


def ci_slices(model: ModelInfo, gi: SimGi, ci: SimCi) -> int:
    prof = profile_of(model, gi.profile_id)
    assert prof is not None
    return next((c.slices for c in prof.ci_profiles if c.id == ci.profile_id), 0)


# --- MIG creation: where a new instance goes, and whether it fits ----------------------------------


class Refused(Exception):
    """A MIG request the driver refuses; `error` is NVML's name for it without `NVML_ERROR_`
    (INVALID_ARGUMENT, INSUFFICIENT_RESOURCES, NOT_SUPPORTED, IN_USE)."""

    def __init__(self, error: str):
        super().__init__(error)
        self.error = error


# Where the driver puts a GI created without a placement (inferred, not documented:
# docs/hardware/mig-nvml.md): first free start in this order. Profiles not listed take their allowed
# starts in ascending order. The order comes from 8-memory-slice GPUs (A100, H100, H200), where these
# ids are 1g, 2g and 3g; on 4-slice GPUs (A30, RTX PRO 6000) id 14 is 1g and it does not apply.
PREFERENCE: dict[int, tuple[int, ...]] = {
    19: (6, 4, 5, 0, 1, 2, 3),
    20: (6, 4, 5, 0, 1, 2, 3),
    # A GH200 96GB's three unplaced 1g.24gb GIs got ids 5, 3, 4 (tests/fixtures/captures/gh200-96gb
    # README): starts 4, 0, 2 in the "tree" numbering, the 2g order; 6 last is inferred.
    15: (4, 0, 2, 6),
    14: (4, 0, 2),
    9: (4, 0),
}


def require_mig_on(gpu: SimGpu) -> None:
    """Instances are created only with MIG on and no mode change pending."""
    if gpu.mig_mode != 1 or gpu.mig_pending != 1:
        raise Refused("NOT_SUPPORTED")


def free_gi_starts(gpu: SimGpu, prof: MigProfile) -> list[int]:
    used = used_slices(gpu)
    return [pl.start for pl in prof.placements if not (used & pl.slices)]


def gi_capacity(gpu: SimGpu, prof: MigProfile) -> int:
    """How many more GIs of `prof` fit: free placements, bounded by the profile's instance count."""
    existing = sum(1 for g in gpu.gis if g.profile_id == prof.id)
    return max(0, min(len(free_gi_starts(gpu, prof)), prof.instance_count - existing))


def create_gi(gpu: SimGpu, model: ModelInfo, prof: MigProfile, start: int | None, size: int | None) -> SimGi:
    """A new GI of `prof` on `gpu`, at `start:size` or, without one, where the driver puts it.

    A placement the profile does not offer is INVALID_ARGUMENT; a full profile or a taken slot is
    INSUFFICIENT_RESOURCES. The GI's id follows its memory placement (gpud.sim.gi_ids)."""
    require_mig_on(gpu)
    pl_size = prof.placements[0].size
    starts = [pl.start for pl in prof.placements]
    if start is not None and (start not in starts or size != pl_size):
        raise Refused("INVALID_ARGUMENT")
    if sum(1 for g in gpu.gis if g.profile_id == prof.id) >= prof.instance_count:
        raise Refused("INSUFFICIENT_RESOURCES")
    if start is None:
        preferred = PREFERENCE.get(prof.id, ()) if memory_slices(model) == 8 else ()
        order = tuple(preferred) + tuple(sorted(s for s in starts if s not in preferred))
        start = next((s for s in order if s in starts and is_free(gpu, s, pl_size)), None)
        if start is None:
            raise Refused("INSUFFICIENT_RESOURCES")
    elif not is_free(gpu, start, pl_size):
        raise Refused("INSUFFICIENT_RESOURCES")
    gi = SimGi(id=gi_id(gpu.gi_id_order, start, pl_size, memory_slices(model)), profile_id=prof.id,
               start=start, size=pl_size)
    gpu.gis.append(gi)
    return gi


def gi_profile(model: ModelInfo, gi: SimGi) -> MigProfile:
    prof = profile_of(model, gi.profile_id)
    assert prof is not None
    return prof


def ci_profile(model: ModelInfo, gi: SimGi, ci_profile_id: int) -> CiProfile:
    """The CI profile `ci_profile_id` of the GI's profile; one it lacks is NOT_SUPPORTED."""
    ci_prof = next((c for c in gi_profile(model, gi).ci_profiles if c.id == ci_profile_id), None)
    if ci_prof is None:
        raise Refused("NOT_SUPPORTED")
    return ci_prof


def ci_free_starts(model: ModelInfo, gi: SimGi, ci_prof: CiProfile) -> list[int]:
    """Starts of `ci_prof` none of whose compute slices a CI of `gi` occupies."""
    used = {s for c in gi.cis for s in range(c.start, c.start + ci_slices(model, gi, c))}
    return [s for s in ci_prof.starts if not used & set(range(s, s + ci_prof.slices))]


def ci_capacity(model: ModelInfo, gi: SimGi, ci_profile_id: int) -> int:
    """Free placements that do not overlap, bounded by the profile's instance count (as for GIs)."""
    ci_prof = ci_profile(model, gi, ci_profile_id)
    same = sum(1 for c in gi.cis if c.profile_id == ci_profile_id)
    free, taken = 0, set[int]()
    for start in ci_free_starts(model, gi, ci_prof):
        slots = set(range(start, start + ci_prof.slices))
        if not slots & taken:
            free += 1
            taken |= slots
    return max(0, min(free, ci_prof.instance_count - same))


def create_ci(model: ModelInfo, gi: SimGi, ci_profile_id: int, start: int | None, size: int | None) -> SimCi:
    """A new CI on `gi`. A placement must be one the profile offers (else INVALID_ARGUMENT, as a
    GI start outside its list); a taken slot, or no free one, is INSUFFICIENT_RESOURCES. Without a
    placement it takes the lowest free slot (inferred: docs/hardware/mig-ids.md); its id is the
    lowest the GI has free."""
    ci_prof = ci_profile(model, gi, ci_profile_id)
    if start is not None and (start not in ci_prof.starts or size != ci_prof.slices):
        raise Refused("INVALID_ARGUMENT")
    if ci_capacity(model, gi, ci_profile_id) < 1:
        raise Refused("INSUFFICIENT_RESOURCES")
    free = ci_free_starts(model, gi, ci_prof)
    if start is None:
        start = free[0]
    elif start not in free:
        raise Refused("INSUFFICIENT_RESOURCES")
    ids = {c.id for c in gi.cis}
    ci = SimCi(id=next(i for i in range(len(ids) + 1) if i not in ids), profile_id=ci_profile_id,
               uuid=f"MIG-{uuid.uuid4()}", start=start)
    gi.cis.append(ci)
    return ci
