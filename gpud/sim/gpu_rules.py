"""The simulated GPU's rules over the host state: which GPUs NVML sees, MIG devices and their
names, who is busy on a GPU, what a reset does, how memory slices are taken.

One home for the rules that more than one surface of the simulator applies: the NVML library
(gpud/sim/nvml_lib.py, served to pynvml and, through gpud/sim/nvmlc, to any C program), the
simulated kernel (a sysfs `reset`) and the simulated nvidia-smi (`-r`). Pure functions of
SimState and the model tables; no pynvml, no I/O.
"""

from __future__ import annotations

from gpud.layout.names import device_name
from gpud.model import MigProfile
from gpud.profiles import MODELS, ModelInfo
from gpud.sim.state import SimCi, SimGi, SimGpu, SimProcess, SimState

MIB = 1 << 20

def model_of(gpu: SimGpu) -> ModelInfo:
    return MODELS[gpu.model]


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
