"""vGPU types: how their names are built, and the types of the GPU models gpud knows.

A vGPU type name is syntax first (`L40S-12Q`: board, framebuffer GB, series; `A100-1-5C`: board,
GPU-instance slices, GB, series, optional MIG attribute). The grammar is the one NVIDIA's
vgpu-device-manager parses (pkg/types/vgpu_type.go), so its configs mean the same here: a type with
a slice count is MIG-backed and needs the GPU instance profile `<G>g.<GB>gb` (`ME` -> `+me`, `NOME`
-> `-me`, `MEALL` -> `+me.all`, `GFX` -> `+gfx`); the others are time-sliced.

A name as the driver prints it carries a product prefix of one or more words (`GRID T4-1Q`,
`NVIDIA L40S-12Q`, `NVIDIA RTX Pro 6000 Blackwell DC-1-24Q`); the type is its last
whitespace-separated token, the way NVIDIA's tools key it (go-nvlib pkg/nvmdev/nvmdev.go
`parseMdevTypeName`, vendored in vgpu-device-manager v0.5.0: "NVIDIA RTX Pro 6000 Blackwell DC-48C"
-> "DC-48C"; vgpu-device-manager's vendor-VFIO work, pkg/vgpu/vfio/types.go `shortName()`).

The table (`MODELS`) is what gpud checks a layout against where the driver cannot be asked (the
simulator serves it; on a host, sysfs shows the offered types and wins). Every row names its source
in `docs/vgpu.md`; where no public source gives a value the field is None and the simulator says it
invented one (`SYNTHETIC_ID_BASE`). Counts are the per-GPU maxima of NVIDIA's vGPU documentation as
vgpu-device-manager's examples/config-example.yaml spells them (one config per type with the count
that fills one GPU). A MIG-backed type's GPU instance holds `per_gi` vGPUs of it: one on Ampere and
Hopper, several on the RTX PRO 6000 Blackwell (DC-1-3Q: 8 on one 1g.24gb+gfx instance).
"""

from __future__ import annotations

import re

from msgspec import Struct

_TIME_SLICED = re.compile(r"(?P<gpu>[A-Z0-9]+(?:-[a-zA-Z]+)*)-(?P<gb>0|[1-9][0-9]*)(?P<series>[ABCQ])")
_MIG_BACKED = re.compile(
    r"(?P<gpu>[A-Z0-9]+)-(?P<g>[1-9])-(?P<gb>0|[1-9][0-9]*)(?P<series>[ABCQ])(?P<attr>ME|NOME|MEALL|GFX)?")
MIG_ATTRIBUTES = {"ME": "+me", "NOME": "-me", "MEALL": "+me.all", "GFX": "+gfx"}

# Ids of types the sources do not number are made up by the simulator from here on (never on a host).
SYNTHETIC_ID_BASE = 60000


class VgpuName(Struct, frozen=True):
    """A parsed type name. `slices` is None for a time-sliced type."""

    board: str  # "L40S", "A100", "H200X", "RTX6000-Ada"
    framebuffer_gb: int
    series: str  # A | B | C | Q
    slices: int | None = None
    attribute: str = ""  # ME | NOME | MEALL | GFX

    @property
    def mig_backed(self) -> bool:
        return self.slices is not None

    @property
    def mig_profile(self) -> str | None:
        """The GPU-instance profile this type needs (`1g.5gb`, `1g.5gb+me`), None if time-sliced."""
        if self.slices is None:
            return None
        return f"{self.slices}g.{self.framebuffer_gb}gb{MIG_ATTRIBUTES.get(self.attribute, '')}"


def strip_prefix(name: str) -> str:
    """The bare type name: the last whitespace-separated token of what the driver prints
    (`GRID T4-1Q` -> `T4-1Q`, `NVIDIA RTX Pro 6000 Blackwell DC-1-24Q` -> `DC-1-24Q`), as
    go-nvlib's parseMdevTypeName keys it, when that token is an NVIDIA type name. Any other name
    stays whole: another vendor's mdev parent (the kernel's mtty sample: `Dual port serial`,
    `Single port serial`) would otherwise fold two types into one."""
    words = name.split()
    if len(words) > 1 and (_TIME_SLICED.fullmatch(words[-1]) or _MIG_BACKED.fullmatch(words[-1])):
        return words[-1]
    return " ".join(words) if words else name


