"""Simulated hosts built from the known models of gpud.profiles.

The layout mimics a typical 8-GPU server: one GPU per PCIe switch at spread-out bus numbers, NUMA 0
for the first half and 1 for the second, each GPU in its own IOMMU group, plus a NIC that no layout
`match:` should ever select. Everything is deterministic (UUIDs derive from the PCI address), so
two `gpud-sim create` runs produce the same host.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence

import gpud.sim.gi_ids as gi_ids
from gpud.profiles import MODELS, NVIDIA, WHOLE_GPU, ModelInfo
from gpud.sim.inferred import sim_model
from gpud.sim.state import SimFunction, SimGpu, SimState

_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
_SEED = uuid.UUID("5f0c7a52-3d1e-4b8e-9a57-6e0c2f1d9b44")  # fixed: UUIDs do not depend on DIR

CLASS_3D = 0x030200
CLASS_VGA = 0x030000
CLASS_AUDIO = 0x040300
NIC = SimFunction(address="0000:0c:00.0", vendor=0x15B3, device=0x101D, subsystem_vendor=0x15B3,
                  subsystem_device=0x0016, class_code=0x020000, revision=0x00, native_driver="mlx5_core",
                  driver="mlx5_core", iommu_group=1, numa_node=0)


# NVSwitch PCI functions of an HGX baseboard (`gpud-sim create --nvswitch`): NVIDIA bridges (class
# 0x0680) with the device ids pci.ids gives (gpud/data/kubevirt-nvidia-pci.ids: 1af1 "GA100 [A100
# NVSwitch]", 22a3 "GH100 [H100 NVSwitch]"), bound to nvidia-nvswitch. Their presence is what makes
# the simulated nvidia-smi refuse a single-GPU reset (docs/hardware/gpu-reset.md).
CLASS_BRIDGE_OTHER = 0x068000
NVSWITCH_DEVICE = {"ampere": 0x1AF1, "hopper": 0x22A3}
NVSWITCHES_PER_BASEBOARD = {"ampere": 6, "hopper": 4}
_NVSWITCH_BUS = 0xC0


def is_nvswitch(f: SimFunction) -> bool:
    return f.vendor == NVIDIA and f.class_code == CLASS_BRIDGE_OTHER and f.device in NVSWITCH_DEVICE.values()


# Memory the driver reserves on the whole GPU (NVML memory info v2 `reserved`, counted as used in
# v1), in bytes: the real H200, driver 580.159.04, 615 MiB and 64 KiB
# (tests/fixtures/h200/2026-12-04/nvml-real.json). Other models: no capture, none reserved (unknown).
RESERVED_BYTES = {"h200": 644_939_776}


class CatalogError(ValueError):
    pass


def offered() -> list[str]:
    """Model keys the simulator can stand in for: those whose whole table comes from a source, or
    is completed by the simulator's stated inference rules (gpud/sim/inferred.py), which
    `gpud-sim create` names so that no test passes against an inferred cell unawares. A model
    whose gaps those rules cannot fill is refused."""
    return sorted(k for k in MODELS if sim_model(k).complete)


def model(key: str, driver_version: str | None = None) -> ModelInfo:
    """The model as the simulator serves it (gpud/sim/inferred.py completes some; profile names by
    the driver where they differ by driver branch)."""
    if key not in MODELS:
        raise CatalogError(f"unknown GPU model {key!r}; known: {', '.join(offered())}")
    m = sim_model(key, driver_version)
    if not m.complete:
        raise CatalogError(f"GPU model {key!r} ({m.name}) cannot be simulated: no source gives its "
                           f"MIG table whole ({missing_parts(m)}; see docs/hardware/mig-profiles.md); "
                           f"simulated models: {', '.join(offered())}")
    return m


def inferred_parts(m: ModelInfo) -> str | None:
    """What of a simulated model is inferred rather than read from a source, grouped as
    `missing_parts` groups the unknown; None when everything is sourced."""
    if not m.inferred:
        return None
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, fields in m.inferred:
        groups.setdefault(fields, []).append(name)
    return "; ".join(("the GPU's total memory" if names == [WHOLE_GPU] else f"{', '.join(names)}: {', '.join(fields)}")
                     for fields, names in groups.items())


def missing_parts(m: ModelInfo) -> str:
    """What no source gives for a model, grouped: `1g.23gb: placements, ci_profiles unknown;
    3g.90gb, 4g.90gb: name and instance count only; the GPU's total memory unknown`."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, fields in m.unknown:
        groups.setdefault(fields, []).append(name)
    parts = []
    for fields, names in groups.items():
        if names == [WHOLE_GPU]:
            parts.append("the GPU's total memory unknown")
        elif "id" in fields:
            known = "name only" if "instance_count" in fields else "name and instance count only"
            parts.append(f"{', '.join(names)}: {known}")
        else:
            parts.append(f"{', '.join(names)}: {', '.join(fields)} unknown")
    return "; ".join(parts)


