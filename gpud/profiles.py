"""Known NVIDIA GPU models and their MIG profile tables, each figure from a named source.

NVML is the source of truth for a GPU it can see. This table serves where NVML cannot be asked
(a GPU on vfio-pci must still have its layout validated against its own model, mig-parted #157)
and is what the simulator serves through its fake NVML. Every row is copied from one real
`nvidia-smi mig -lgip` / `-lgipp` capture of the model (committed under
tests/fixtures/captures/<model>/ with driver version and source) or from NVIDIA's MIG user guide;
docs/hardware/mig-profiles.md names each source. Where no source gives a value the model lists it
in `unknown` and the table holds a placeholder that nothing may present as fact: such a model is
known by name (layouts naming its profiles validate) but the simulator does not offer it.

Memory: `nvidia-smi` prints GiB with two decimals; every MIG memory size seen in a source is a
multiple of 64 MiB (the H200 NVML probe in tests/fixtures/h200; MIG device sizes in the A30 and
H100 NVL captures), and 64 MiB steps are wider than the printed precision, so each printed figure
names exactly one MiB value (`_mib`). NVML semantics behind the tables: docs/hardware/mig-nvml.md.
"""

from __future__ import annotations

from msgspec import Struct
from msgspec.structs import replace

from gpud.model import CiProfile, Gpu, MigProfile, Placement

NVIDIA = 0x10DE

# NVML GI profile *index* constants (nvml.h NVML_GPU_INSTANCE_PROFILE_*): what
# nvmlDeviceGetGpuInstanceProfileInfo takes. The *id* it answers with differs per model (the A30's
# 1-slice profile is id 14, an H100's id 19), so each model maps its own ids (`ModelInfo.gi_index`).
SLICE_INDEX = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}
_SUFFIX_INDEX = {  # (compute slices, name suffix) -> index constant
    (1, "+me"): 0x7, (2, "+me"): 0x8,          # *_REV1: media extensions
    (1, "+gfx"): 0xA, (2, "+gfx"): 0xB, (4, "+gfx"): 0xC, (3, "+gfx"): 0x11,
    (1, "-me"): 0xD, (2, "-me"): 0xE,          # *_NO_ME
    (1, "+me.all"): 0xF, (2, "+me.all"): 0x10,  # *_ALL_ME
}
INDEX_1_SLICE_REV2 = 0x9  # a 1-slice profile with twice the memory slices (1g.20gb on an H100)

# GI profile id -> index constant on the 7-slice Ampere/Hopper GPUs (what `nvidia-smi` orders by).
GI_PROFILE_INDEX: dict[int, int] = {19: 0, 14: 1, 9: 2, 5: 3, 0: 4, 20: 7, 15: 9}

# gpuInstanceId / computeInstanceId NVML reports for a process running outside any MIG instance.
NOT_IN_MIG_INSTANCE = 0xFFFFFFFF

# Compute-instance profile ids (NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE) by compute slices.
CI_PROFILE_ID: dict[int, int] = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}
# CI sizes each GI size can be divided into (4g cannot hold a 3c).
_CI_SPLITS: dict[int, tuple[int, ...]] = {1: (1,), 2: (1, 2), 3: (1, 2, 3), 4: (1, 2, 4), 7: (1, 2, 3, 4, 7)}

WHOLE_GPU = "(GPU)"  # `unknown` key for the GPU's own fields (its total memory)

# Field names a table may mark unknown (MigProfile attribute names, plus "placements" starts).
PROFILE_FIELDS = ("id", "memory_mb", "sms", "instance_count", "placements", "ci_profiles",
                  "copy_engines", "decoders", "encoders", "jpegs", "ofas")


# Compute capability per architecture, from NVIDIA's CUDA GPUs list (developer.nvidia.com/cuda-gpus):
# T4 (Turing) 7.5, A100 8.0, L40S (Ada) 8.9, H100/H200 9.0.
_COMPUTE = {"turing": (7, 5), "ampere": (8, 0), "ada": (8, 9), "hopper": (9, 0)}
# Blackwell boards differ by die (NVIDIA's CUDA GPUs list): B200/GB200 (GB100) 10.0, GB300 10.3,
# RTX PRO 6000 Blackwell Server Edition (GB202) 12.0.
_COMPUTE_BY_MODEL = {"b200": (10, 0), "gb200": (10, 0), "rtx-pro-6000": (12, 0), "gb300": (10, 3)}