def parse_vgpu_name(name: str) -> VgpuName | None:
    """A type name (prefix allowed) -> its parts, or None when it is not one (vgpu-device-manager's
    grammar: time-sliced first, then MIG-backed)."""
    bare = strip_prefix(name.strip())
    m = _TIME_SLICED.fullmatch(bare)
    if m is not None:
        return VgpuName(m["gpu"], int(m["gb"]), m["series"])
    m = _MIG_BACKED.fullmatch(bare)
    if m is not None:
        return VgpuName(m["gpu"], int(m["gb"]), m["series"], slices=int(m["g"]), attribute=m["attr"] or "")
    return None


class VgpuType(Struct, frozen=True):
    """One vGPU type of one GPU model."""

    name: str  # bare name: "L40S-12Q"
    max_instances: int  # per physical GPU (MIG-backed: per_gi x the GI profile's instance count)
    vfio_id: int | None = None  # id in `creatable_vgpu_types`; None where no public source numbers it
    mdev_id: int | None = None  # the N of `mdev_supported_types/nvidia-N`; None likewise
    per_gi: int = 1  # MIG-backed: vGPUs of this type one GPU instance holds
    gi_profile: str | None = None  # MIG-backed: the GI profile it sits on, where the name does not say it

    @property
    def parsed(self) -> VgpuName:
        parsed = parse_vgpu_name(self.name)
        assert parsed is not None, self.name
        return parsed

    @property
    def mig_backed(self) -> bool:
        return self.parsed.mig_backed

    @property
    def mig_profile(self) -> str | None:
        """The GPU-instance profile a vGPU of this type needs (None: time-sliced)."""
        return self.gi_profile or self.parsed.mig_profile


class VgpuModel(Struct, frozen=True):
    """The vGPU side of one GPU model (keyed by PCI device id in MODELS)."""

    device: int  # PCI device id of the physical function (VFs report the same id)
    prefix: str  # what the driver prints before type names: "NVIDIA ", "GRID ", "NVIDIA RTX Pro 6000 Blackwell "
    sriov: bool  # has SR-IOV virtual functions (vendor VFIO; on mdev the VFs are the parents)
    total_vfs: int  # sriov_totalvfs (0 when not SR-IOV)
    types: tuple[VgpuType, ...]
    mdev: bool = True  # the driver can also offer the mdev interface (False: vendor-specific VFIO only)

    def find(self, name: str) -> VgpuType | None:
        """The type a layout's name means: the bare name, or vgpu-device-manager's spelling with the
        GI attribute appended where the driver's name lacks it (`DC-1-24QGFX` is `DC-1-24Q` on a
        `+gfx` instance; vgpu-device-manager v0.5.0 pkg/vgpu/config.go strips the suffix the same way)."""
        bare = strip_prefix(name.strip())
        found = next((t for t in self.types if t.name == bare), None)
        if found is not None:
            return found
        for attribute, suffix in MIG_ATTRIBUTES.items():
            if bare.endswith(attribute):
                t = next((t for t in self.types if t.name == bare[:-len(attribute)]), None)
                if t is not None and t.gi_profile is not None and t.gi_profile.endswith(suffix):
                    return t
        return None

    def names(self) -> list[str]:
        return [t.name for t in self.types]


def _series(board: str, sizes: dict[int, int], series: str, ids: dict[int, int] | None = None,
            mdev_ids: dict[int, int] | None = None) -> list[VgpuType]:
    """Time-sliced types `<board>-<gb><series>` with their per-GPU maxima."""
    ids = ids or {}
    mdev_ids = mdev_ids or {}
    return [VgpuType(f"{board}-{gb}{series}", n, ids.get(gb), mdev_ids.get(gb)) for gb, n in sizes.items()]


def _mig(board: str, rows: dict[str, int], ids: dict[str, int] | None = None) -> list[VgpuType]:
    """MIG-backed types `<board>-<rest>` -> per-GPU maxima, one vGPU per GPU instance."""
    ids = ids or {}
    return [VgpuType(f"{board}-{rest}", n, ids.get(rest)) for rest, n in rows.items()]


