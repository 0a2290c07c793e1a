"""Known NVIDIA GPU models and their MIG profile tables.

NVML is the source of truth for a GPU it can see. This table serves where NVML cannot be asked
(a GPU on vfio-pci must still have its layout validated against its own model, mig-parted #157)
and is what the simulator serves through its fake NVML. Figures come from `nvidia-smi mig -lgip`
/ `-lgipp` of each model (the H200 row was captured on a real host: tests/fixtures/h200; docs/hardware/mig-nvml.md).
"""

from __future__ import annotations

from msgspec import Struct
from msgspec.structs import replace

from gpud.model import CiProfile, Gpu, MigProfile, Placement

NVIDIA = 0x10DE

# GI profile id -> (memory slices, compute slices, instance count, allowed starts): identical on every
# 7-slice GPU (A100, H100, H100 NVL, H200).
_GEOMETRY: dict[int, tuple[int, int, int, tuple[int, ...]]] = {
    19: (1, 1, 7, (0, 1, 2, 3, 4, 5, 6)),
    20: (1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
    15: (2, 1, 4, (0, 2, 4, 6)),
    14: (2, 2, 3, (0, 2, 4)),
    9: (4, 3, 2, (0, 4)),
    5: (4, 4, 1, (0,)),
    0: (8, 7, 1, (0,)),
}

# NVML GI profile *index* constant for each id (what nvmlDeviceGetGpuInstanceProfileInfo takes).
GI_PROFILE_INDEX: dict[int, int] = {19: 0, 14: 1, 9: 2, 5: 3, 0: 4, 20: 7, 15: 9}

# gpuInstanceId / computeInstanceId NVML reports for a process running outside any MIG instance.
NOT_IN_MIG_INSTANCE = 0xFFFFFFFF

# Compute-instance profile ids (NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE) by compute slices.
CI_PROFILE_ID: dict[int, int] = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}
# CI sizes each GI size can be divided into (4g cannot hold a 3c).
_CI_SPLITS: dict[int, tuple[int, ...]] = {1: (1,), 2: (1, 2), 3: (1, 2, 3), 4: (1, 2, 4), 7: (1, 2, 3, 4, 7)}

# Engines per GI profile id (copy, decoder, encoder, jpeg, ofa), as the H200 reports them.
_ENGINES: dict[int, tuple[int, int, int, int, int]] = {
    19: (1, 1, 0, 1, 0),
    20: (1, 1, 0, 1, 1),
    15: (1, 1, 0, 1, 0),
    14: (2, 2, 0, 2, 0),
    9: (3, 3, 0, 3, 0),
    5: (4, 4, 0, 4, 0),
    0: (8, 7, 0, 7, 1),
}


class ModelInfo(Struct, frozen=True):
    key: str  # simulator model name: "h200"
    name: str  # NVML name: "NVIDIA H200"
    device: int  # PCI device id
    subsystem_device: int
    memory_mb: int  # NVML total memory in MiB
    arch: str  # "turing" | "ampere" | "hopper" | "ada"
    profiles: tuple[MigProfile, ...] = ()  # empty: not MIG capable
    audio_device: int | None = None  # PCI id of an HD-audio function on the same card

    @property
    def mig_capable(self) -> bool:
        return bool(self.profiles)

    @property
    def mode_change_needs_reset(self) -> bool:
        """Ampere keeps a MIG mode change pending until a GPU reset; Hopper applies it when idle."""
        return self.arch == "ampere"


def _ci_profiles(gi_slices: int, sms_per_slice: int, gi_sms: int) -> tuple[CiProfile, ...]:
    return tuple(
        CiProfile(
            id=CI_PROFILE_ID[c],
            slices=c,
            instance_count=gi_slices // c,
            sms=gi_sms if c == gi_slices else sms_per_slice * c,
        )
        for c in _CI_SPLITS[gi_slices]
    )


def _table(rows: dict[int, tuple[str, int, int]]) -> tuple[MigProfile, ...]:
    """rows: GI profile id -> (name, memory MiB, SMs)."""
    sms_per_slice = rows[19][2]
    out = []
    for pid, (name, mem, sms) in rows.items():
        mem_slices, slices, count, starts = _GEOMETRY[pid]
        ce, dec, enc, jpg, ofa = _ENGINES[pid]
        out.append(
            MigProfile(
                id=pid,
                name=name,
                slices=slices,
                memory_mb=mem,
                sms=sms,
                instance_count=count,
                placements=tuple(Placement(s, mem_slices) for s in starts),
                ci_profiles=_ci_profiles(slices, sms_per_slice, sms),
                copy_engines=ce,
                decoders=dec,
                encoders=enc,
                jpegs=jpg,
                ofas=ofa,
            )
        )
    return tuple(out)