class ModelInfo(Struct, frozen=True):
    key: str  # simulator model name: "h200"
    name: str  # NVML name: "NVIDIA H200"
    device: int  # PCI device id
    subsystem_device: int | None  # None: no source names it (the simulator then serves 0)
    memory_mb: int  # NVML total memory in MiB
    arch: str  # "turing" | "ampere" | "hopper" | "blackwell" | "ada"
    profiles: tuple[MigProfile, ...] = ()  # empty: not MIG capable
    audio_device: int | None = None  # PCI id of an HD-audio function on the same card
    source: str = ""  # where the MIG table comes from (capture directory or document)
    unknown: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (profile name, fields no source gives)
    # (profile name, fields whose values are inferred by analogy, not read from a source): the
    # simulator serves them and says so (`gpud-sim create`); docs/hardware/mig-profiles.md lists them
    inferred: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # profile names that differ by driver branch, ids the same: (first driver branch, ((id, name),
    # ...)), the newest branch the driver is at or above applies; `profiles` holds the names the
    # sources give for drivers below every entry. gpud itself takes names from NVML on a real host.
    renamed: tuple[tuple[int, tuple[tuple[int, str], ...]], ...] = ()
    # a Grace superchip's GPU (memory coherent with the CPU over NVLink-C2C): the nvidia driver's
    # CDMM applies to it (docs/hardware/grace.md)
    coherent: bool = False

    def names_for(self, driver_version: str | None) -> dict[int, str]:
        """Profile id -> the name a driver of `driver_version` gives it, where it differs from the
        table's ({} for an unparsable or older version)."""
        try:
            branch = int((driver_version or "").split(".", 1)[0])
        except ValueError:
            return {}
        return next((dict(names) for first, names in sorted(self.renamed, reverse=True) if branch >= first), {})

    @property
    def mig_capable(self) -> bool:
        return bool(self.profiles)

    @property
    def compute_capability(self) -> tuple[int, int]:
        """CUDA compute capability (what nvmlDeviceGetCudaComputeCapability answers): the table's
        Ampere models are GA100 (8.0), its Ada ones AD102 (8.9); Hopper GH100 is 9.0 (the H200
        capture says 9.0)."""
        return _COMPUTE_BY_MODEL.get(self.key) or _COMPUTE[self.arch]

    @property
    def mode_change_needs_reset(self) -> bool:
        """Ampere keeps a MIG mode change pending until a GPU reset; Hopper applies it when idle."""
        return self.arch == "ampere"

    @property
    def complete(self) -> bool:
        """Every value of the MIG table comes from a source: NVML could be answered from it."""
        return not self.unknown

    def unknown_fields(self, profile_name: str) -> tuple[str, ...]:
        return next((fields for name, fields in self.unknown if name == profile_name), ())

    @property
    def gi_index(self) -> dict[int, int]:
        """Profile id -> the NVML index constant that answers it (rows whose id is known)."""
        known = [replace(p, memory_mb=p.memory_mb or _named_mb(p.name)) for p in self.profiles
                 if "id" not in self.unknown_fields(p.name)]
        plain_1g = [p.memory_mb for p in known if p.slices == 1 and _suffix(p.name) == ""]
        return {p.id: index_constant(p, min(plain_1g, default=0)) for p in known}


def _suffix(name: str) -> str:
    return name[name.index("gb") + 2:]


def _named_mb(name: str) -> int:
    """The memory a profile's name states (1g.70gb: 70 GB, in MiB), for comparing rows whose
    memory no source gives (which of two plain 1g profiles is the double-memory one)."""
    figure = name.split(".", 1)[1]
    return int(figure[:figure.index("gb")]) * 10**9 // 2**20


def index_constant(p: MigProfile, smallest_1g_mb: int) -> int:
    """The NVML index constant of a profile, from what its name says (nvml.h's naming): the suffix
    picks the variant; a plain 1-slice profile with more memory than the GPU's smallest plain
    1-slice one is the double-memory REV2 profile (1g.20gb next to 1g.10gb on an H100)."""
    suffix = _suffix(p.name)
    if suffix:
        return _SUFFIX_INDEX[(p.slices, suffix)]
    if p.slices == 1 and p.memory_mb > smallest_1g_mb:
        return INDEX_1_SLICE_REV2
    return SLICE_INDEX[p.slices]