def vgpu_capable() -> list[str]:
    """Model keys whose GPUs offer vGPU types (gpud.vgpu_types)."""
    from gpud.vgpu_types import by_device

    return sorted(k for k, m in MODELS.items() if by_device(m.device) is not None)


def parse_gpu_specs(specs: Iterable[str]) -> list[str]:
    """["h200:2", "l40s"] -> ["h200", "h200", "l40s"] (one model key per GPU, in order)."""
    out: list[str] = []
    for spec in specs:
        key, _, count = spec.partition(":")
        model(key)
        try:
            n = int(count) if count else 1
        except ValueError:
            raise CatalogError(f"bad GPU count in {spec!r}") from None
        if n < 1:
            raise CatalogError(f"bad GPU count in {spec!r}")
        out.extend([key] * n)
    return out


def _subsystem(m: ModelInfo) -> int:
    """The board's PCI subsystem id; 0 where no source names it (gpud only reads it, never keys on it)."""
    return m.subsystem_device if m.subsystem_device is not None else 0


def gpu_address(ordinal: int) -> str:
    """PCI address of the n-th GPU; past eight GPUs the pattern repeats on the next PCI segment."""
    domain, i = divmod(ordinal, len(_BUSES))
    return f"{domain:04x}:{_BUSES[i]:02x}:00.0"


def gpu_uuid(address: str) -> str:
    return f"GPU-{uuid.uuid5(_SEED, address)}"


def add_nvswitches(state: SimState, arch: str) -> None:
    """The NVSwitches of an HGX baseboard of `arch` ("ampere": HGX A100, six switches; "hopper":
    HGX H100/H200, four), on their own buses, each in its own IOMMU group."""
    if arch not in NVSWITCH_DEVICE:
        raise CatalogError(f"--nvswitch: no NVSwitch baseboard is known for {arch} GPUs (known: ampere, hopper)")
    for i in range(NVSWITCHES_PER_BASEBOARD[arch]):
        address = f"0000:{_NVSWITCH_BUS + i:02x}:00.0"
        state.functions[address] = SimFunction(
            address=address, vendor=NVIDIA, device=NVSWITCH_DEVICE[arch], subsystem_vendor=NVIDIA,
            subsystem_device=0, class_code=CLASS_BRIDGE_OTHER, native_driver="nvidia-nvswitch",
            driver="nvidia-nvswitch", iommu_group=100 + i, numa_node=-1)
    if "nvidia_nvswitch" not in state.loaded_modules:
        state.loaded_modules.append("nvidia_nvswitch")
    state.functions = dict(sorted(state.functions.items()))


def build(models: Sequence[str], mig_on: Iterable[int] = ()) -> SimState:
    """A SimState with one GPU per entry of `models` (model keys), ordinals in PCI-address order."""
    mig_on = set(mig_on)
    n = len(models)
    state = SimState(loaded_modules=["nvidia", "mlx5_core"])
    state.functions[NIC.address] = SimFunction(**{f: getattr(NIC, f) for f in NIC.__struct_fields__})
    for i in mig_on:
        if not 0 <= i < n:
            raise CatalogError(f"--mig-on {i}: no GPU with that index (host has {n})")
    for i, key in enumerate(models):
        m = model(key)
        address = gpu_address(i)
        group = 10 + i
        numa = 0 if i < (n + 1) // 2 else 1
        state.functions[address] = SimFunction(
            address=address, vendor=NVIDIA, device=m.device, subsystem_vendor=NVIDIA,
            subsystem_device=_subsystem(m), class_code=CLASS_VGA if m.audio_device else CLASS_3D,
            native_driver="nvidia", driver="nvidia", iommu_group=group, numa_node=numa)
        if m.audio_device is not None:
            audio = address[:-1] + "1"
            state.functions[audio] = SimFunction(
                address=audio, vendor=NVIDIA, device=m.audio_device, subsystem_vendor=NVIDIA,
                subsystem_device=_subsystem(m), class_code=CLASS_AUDIO, native_driver="snd_hda_intel",
                driver="snd_hda_intel", iommu_group=group, numa_node=numa)
            if "snd_hda_intel" not in state.loaded_modules:
                state.loaded_modules.append("snd_hda_intel")
        if i in mig_on and not m.mig_capable:
            raise CatalogError(f"--mig-on {i}: {m.name} is not MIG capable")
        mode = 1 if i in mig_on else 0
        u = gpu_uuid(address)
        # Both GI numberings real GPUs show (gpud.sim.gi_ids), side by side as on the DCGM#138
        # host: even ordinals "tree", odd ones "tree-halves-swapped".
        state.gpus[address] = SimGpu(address=address, model=key, uuid=u, minor=i,
                                     serial=f"16{int(u[4:12], 16) % 10**11:011d}",
                                     mig_mode=mode, mig_pending=mode,
                                     gi_id_order=gi_ids.ORDERS[i % 2])
    state.functions = dict(sorted(state.functions.items()))
    return state