def _seven_slice(g1: str, g1mem: int, g1b: str, g2mem: int, g2: str, g3: str, g4: str, g4mem: int, g7: str, g7mem: int,
                 sms: tuple[int, int, int, int, int, int, int]) -> tuple[MigProfile, ...]:
    return _table({
        19: (g1, g1mem, sms[0]),
        20: (g1 + "+me", g1mem, sms[1]),
        15: (g1b, g2mem, sms[2]),
        14: (g2, g2mem, sms[3]),
        9: (g3, g4mem, sms[4]),
        5: (g4, g4mem, sms[5]),
        0: (g7, g7mem, sms[6]),
    })


_HOPPER_SMS = (16, 16, 26, 32, 60, 64, 132)
_AMPERE_SMS = (14, 14, 14, 28, 42, 56, 98)

MODELS: dict[str, ModelInfo] = {
    m.key: m
    for m in (
        ModelInfo("a100-40gb", "NVIDIA A100-SXM4-40GB", 0x20B0, 0x134F, 40960, "ampere",
                  _seven_slice("1g.5gb", 4864, "1g.10gb", 9856, "2g.10gb", "3g.20gb", "4g.20gb", 19968,
                               "7g.40gb", 40192, _AMPERE_SMS)),
        ModelInfo("a100-pcie-40gb", "NVIDIA A100-PCIE-40GB", 0x20F1, 0x145F, 40960, "ampere",
                  _seven_slice("1g.5gb", 4864, "1g.10gb", 9856, "2g.10gb", "3g.20gb", "4g.20gb", 19968,
                               "7g.40gb", 40192, _AMPERE_SMS)),
        ModelInfo("a100-80gb", "NVIDIA A100-SXM4-80GB", 0x20B2, 0x1463, 81920, "ampere",
                  _seven_slice("1g.10gb", 9728, "1g.20gb", 19968, "2g.20gb", "3g.40gb", "4g.40gb", 40192,
                               "7g.80gb", 81152, _AMPERE_SMS)),
        ModelInfo("h100-80gb", "NVIDIA H100 80GB HBM3", 0x2330, 0x16C1, 81559, "hopper",
                  _seven_slice("1g.10gb", 9984, "1g.20gb", 20096, "2g.20gb", "3g.40gb", "4g.40gb", 40448,
                               "7g.80gb", 81152, _HOPPER_SMS)),
        ModelInfo("h100-pcie", "NVIDIA H100 PCIe", 0x2331, 0x1626, 81559, "hopper",
                  _seven_slice("1g.10gb", 9984, "1g.20gb", 20096, "2g.20gb", "3g.40gb", "4g.40gb", 40448,
                               "7g.80gb", 81152, (14, 14, 14, 30, 46, 62, 114))),
        ModelInfo("h100-nvl", "NVIDIA H100 NVL", 0x2321, 0x1839, 95830, "hopper",
                  _seven_slice("1g.12gb", 11008, "1g.24gb", 22144, "2g.24gb", "3g.47gb", "4g.47gb", 44544,
                               "7g.94gb", 89088, _HOPPER_SMS)),
        ModelInfo("h200", "NVIDIA H200", 0x2335, 0x18BF, 143771, "hopper",
                  _seven_slice("1g.18gb", 16384, "1g.35gb", 33280, "2g.35gb", "3g.71gb", "4g.71gb", 71424,
                               "7g.141gb", 143360, _HOPPER_SMS)),
        ModelInfo("l40s", "NVIDIA L40S", 0x26B9, 0x1851, 46068, "ada"),
        ModelInfo("t4", "Tesla T4", 0x1EB8, 0x12A2, 15360, "turing"),
        ModelInfo("rtx6000-ada", "NVIDIA RTX 6000 Ada Generation", 0x26B1, 0x16A1, 49140, "ada",
                  audio_device=0x22BA),
    )
}


def by_device(device_id: int) -> ModelInfo | None:
    return next((m for m in MODELS.values() if m.device == device_id), None)


def known_model_name(gpu: Gpu) -> str | None:
    """The GPU's model name as NVML reports it, else from this table; None when neither knows it."""
    if gpu.nvml is not None and gpu.nvml.name:
        return gpu.nvml.name
    model = by_device(gpu.function.device) if gpu.function.vendor == NVIDIA else None
    return model.name if model is not None else None


def model_name(gpu: Gpu) -> str:
    """What every message, status line and plan calls the GPU's model: "NVIDIA H200", or
    "GPU 10de:2335" for a model neither NVML nor this table names."""
    return known_model_name(gpu) or f"GPU {gpu.pci_id}"


def with_model_ci_profiles(observed: tuple[MigProfile, ...], device_id: int) -> tuple[MigProfile, ...]:
    """The GI profiles NVML reported, for planning: NVML answers a GI profile's CI profiles only
    through a live GPU instance of it, so a profile without one came back with none; it takes
    them from the known model's table (the ids and sizes NVML gives through a live GI of that
    profile). Profiles NVML did describe, and unknown models, stay as they are."""
    model = by_device(device_id)
    if model is None:
        return observed
    table = {p.id: p.ci_profiles for p in model.profiles}
    return tuple(p if p.ci_profiles or p.id not in table else replace(p, ci_profiles=table[p.id])
                 for p in observed)