def _mib(gib: str) -> int:
    """`nvidia-smi`'s two-decimal GiB figure -> the one multiple of 64 MiB that prints so."""
    sixteenths = round(float(gib) * 16)
    if f"{sixteenths / 16:.2f}" != gib:
        raise ValueError(f"{gib} GiB is not a printed multiple of 1/16 GiB")
    return sixteenths * 64


def _ci_profiles(gi_slices: int, sms_per_slice: int, gi_sms: int) -> tuple[CiProfile, ...]:
    return tuple(
        CiProfile(
            id=CI_PROFILE_ID[c],
            slices=c,
            instance_count=gi_slices // c,
            sms=gi_sms if c == gi_slices else sms_per_slice * c,
            starts=tuple(range(0, (gi_slices // c) * c, c)),
        )
        for c in _CI_SPLITS[gi_slices]
    )


# One `nvidia-smi mig -lgip` row plus its `-lgipp` line:
# (id, name, GiB, instances, SM, DEC, ENC, CE, JPEG, OFA, starts, memory slices per instance)
Row = tuple[int, str, str, int, int, int, int, int, int, int, tuple[int, ...], int]


def _table(rows: tuple[Row, ...]) -> tuple[MigProfile, ...]:
    """A complete table from capture rows. CI profiles follow the CI-split rule (docs)."""
    plain_1g = [r for r in rows if r[1].startswith("1g.") and "+" not in r[1] and "-" not in r[1]]
    sms_per_slice = min((r[4] for r in plain_1g), default=0)
    out = []
    for pid, name, gib, count, sms, dec, enc, ce, jpeg, ofa, starts, size in rows:
        slices = int(name.split("g.", 1)[0])
        out.append(MigProfile(
            id=pid, name=name, slices=slices, memory_mb=_mib(gib), sms=sms, instance_count=count,
            placements=tuple(Placement(s, size) for s in starts),
            ci_profiles=_ci_profiles(slices, sms_per_slice, sms),
            copy_engines=ce, decoders=dec, encoders=enc, jpegs=jpeg, ofas=ofa))
    return tuple(out)


def _partial(rows: tuple[Row, ...], names_only: tuple[tuple[str, int, int | None], ...],
             cut_off: tuple[tuple[str, tuple[str, ...]], ...] = ()
             ) -> tuple[tuple[MigProfile, ...], tuple[tuple[str, tuple[str, ...]], ...]]:
    """Captured `-lgip` rows (complete but for placements and CI profiles: no `-lgipp` or `-lcip` of
    these models was published) plus profiles known by name, instance count and, where a
    production config passes it to `nvidia-smi mig -cgi`, id only (NVIDIA's default MIG config, GKE's
    MIG partitioner). A name-only profile without an id gets a negative placeholder that no NVML
    call ever sees; on a real GPU NVML's own table replaces this one, and the simulator serves
    such a model only with its own inferred cells (gpud/sim/inferred.py). `cut_off`: fields of a
    captured row the published text does not show (their row values are ignored)."""
    missing = dict(cut_off)
    captured = tuple(replace(p, placements=(), ci_profiles=(), **{f: 0 for f in missing.get(p.name, ())})
                     for p in _table(rows))
    unknown = [(p.name, ("placements", "ci_profiles", *missing.get(p.name, ()))) for p in captured]
    named = []
    for n, (name, count, pid) in enumerate(names_only, start=1):
        named.append(MigProfile(id=-n if pid is None else pid, name=name, slices=int(name.split("g.", 1)[0]),
                                memory_mb=0, sms=0, instance_count=count, placements=()))
        fields = [f for f in PROFILE_FIELDS
                  if not (f == "instance_count" and count) and not (f == "id" and pid is not None)]
        unknown.append((name, tuple(fields)))
    return captured + tuple(named), tuple(unknown)


# --- tables: one real capture per model (tests/fixtures/captures/<key>/README.md names it) -------

_SEVEN_SLICE_STARTS = {19: (0, 1, 2, 3, 4, 5, 6), 20: (0, 1, 2, 3, 4, 5, 6), 15: (0, 2, 4, 6),
                       14: (0, 2, 4), 9: (0, 4), 5: (0,), 0: (0,)}
_SEVEN_SLICE_SIZE = {19: 1, 20: 1, 15: 2, 14: 2, 9: 4, 5: 4, 0: 8}


def _seven(pid: int, name: str, gib: str, count: int, sms: int, dec: int, enc: int, ce: int, jpeg: int,
           ofa: int) -> Row:
    """A 7-slice GPU's row; its `-lgipp` line is the one every 7-slice capture shows for that id."""
    return (pid, name, gib, count, sms, dec, enc, ce, jpeg, ofa, _SEVEN_SLICE_STARTS[pid], _SEVEN_SLICE_SIZE[pid])


# (instances, SM, DEC, ENC, CE, JPEG, OFA) per profile id: the same in every capture of a family
# (each model's rows are still compared with its own capture: tests/sim/test_fidelity_captures.py).
Engines = tuple[int, int, int, int, int, int, int]
_GA100: dict[int, Engines] = {19: (7, 14, 0, 0, 1, 0, 0), 20: (1, 14, 1, 0, 1, 1, 1), 15: (4, 14, 1, 0, 1, 0, 0),
                              14: (3, 28, 1, 0, 2, 0, 0), 9: (2, 42, 2, 0, 3, 0, 0), 5: (1, 56, 2, 0, 4, 0, 0),
                              0: (1, 98, 5, 0, 7, 1, 1)}
_HOPPER: dict[int, Engines] = {19: (7, 16, 1, 0, 1, 1, 0), 20: (1, 16, 1, 0, 1, 1, 1), 15: (4, 26, 1, 0, 1, 1, 0),
                               14: (3, 32, 2, 0, 2, 2, 0), 9: (2, 60, 3, 0, 3, 3, 0), 5: (1, 64, 4, 0, 4, 4, 0),
                               0: (1, 132, 7, 0, 8, 7, 1)}
_SEVEN_IDS = (19, 20, 15, 14, 9, 5, 0)  # the -lgip order of every 7-slice capture


def _family(engines: dict[int, Engines], *sized: tuple[str, str], ids: tuple[int, ...] = _SEVEN_IDS) -> tuple[Row, ...]:
    """A 7-slice model's rows: its own (name, GiB) per profile id in `ids`, its family's engines."""
    return tuple(_seven(pid, name, gib, *engines[pid]) for pid, (name, gib) in zip(ids, sized, strict=True))


# A100-SXM4-40GB: NVIDIA MIG user guide, "Getting started with MIG" (-lgip and -lgipp).
A100_40GB = _table(_family(_GA100,
    ("1g.5gb", "4.75"), ("1g.5gb+me", "4.75"), ("1g.10gb", "9.62"), ("2g.10gb", "9.62"), ("3g.20gb", "19.50"),
    ("4g.20gb", "19.50"), ("7g.40gb", "39.25")))
# A100 80GB PCIe, driver 515.86.01: this driver has no 1g.20gb (id 15) profile.
A100_80GB = _table(_family(_GA100,
    ("1g.10gb", "9.50"), ("1g.10gb+me", "9.50"), ("2g.20gb", "19.50"), ("3g.40gb", "39.25"), ("4g.40gb", "39.25"),
    ("7g.80gb", "79.00"), ids=(19, 20, 14, 9, 5, 0)))
# H100 80GB HBM3 (driver not stated by the capture).
H100_80GB = _table(_family(_HOPPER,
    ("1g.10gb", "9.75"), ("1g.10gb+me", "9.75"), ("1g.20gb", "19.62"), ("2g.20gb", "19.62"), ("3g.40gb", "39.50"),
    ("4g.40gb", "39.50"), ("7g.80gb", "79.25")))
# H100 NVL, driver 560.35.03.
H100_NVL = _table(_family(_HOPPER,
    ("1g.12gb", "10.75"), ("1g.12gb+me", "10.75"), ("1g.24gb", "21.62"), ("2g.24gb", "21.62"), ("3g.47gb", "46.38"),
    ("4g.47gb", "46.38"), ("7g.94gb", "93.12")))
# H200 141GB, driver 580.159.04: this project's own read-only capture (tests/fixtures/h200).
H200 = _table(_family(_HOPPER,
    ("1g.18gb", "16.00"), ("1g.18gb+me", "16.00"), ("1g.35gb", "32.50"), ("2g.35gb", "32.50"), ("3g.71gb", "69.75"),
    ("4g.71gb", "69.75"), ("7g.141gb", "140.00")))
# A30 24GB (4 memory slices, 4 compute slices); a pre-R525 driver: no 2g.12gb+me yet.
A30 = _table((
    (14, "1g.6gb", "5.81", 4, 14, 1, 0, 1, 0, 0, (0, 1, 2, 3), 1),
    (21, "1g.6gb+me", "5.81", 1, 14, 1, 0, 1, 1, 1, (0, 1, 2, 3), 1),
    (5, "2g.12gb", "11.69", 2, 28, 2, 0, 2, 0, 0, (0, 2), 2),
    (0, "4g.24gb", "23.50", 1, 56, 4, 0, 4, 1, 1, (0,), 4),
))
# RTX PRO 6000 Blackwell Server Edition 96GB, driver 610.43.02 (12 memory slices, 4 compute slices).
RTX_PRO_6000 = _table((
    (14, "1g.24gb", "23.62", 4, 46, 1, 1, 1, 1, 0, (0, 3, 6, 9), 3),
    (21, "1g.24gb+me", "23.62", 1, 46, 1, 1, 1, 1, 1, (0, 3, 6, 9), 3),
    (47, "1g.24gb+gfx", "23.62", 4, 46, 1, 1, 1, 1, 0, (0, 3, 6, 9), 3),
    (65, "1g.24gb+me.all", "23.62", 1, 46, 4, 4, 1, 4, 1, (0, 3, 6, 9), 3),
    (67, "1g.24gb-me", "23.62", 4, 46, 0, 0, 1, 0, 0, (0, 3, 6, 9), 3),
    (5, "2g.48gb", "47.38", 2, 94, 2, 2, 2, 2, 0, (0, 6), 6),
    (35, "2g.48gb+gfx", "47.38", 2, 94, 2, 2, 2, 2, 0, (0, 6), 6),
    (64, "2g.48gb+me.all", "47.38", 1, 94, 4, 4, 2, 4, 1, (0, 6), 6),
    (66, "2g.48gb-me", "47.38", 2, 94, 0, 0, 2, 0, 0, (0, 6), 6),
    (0, "4g.96gb", "95.12", 1, 188, 4, 4, 4, 4, 1, (0,), 12),
    (32, "4g.96gb+gfx", "95.12", 1, 188, 4, 4, 4, 4, 1, (0,), 12),
))

# Partial tables: the first four rows of a real -lgip capture (tests/fixtures/captures/<key>/: no
# fuller copy and no -lgipp or -lcip of these models was found), plus profiles NVIDIA's default MIG
# config names for the model with no readable row. Instance counts of name-only rows: NVIDIA's
# default MIG config (`all-<profile>` counts; the MIG user guide's B200 table agrees). Ids of the
# B200's and GB200's name-only rows: GKE's MIG partitioner (GoogleCloudPlatform/
# container-engine-accelerators partition_gpu.go, which passes them to `nvidia-smi mig -cgi` on A4
# and A4X nodes); the GH200 144G's have no source. Drivers: not stated by any of the captures.
# B200: mig-parted#187 (March 2025, 1g.23gb 20.50 GiB); #166 (January 2025) printed 22.00 GiB for
# the same rows, so the driver changed the figure: the table is #187's alone.
B200, _B200_UNKNOWN = _partial((
    _seven(19, "1g.23gb", "20.50", 7, 18, 1, 0, 2, 1, 0),
    _seven(20, "1g.23gb+me", "20.50", 1, 18, 1, 0, 2, 1, 1),
    _seven(15, "1g.45gb", "44.25", 4, 30, 1, 0, 2, 1, 0),
    _seven(14, "2g.45gb", "44.25", 3, 36, 2, 0, 4, 2, 0),
), (("3g.90gb", 2, 9), ("4g.90gb", 1, 5), ("7g.180gb", 1, 0)))
GB200, _GB200_UNKNOWN = _partial((
    _seven(19, "1g.23gb", "22.00", 7, 18, 1, 0, 2, 1, 0),
    _seven(20, "1g.23gb+me", "22.00", 1, 18, 1, 0, 2, 1, 1),
    _seven(15, "1g.47gb", "45.50", 4, 32, 1, 0, 2, 1, 0),
    _seven(14, "2g.47gb", "45.50", 3, 38, 2, 0, 0, 0, 0),  # its CE/JPEG/OFA line is cut off
), (("3g.93gb", 2, 9), ("4g.93gb", 1, 5), ("7g.186gb", 1, 0)),
    cut_off=(("2g.47gb", ("copy_engines", "jpegs", "ofas")),))
GH200_144GB, _GH200_144GB_UNKNOWN = _partial(_family(
    _HOPPER, ("1g.18gb", "17.50"), ("1g.18gb+me", "17.50"), ("1g.36gb", "35.25"), ("2g.36gb", "35.25"),
    ids=(19, 20, 15, 14)), (("3g.72gb", 2, None), ("4g.72gb", 1, None), ("7g.144gb", 1, None)))
# GH200 96GB (GH200 480GB), driver 550.54.15: a complete public -lgip (tests/fixtures/captures/
# gh200-96gb); no -lgipp or -lcip, so its placements and CI profiles are inferred (_INFERRED_7).
GH200_96GB = _table(_family(_HOPPER,
    ("1g.12gb", "11.00"), ("1g.12gb+me", "11.00"), ("1g.24gb", "23.00"), ("2g.24gb", "23.00"), ("3g.48gb", "46.50"),
    ("4g.48gb", "46.50"), ("7g.96gb", "93.00")))


def _inferred_7(profiles: tuple[MigProfile, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Every profile's placements and CI profiles, inferred: the 7-slice placements every published
    -lgipp shows, and the CI-split rule (docs/hardware/mig-profiles.md)."""
    return tuple((p.name, ("placements", "ci_profiles")) for p in profiles)

# GB300 (Grace Blackwell Ultra, 0x31C2): no -lgip of it was published. Ids: NVIDIA's DGX Station
# GB300 MIG playbook (NVIDIA/dgx-spark-playbooks nvidia/station-mig and the mig-configure skill),
# which also says the names depend on the driver, the ids not: R59x names below, R61x `_GB300_R61X`.
# Counts: NVIDIA's default MIG config (mig-parted config-default.yaml, GB300 added in 75449116).
# Memory, SMs, engines, placements, CI profiles and the GPU's total: no source.
GB300, _GB300_UNKNOWN = _partial((), (
    ("1g.35gb", 7, 19), ("1g.35gb+me", 1, 20), ("1g.70gb", 4, 15), ("2g.70gb", 3, 14),
    ("3g.139gb", 2, 9), ("4g.139gb", 1, 5), ("7g.278gb", 1, 0)))
_GB300_R61X = ((19, "1g.31gb"), (20, "1g.31gb+me"), (9, "3g.126gb"), (5, "4g.126gb"), (0, "7g.251gb"))

_CAPTURES = "tests/fixtures/captures/"

MODELS: dict[str, ModelInfo] = {
    m.key: m
    for m in (
        ModelInfo("a100-40gb", "NVIDIA A100-SXM4-40GB", 0x20B0, 0x134F, 40960, "ampere", A100_40GB,
                  source=_CAPTURES + "a100-40gb"),
        ModelInfo("a100-pcie-40gb", "NVIDIA A100-PCIE-40GB", 0x20F1, 0x145F, 40960, "ampere", A100_40GB,
                  source=_CAPTURES + "a100-40gb (the SXM4 card's capture: the same GA100 and 40 GB; no capture "
                                     "of the PCIe card; here for its vGPU types, A100-*)"),
        ModelInfo("a100-80gb", "NVIDIA A100 80GB PCIe", 0x20B5, None, 81920, "ampere", A100_80GB,
                  source=_CAPTURES + "a100-80gb"),
        ModelInfo("h100-80gb", "NVIDIA H100 80GB HBM3", 0x2330, 0x16C1, 81559, "hopper", H100_80GB,
                  source=_CAPTURES + "h100-80gb"),
        ModelInfo("h100-nvl", "NVIDIA H100 NVL", 0x2321, 0x1839, 95830, "hopper", H100_NVL,
                  source=_CAPTURES + "h100-nvl"),
        ModelInfo("h200", "NVIDIA H200", 0x2335, 0x18BF, 143771, "hopper", H200, source="tests/fixtures/h200"),
        ModelInfo("a30", "NVIDIA A30", 0x20B7, None, 24576, "ampere", A30, source=_CAPTURES + "a30"),
        ModelInfo("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell Server Edition", 0x2BB5, None, 97887,
                  "blackwell", RTX_PRO_6000, source=_CAPTURES + "rtx-pro-6000"),
        # total memory: a B200 with MIG on, plain nvidia-smi, "107MiB / 183359MiB" (gpu-operator#2155)
        ModelInfo("b200", "NVIDIA B200", 0x2901, None, 183359, "blackwell", B200,
                  source=_CAPTURES + "b200: github.com/NVIDIA/mig-parted/pull/187 (-lgip, first four rows; "
                                     "#166's earlier listing differs in the 1g memory)",
                  unknown=_B200_UNKNOWN),
        ModelInfo("gb200", "NVIDIA GB200", 0x2941, None, 0, "blackwell", GB200,
                  source=_CAPTURES + "gb200: github.com/NVIDIA/mig-parted/issues/227 (-lgip of a production "
                                     "board, first four rows)",
                  unknown=_GB200_UNKNOWN + ((WHOLE_GPU, ("memory_mb",)),), coherent=True),
        ModelInfo("gh200-144gb", "NVIDIA GH200 144G HBM3e", 0x2348, None, 0, "hopper", GH200_144GB,
                  source=_CAPTURES + "gh200-144gb: github.com/NVIDIA/mig-parted/pull/139 (-lgip, first four rows)",
                  unknown=_GH200_144GB_UNKNOWN + ((WHOLE_GPU, ("memory_mb",)),), coherent=True),
        ModelInfo("gh200-96gb", "NVIDIA GH200 480GB", 0x2342, None, 97871, "hopper", GH200_96GB,
                  source=_CAPTURES + "gh200-96gb: github.com/kf-cuanschutz/NVIDIA_Grace_Hopper_benchmarking_logs_ "
                                     "(-lgip, all seven rows, driver 550.54.15)",
                  inferred=_inferred_7(GH200_96GB) + ((WHOLE_GPU, ("memory_mb",)),), coherent=True),
        ModelInfo("gb300", "NVIDIA GB300", 0x31C2, None, 0, "blackwell", GB300,
                  source="github.com/NVIDIA/dgx-spark-playbooks nvidia/station-mig (ids, names by driver; "
                         "no -lgip); mig-parted config-default.yaml (counts)",
                  unknown=_GB300_UNKNOWN + ((WHOLE_GPU, ("memory_mb",)),), renamed=((610, _GB300_R61X),),
                  coherent=True),
        ModelInfo("l40s", "NVIDIA L40S", 0x26B9, 0x1851, 46068, "ada"),
        ModelInfo("t4", "Tesla T4", 0x1EB8, 0x12A2, 15360, "turing"),
        ModelInfo("rtx6000-ada", "NVIDIA RTX 6000 Ada Generation", 0x26B1, 0x16A1, 49140, "ada",
                  audio_device=0x22BA),
    )
}


# PCI device id -> the first model of MODELS with it (asked for every GPU of every host read)
_BY_DEVICE: dict[int, ModelInfo] = {}
for _m in MODELS.values():
    _BY_DEVICE.setdefault(_m.device, _m)


def by_device(device_id: int) -> ModelInfo | None:
    return _BY_DEVICE.get(device_id)


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
    kept = _WITH_CI.get((id(observed), device_id))
    if kept is not None and kept[0] is observed:
        return kept[1]
    model = by_device(device_id)
    if model is None:
        return observed
    table = {p.id: p.ci_profiles for p in model.profiles}
    out = tuple(p if p.ci_profiles or p.id not in table else replace(p, ci_profiles=table[p.id]) for p in observed)
    if len(_WITH_CI) >= _WITH_CI_KEPT:
        _WITH_CI.clear()
    _WITH_CI[(id(observed), device_id)] = (observed, out)
    return out


# (id of a GPU's observed table, device id) -> (that table, the result): a GPU's table is read once
# per NVML session and kept (host/nvidia/nvml.py), so each layout resolution asks with the same
# object for every GPU; the table is held here, so its id is not reused while kept
_WITH_CI: dict[tuple[int, int], tuple[tuple[MigProfile, ...], tuple[MigProfile, ...]]] = {}
_WITH_CI_KEPT = 1024