def _mig_shared(board: str, rows: dict[str, int], instances: dict[int, tuple[str, int]], series: str) -> list[VgpuType]:
    """MIG-backed types of a GPU whose instances hold several vGPUs each: `<G>-<GB>` -> per-GPU
    maximum, for each series letter. `instances`: slices -> (the GI profile the types of that size
    sit on, its instances per GPU); one instance holds the per-GPU maximum over that count."""
    out = []
    for rest, n in rows.items():
        profile, count = instances[int(rest.split("-", 1)[0])]
        per_gi, left = divmod(n, count)
        assert per_gi and not left, (board, rest, n, count)
        out += [VgpuType(f"{board}-{rest}{s}", n, per_gi=per_gi, gi_profile=profile) for s in series]
    return out


# L40S (48 GB, Ada, SR-IOV). Counts: config-example.yaml; 1B: hypeman PR #52 shows 32 free on a
# fresh card. Ids: 1145 (1B) from kubevirt#17642; 1147 (1Q), 1148 (2Q), 1159 (48Q) from a test
# fixture of a real host's creatable list (hypeman lib/devices).
_L40S = (
    [VgpuType("L40S-1B", 32, 1145)]
    + _series("L40S", {1: 32, 2: 24, 3: 16, 4: 12, 6: 8, 8: 6, 12: 4, 16: 3, 24: 2, 48: 1}, "Q",
              ids={1: 1147, 2: 1148, 48: 1159})
    + _series("L40S", {4: 12, 6: 8, 8: 6, 12: 4, 16: 3, 24: 2, 48: 1}, "C")
)

# A100 40GB: the PCIe card's types are `A100-*`, the HGX (SXM4) card's `A100X-*`; same counts.
_A100_MIG = {"1-5C": 7, "1-5CME": 1, "1-10C": 4, "2-10C": 3, "3-20C": 2, "4-20C": 1, "7-40C": 1}
_A100_TS = {4: 10, 5: 8, 8: 5, 10: 4, 20: 2, 40: 1}

# H200 SXM 141GB: `H200X-*`. Id 1414 (H200X-1-18C) from gpu-operator#2594.
_H200X_MIG = {"1-18C": 7, "1-18CME": 1, "1-35C": 4, "2-35C": 3, "3-71C": 2, "4-71C": 1, "7-141C": 1}
_H200X_TS = {4: 32, 7: 20, 8: 16, 14: 10, 17: 8, 28: 5, 35: 4, 70: 2, 141: 1}

# T4 (16 GB, Turing, no SR-IOV: mdev on the physical function). Ids nvidia-222..234, 252, 319..321
# from an `ls` of a real T4's mdev_supported_types (OpenStack cyborg vGPU spec) and the type table
# of the vgpu_unlock wiki; counts from config-example.yaml (Q, C), B/A from the same size rule.
_T4 = (
    [VgpuType("T4-1B", 16, mdev_id=222), VgpuType("T4-2B", 8, mdev_id=223)]
    + _series("T4", {1: 16, 2: 8, 4: 4, 8: 2, 16: 1}, "Q", mdev_ids={1: 230, 2: 231, 4: 232, 8: 233, 16: 234})
    + _series("T4", {4: 4, 8: 2, 16: 1}, "C", mdev_ids={4: 319, 8: 320, 16: 321})
)

# RTX PRO 6000 Blackwell Server Edition 96 GB (GB202; 4 MIG compute slices), vendor-specific VFIO.
# Names as the driver prints them: "NVIDIA RTX Pro 6000 Blackwell DC-1-24Q" (bigstack-oss/cubecos#312,
# a real host's listings). Per-GPU maxima: vgpu-device-manager v0.5.0 examples/config-example.yaml
# (the DC-* entries added for vGPU 19.0, commit b61f3842); they equal 96 GB (time-sliced) or the
# GPU instance's framebuffer (MIG-backed) divided by the type's. The A-series types are those the
# cubecos#312 listings name, with the count of the Q type of the same size (its time-sliced listing
# shows DC-4A, DC-6A, DC-8A with the counts of DC-4Q, DC-6Q, DC-8Q). MIG-backed types sit only on
# `+gfx` instances (vgpu-device-manager v0.5.0 pkg/vgpu/config.go; cubecos#1223: profile 47,
# 1g.24gb+gfx, carries them); instances per GPU from the MIG capture (tests/fixtures/captures/
# rtx-pro-6000): 1g.24gb+gfx 4, 2g.48gb+gfx 2, 4g.96gb+gfx 1. Ids 1521-1528: cubecos#312.
_DC_IDS = {"4Q": 1521, "4A": 1522, "6Q": 1523, "6A": 1524, "8Q": 1525, "8A": 1526, "8C": 1527, "12Q": 1528}
_DC_TS = {3: 32, 4: 24, 6: 16, 8: 12, 12: 8, 16: 6, 24: 4, 32: 3, 48: 2, 96: 1}
_DC_GIS = {1: ("1g.24gb+gfx", 4), 2: ("2g.48gb+gfx", 2), 4: ("4g.96gb+gfx", 1)}
_RTX_PRO_6000 = (
    _series("DC", _DC_TS, "Q", ids={gb: _DC_IDS[f"{gb}Q"] for gb in (4, 6, 8, 12)})
    + _series("DC", {4: 24, 6: 16, 8: 12}, "A", ids={gb: _DC_IDS[f"{gb}A"] for gb in (4, 6, 8)})
    + _series("DC", {gb: n for gb, n in _DC_TS.items() if gb >= 8}, "C", ids={8: _DC_IDS["8C"]})
    + _mig_shared("DC", {"1-2": 48}, _DC_GIS, "Q")
    + _mig_shared("DC", {"1-3": 32, "1-4": 24, "1-6": 16}, _DC_GIS, "QA")
    + _mig_shared("DC", {"1-8": 12, "1-12": 8, "1-24": 4, "2-12": 8, "2-16": 6, "2-24": 4, "2-48": 2,
                         "4-24": 4}, _DC_GIS, "QAC")
    + _mig_shared("DC", {"4-32": 3, "4-48": 2, "4-96": 1}, _DC_GIS, "QC")
)

MODELS: dict[int, VgpuModel] = {
    m.device: m
    for m in (
        VgpuModel(0x26B9, "NVIDIA ", True, 32, tuple(_L40S)),
        VgpuModel(0x20F1, "NVIDIA ", True, 16,
                  tuple(_series("A100", _A100_TS, "C") + _mig("A100", _A100_MIG))),
        VgpuModel(0x20B0, "NVIDIA ", True, 16,
                  tuple(_series("A100X", _A100_TS, "C") + _mig("A100X", _A100_MIG))),
        VgpuModel(0x2335, "NVIDIA ", True, 32,
                  tuple(_series("H200X", _H200X_TS, "C") + _mig("H200X", _H200X_MIG, {"1-18C": 1414}))),
        VgpuModel(0x1EB8, "GRID ", False, 0, tuple(_T4)),
        VgpuModel(0x2BB5, "NVIDIA RTX Pro 6000 Blackwell ", True, 48, tuple(_RTX_PRO_6000), mdev=False),
    )
}


def by_device(device_id: int) -> VgpuModel | None:
    return MODELS.get(device_id)


def mig_need(name: str, model: VgpuModel | None) -> tuple[str, int] | None:
    """(GI profile, vGPUs one instance of it holds) for a MIG-backed type; None when time-sliced or
    not a type name. The model's table decides where it knows the type (the RTX PRO 6000's DC-1-3Q
    sits eight to a 1g.24gb+gfx instance); else the name's grammar, one vGPU per instance."""
    known = model.find(name) if model is not None else None
    if known is not None:
        profile = known.mig_profile
        return (profile, known.per_gi) if profile is not None else None
    parsed = parse_vgpu_name(name)
    if parsed is None or parsed.mig_profile is None:
        return None
    return parsed.mig_profile, 1


def printed_name(device_id: int, vtype: str) -> str:
    """The type name as the driver prints it in an mdev type's `name` (`GRID ` on Turing and older,
    else `NVIDIA `): what KubeVirt's mdevNameSelector matches and the device plugin names."""
    model = by_device(device_id)
    return f"{model.prefix if model else 'NVIDIA '}{vtype}"
