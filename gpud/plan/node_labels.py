"""Node labels from observed state, and what Kubernetes' device plugins will advertise from it.

Two consumers, one source of truth (the hardware as gpud last observed it):

* **Labels** a cluster selects nodes on. The GFD set reproduces gpu-feature-discovery's names and
  value formats (NVIDIA/k8s-device-plugin internal/lm: resource.go, mig-strategy.go, nvml.go), so
  node selectors written for GFD keep working when gpud writes them instead; gpud's own labels
  say which layout is in force, how far it got, and how many GPUs serve each workload.
* **Resources** the device plugins will advertise once (re)started: k8s-device-plugin's
  `nvidia.com/gpu` and `nvidia.com/mig-<profile>` (internal/rm/rm.go, device_map.go), and
  kubevirt-gpu-device-plugin's `nvidia.com/<PCI NAME>` for functions on vfio-pci.

Where GFD's answer depends on Go's random map order (a node with two GPU models: which model's
`gpu.product` wins), gpud is deterministic: the lowest-index GPU's model. `gfd.timestamp` and
`gpu.machine` are not written: the first would change the file on every pass, the second reads
DMI, which is not observed state.

Pure: no I/O; the caller passes what it observed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from msgspec import Struct

from gpud import profiles
from gpud.kubevirt_names import kubevirt_name, selector, vf_resources, vgpu_resource
from gpud.layout.names import device_name
from gpud.layout.schema import WORKLOADS
from gpud.model import CiProfile, Gpu, GpuInstance, MigProfile, NvmlGpu
from gpud.pci import is_vfio
from gpud.vgpu_types import printed_name

PREFIX = "nvidia.com/"
GPU_RESOURCE = "nvidia.com/gpu"
STATES = ("success", "pending", "failed", "rebooting")  # nvidia.com/mig.config.state's values
STRATEGIES = ("mixed", "single")

# gpud's own labels
LAYOUT_LABEL = "nvidia.com/gpud.layout"
STATE_LABEL = "nvidia.com/gpud.layout.state"
WORKLOAD_COUNT_LABEL = "nvidia.com/gpud.workload.{}.count"

# PCI class codes as nvpci spells them (go-nvlib pkg/nvpci): GFD's gpu.mode
_CLASS_3D = 0x030200
_CLASS_VGA = 0x030000

# Kubernetes label syntax (apimachinery validation: qualified name, label value).
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class LabelInputs(Struct, frozen=True):
    """What gpud observed, and what it is doing about it."""

    gpus: tuple[Gpu, ...]
    driver_version: str | None = None  # NVML: "550.54.15"
    cuda_driver_version: int | None = None  # NVML: 12040 (= CUDA 12.4)
    compute: Mapping[str, tuple[int, int]] = {}  # PCI -> CUDA compute capability, from NVML
    workloads: Mapping[str, str] = {}  # PCI -> workload the layout in force gives the GPU
    layout: str | None = None  # name of the layout in force
    state: str = "success"  # success | pending | failed | rebooting
    mig_strategy: str = "mixed"  # as the cluster's device plugin and GFD are configured


class NodeLabels(Struct, frozen=True):
    labels: dict[str, str]
    warnings: tuple[str, ...] = ()


class Advertised(Struct, frozen=True):
    """What the device plugins will advertise (resource -> count), and why one would refuse."""

    resources: dict[str, int]  # k8s-device-plugin: nvidia.com/gpu, nvidia.com/mig-1g.10gb
    # VM resources: kubevirt-gpu-device-plugin's (nvidia.com/GH100_H100_SXM5_80GB, mdev vGPUs) and
    # KubeVirt's own PCI plugin's for VF vGPUs (v1.9, under the entry `gpudctl passthrough` prints)
    sandbox: dict[str, int]
    problems: tuple[str, ...] = ()  # the device plugin would fail to start, with its reason


# --- small helpers -------------------------------------------------------------------------------

def sanitise(text: str) -> str:
    """GFD's sanitise(): drop all but [A-Za-z0-9-_. ], then join the words with "-"."""
    return "-".join(re.sub(r"[^A-Za-z0-9\-_. ]", "", text).split())


def product(*parts: str) -> str:
    """GFD's getProductName(): sanitised non-empty parts joined with "-"."""
    return "-".join(sanitise(p) for p in parts if p)


def arch_family(major: int, minor: int) -> str:
    """GFD's getArchFamily()."""
    table = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper",
             10: "blackwell", 12: "blackwell", 13: "rubin"}
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return table.get(major, "undefined")


def label_problem(key: str, value: str) -> str | None:
    """Why Kubernetes would refuse this label (None: it is valid)."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return f"label {key!r}: prefix is not a DNS subdomain"
    if len(name) > 63 or not _NAME.fullmatch(name):
        return f"label {key!r}: name must be 63 characters or fewer, alphanumeric at both ends, with - _ . inside"
    if len(value) > 63 or not _VALUE.fullmatch(value):
        return (f"label {key}={value!r}: value must be 63 characters or fewer, empty or alphanumeric "
                "at both ends, with - _ . inside")
    return None


def _visible(gpus: Sequence[Gpu]) -> list[tuple[Gpu, NvmlGpu]]:
    """GPUs GFD and the device plugin can see: those NVML reports (bound to nvidia)."""
    return [(g, g.nvml) for g in sorted(gpus, key=lambda g: g.index) if g.nvml is not None and g.present]


def _mig_enabled(nv: NvmlGpu) -> bool:
    return nv.mig_mode == 1  # IsMigEnabled() reads the current mode, not the pending one


def _compute(gpu: Gpu, inputs: LabelInputs) -> tuple[int, int] | None:
    if gpu.pci in inputs.compute:
        return inputs.compute[gpu.pci]
    known = profiles.by_device(gpu.function.device)  # NVML did not say: the known model's
    return known.compute_capability if known is not None else None


class MigDevice(Struct, frozen=True):
    """One MIG device (a compute instance) with the attributes NVML gives its handle."""

    gpu: Gpu
    name: str  # profile string as go-nvlib prints it: "1g.10gb", "1g.10gb+me", "1c.3g.40gb"
    gi_profile: MigProfile
    ci_slices: int
    multiprocessors: int

    @property
    def resource_suffix(self) -> str:
        return self.name.replace("+", ".")  # GetName(): "+" -> "."

    @property
    def spans_gi(self) -> bool:
        return self.ci_slices == self.gi_profile.slices

    def attributes(self) -> dict[str, int]:
        """nvmlDeviceGetAttributes of the MIG device, as GFD names them (nvml-mig-device.go)."""
        p = self.gi_profile
        return {
            "memory": p.memory_mb,
            "multiprocessors": self.multiprocessors,
            "slices.gi": p.slices,
            "slices.ci": self.ci_slices,
            "engines.copy": p.copy_engines,
            "engines.decoder": p.decoders,
            "engines.encoder": p.encoders,
            "engines.jpeg": p.jpegs,
            "engines.ofa": p.ofas,
        }


def mig_devices(gpus: Sequence[Gpu]) -> list[MigDevice]:
    """Every MIG device of every MIG-enabled GPU NVML sees, in GPU index then placement order."""
    out: list[MigDevice] = []
    for gpu, nv in _visible(gpus):
        if _mig_enabled(nv):
            out += _gpu_mig_devices(gpu, nv)
    return out


# GPU record's id -> (the record, what was worked out of it), one table per kind of result.
# Records are frozen and a re-read keeps an unchanged GPU's record as the same object
# (gpud.engine.observe.discovery.keep_unchanged), so a GPU's MIG devices and its share of the
# mixed strategy's resources are worked out once per record, not once per observation of the whole
# host (at 64 GPUs with 7 each, every GPU step of an apply asked for all 448 on the event loop).
# Bounded: the records of a few observations (each entry keeps its record alive until cleared).
_DEVICES_OF: dict[int, tuple[Gpu, Any]] = {}
_MIXED_OF: dict[int, tuple[Gpu, Any]] = {}
_RECORDS_KEPT = 512
_T = TypeVar("_T")


def _per_record(table: dict[int, tuple[Gpu, Any]], gpu: Gpu, make: Callable[[], _T]) -> _T:
    kept = table.get(id(gpu))
    if kept is not None and kept[0] is gpu:
        return kept[1]
    value = make()
    if len(table) >= _RECORDS_KEPT:
        table.clear()
    table[id(gpu)] = (gpu, value)
    return value


def _mixed_part(gpu: Gpu, devices: tuple[MigDevice, ...]) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...]]:
    """One GPU's share of the mixed strategy's resources (each MIG device as its resource), and the
    refusals its devices cause, in placement order."""
    def make() -> tuple[tuple[tuple[str, int], ...], tuple[str, ...]]:
        counts: dict[str, int] = {}
        problems: list[str] = []
        for d in devices:
            if not d.spans_gi:
                problems.append(f"MIG device {d.name} on GPU {d.gpu.index} ({d.gpu.pci}): its compute instance "
                                "does not span its GPU instance, so no resource matches it and the device plugin "
                                "(mig-strategy=mixed) refuses to start")
                continue
            key = f"{PREFIX}mig-{d.resource_suffix}"
            counts[key] = counts.get(key, 0) + 1
        return tuple(counts.items()), tuple(problems)

    return _per_record(_MIXED_OF, gpu, make)


def _gpu_mig_devices(gpu: Gpu, nv: NvmlGpu) -> tuple[MigDevice, ...]:
    def make() -> tuple[MigDevice, ...]:
        out = []
        for gi in sorted(nv.instances, key=lambda g: (g.placement.start, g.id)):
            prof = nv.profile(gi.profile_id)
            if prof is None:
                continue
            for ci in sorted(gi.cis, key=lambda c: c.id):
                out.append(MigDevice(gpu=gpu, name=device_name(prof, ci.slices), gi_profile=prof,
                                     ci_slices=ci.slices, multiprocessors=_ci_sms(prof, gi, ci.slices)))
        return tuple(out)

    return _per_record(_DEVICES_OF, gpu, make)


def _ci_sms(prof: MigProfile, gi: GpuInstance, slices: int) -> int:
    ci: CiProfile | None = next((c for c in prof.ci_profiles if c.slices == slices), None)
    if ci is not None:
        return ci.sms
    return prof.sms if slices >= prof.slices else 0


# --- GFD's label set -----------------------------------------------------------------------------

def _full_gpu_labels(inputs: LabelInputs) -> dict[str, str]:
    """newGPULabelers(): product/count/replicas/sharing/memory/architecture of nvidia.com/gpu."""
    visible = _visible(inputs.gpus)
    counts: dict[str, int] = {}
    first: dict[tuple[bool, str], tuple[Gpu, NvmlGpu]] = {}
    for gpu, nv in visible:
        counts[nv.name] = counts.get(nv.name, 0) + 1
        first.setdefault((_mig_enabled(nv), nv.name), (gpu, nv))
    labels: dict[str, str] = {}
    # MIG-enabled models first, full GPUs override them; within each, the lowest index wins.
    for mig in (True, False):
        group = [(k, g) for k, g in first.items() if k[0] == mig]
        for (_, name), (gpu, nv) in sorted(group, key=lambda kv: -kv[1][0].index):
            labels[GPU_RESOURCE + ".product"] = product(name)
            labels[GPU_RESOURCE + ".count"] = str(counts[name])
            labels[GPU_RESOURCE + ".replicas"] = "0" if mig else "1"
            labels[GPU_RESOURCE + ".sharing-strategy"] = "none"
            if nv.memory_mb:
                labels[GPU_RESOURCE + ".memory"] = str(nv.memory_mb)
            cc = _compute(gpu, inputs)
            if cc is not None and cc[0] != 0:
                labels[GPU_RESOURCE + ".family"] = arch_family(*cc)
                labels[GPU_RESOURCE + ".compute.major"] = str(cc[0])
                labels[GPU_RESOURCE + ".compute.minor"] = str(cc[1])
    return labels


def _version_labels(inputs: LabelInputs) -> dict[str, str]:
    """newVersionLabeler(): driver and CUDA versions, the deprecated names too."""
    labels: dict[str, str] = {}
    v = inputs.driver_version
    parts = v.split(".") if v else []
    if v and 2 <= len(parts) <= 3:
        major, minor, rev = parts[0], parts[1], parts[2] if len(parts) > 2 else ""
        labels.update({
            PREFIX + "cuda.driver.major": major, PREFIX + "cuda.driver.minor": minor,
            PREFIX + "cuda.driver.rev": rev,
            PREFIX + "cuda.driver-version.major": major, PREFIX + "cuda.driver-version.minor": minor,
            PREFIX + "cuda.driver-version.revision": rev, PREFIX + "cuda.driver-version.full": v,
        })
    if inputs.cuda_driver_version:
        cmaj, cmin = inputs.cuda_driver_version // 1000, (inputs.cuda_driver_version % 1000) // 10
        labels.update({
            PREFIX + "cuda.runtime.major": str(cmaj), PREFIX + "cuda.runtime.minor": str(cmin),
            PREFIX + "cuda.runtime-version.major": str(cmaj), PREFIX + "cuda.runtime-version.minor": str(cmin),
            PREFIX + "cuda.runtime-version.full": f"{cmaj}.{cmin}",
        })
    return labels


def _mode_label(visible: list[tuple[Gpu, NvmlGpu]]) -> str:
    """newGPUModeLabeler(): compute / graphics when every GPU has that class, else unknown."""
    classes = {g.function.class_code for g, _ in visible}
    if len(classes) != 1:
        return "unknown"
    return {_CLASS_3D: "compute", _CLASS_VGA: "graphics"}.get(classes.pop(), "unknown")


def _mig_resource_labels(resource: str, dev: MigDevice, count: int, replicas: int = 1) -> dict[str, str]:
    """NewMIGResourceLabeler(): base labels + the MIG device's attributes under `resource`."""
    nv = dev.gpu.nvml
    assert nv is not None  # MIG devices are listed from the GPUs NVML reads
    labels = {
        resource + ".product": product(nv.name, "MIG", dev.resource_suffix),
        resource + ".count": str(count),
        resource + ".replicas": str(replicas),
        resource + ".sharing-strategy": "none",
    }
    for k, v in dev.attributes().items():
        labels[f"{resource}.{k}"] = str(v)
    return labels


def _mixed_labels(devices: list[MigDevice]) -> dict[str, str]:
    first: dict[str, MigDevice] = {}
    counts: dict[str, int] = {}
    for d in devices:
        first.setdefault(d.resource_suffix, d)
        counts[d.resource_suffix] = counts.get(d.resource_suffix, 0) + 1
    labels: dict[str, str] = {}
    for name, d in first.items():
        labels.update(_mig_resource_labels(f"{PREFIX}mig-{name}", d, counts[name]))
    return labels


def _single_labels(visible: list[tuple[Gpu, NvmlGpu]], devices: list[MigDevice]) -> dict[str, str]:
    """newMigStrategySingleLabeler(): one uniform MIG profile over every GPU, or INVALID."""
    enabled = [(g, nv) for g, nv in visible if _mig_enabled(nv)]
    if not enabled:
        return {}
    with_devices = {d.gpu.pci for d in devices}
    names = {d.resource_suffix for d in devices}
    if any(g.pci not in with_devices for g, _ in enabled) or len(enabled) != len(visible) or len(names) != 1:
        return {
            GPU_RESOURCE + ".product": product(enabled[0][1].name, "MIG", "INVALID"),
            GPU_RESOURCE + ".count": "0", GPU_RESOURCE + ".replicas": "0",
            GPU_RESOURCE + ".sharing-strategy": "", GPU_RESOURCE + ".memory": "0",
        }
    return _mig_resource_labels(GPU_RESOURCE, devices[0], len(devices))


def gfd_labels(inputs: LabelInputs) -> dict[str, str]:
    """The labels gpu-feature-discovery would write for this node (empty when NVML sees no GPU)."""
    if inputs.mig_strategy not in STRATEGIES:
        raise ValueError(f"mig strategy {inputs.mig_strategy!r}: expected one of {', '.join(STRATEGIES)}")
    visible = _visible(inputs.gpus)
    if not visible:
        return {}
    labels = _version_labels(inputs)
    labels[PREFIX + "mig.capable"] = str(any(nv.mig_capable for _, nv in visible)).lower()
    labels[PREFIX + "mps.capable"] = "false"
    labels.update(_full_gpu_labels(inputs))
    labels[PREFIX + "gpu.mode"] = _mode_label(visible)
    labels[PREFIX + "mig.strategy"] = inputs.mig_strategy
    devices = mig_devices(inputs.gpus)
    if inputs.mig_strategy == "mixed":
        labels.update(_mixed_labels(devices))
    else:
        labels.update(_single_labels(visible, devices))
    labels[PREFIX + "vgpu.present"] = "false"  # a bare-metal host's GPUs are physical, never vGPUs
    return dict(sorted(labels.items()))


# --- gpud's own labels ---------------------------------------------------------------------------

def serving_workload(gpu: Gpu, workloads: Mapping[str, str]) -> str | None:
    """The workload a GPU serves right now: the layout's, once its driver agrees; an unmanaged GPU
    by its driver. None while it is between drivers (or on none)."""
    driver = gpu.function.driver
    wanted = workloads.get(gpu.pci) or ("vm-passthrough" if is_vfio(driver) else {"nvidia": "container"}.get(driver or ""))
    if wanted == "vm-passthrough":
        return wanted if is_vfio(driver) and gpu.present else None
    ok = {"container": "nvidia", "vm-vgpu": "nvidia"}.get(wanted or "")
    return wanted if ok is not None and driver == ok and gpu.present else None


def gpud_labels(inputs: LabelInputs) -> NodeLabels:
    if inputs.state not in STATES:
        raise ValueError(f"layout state {inputs.state!r}: expected one of {', '.join(STATES)}")
    labels: dict[str, str] = {}
    warnings: list[str] = []
    if inputs.layout:
        problem = label_problem(LAYOUT_LABEL, inputs.layout)
        if problem is None:
            labels[LAYOUT_LABEL] = inputs.layout
        else:
            warnings.append(f"layout name not written as a label: {problem}")
    labels[STATE_LABEL] = inputs.state
    counts = dict.fromkeys(WORKLOADS, 0)
    for gpu in inputs.gpus:
        w = serving_workload(gpu, inputs.workloads)
        if w is not None:
            counts[w] += 1
    for w, n in counts.items():
        labels[WORKLOAD_COUNT_LABEL.format(w)] = str(n)
    return NodeLabels(dict(sorted(labels.items())), tuple(warnings))


def node_labels(inputs: LabelInputs, *, gfd: bool = True) -> NodeLabels:
    """gpud's labels, plus GFD's set when `gfd` (off for clusters that keep running GFD, so two
    writers never fight over one label). Labels Kubernetes would refuse are left out, with why."""
    own = gpud_labels(inputs)
    labels = dict(own.labels)
    warnings = list(own.warnings)
    if gfd:
        for k, v in gfd_labels(inputs).items():
            problem = label_problem(k, v)
            if problem is None:
                labels[k] = v
            else:
                warnings.append(problem)
    return NodeLabels(dict(sorted(labels.items())), tuple(warnings))


# --- what the device plugins will advertise ------------------------------------------------------

def advertised(gpus: Sequence[Gpu], *, mig_strategy: str = "mixed") -> Advertised:
    """k8s-device-plugin's resources for the GPUs on nvidia, kubevirt-gpu-device-plugin's for the
    NVIDIA functions on vfio-pci and the mdev vGPUs (one resource per type), KubeVirt's own PCI
    plugin's for the VF vGPUs (one resource per PCI id: gpud.kubevirt_names.vf_resources)."""
    if mig_strategy not in STRATEGIES:
        raise ValueError(f"mig strategy {mig_strategy!r}: expected one of {', '.join(STRATEGIES)}")
    visible = _visible(gpus)
    devices = mig_devices(gpus)
    resources: dict[str, int] = {}
    problems: list[str] = []
    full = [g for g, nv in visible if not _mig_enabled(nv)]
    enabled = [g for g, nv in visible if _mig_enabled(nv)]
    with_devices = {d.gpu.pci for d in devices}
    for g in enabled:
        if g.pci not in with_devices:
            if mig_strategy == "single":
                problems.append(f"GPU {g.index} ({g.pci}) has MIG enabled but no MIG device: "
                                "the device plugin (mig-strategy=single) refuses to start")
    if full:
        resources[GPU_RESOURCE] = len(full)
    if mig_strategy == "mixed":
        for g, nv in visible:
            if not _mig_enabled(nv):
                continue
            counts, refusals = _mixed_part(g, _gpu_mig_devices(g, nv))
            for key, n in counts:
                resources[key] = resources.get(key, 0) + n
            problems += refusals
    elif devices:
        if full:
            problems.append("GPUs with MIG enabled and disabled on one node: the device plugin "
                            "(mig-strategy=single) refuses to start")
        if len({(d.gi_profile.id, d.gi_profile.memory_mb, d.ci_slices, d.multiprocessors) for d in devices}) > 1:
            problems.append("more than one MIG device type on the node: the device plugin "
                            "(mig-strategy=single) refuses to start")
        resources[GPU_RESOURCE] = resources.get(GPU_RESOURCE, 0) + len(devices)
    sandbox: dict[str, int] = {}
    vfs = vf_resources((g.function.device, d) for g in gpus for d in (g.vgpu.devices if g.vgpu is not None else ()))
    for g in sorted(gpus, key=lambda g: g.index):
        for f in (g.function, *g.companions):
            if f.vendor == profiles.NVIDIA and is_vfio(f.driver):
                name = kubevirt_name(f.device).resource
                sandbox[name] = sandbox.get(name, 0) + 1
        for vd in g.vgpu.devices if g.vgpu is not None else ():
            if vd.uuid is not None:  # an mdev: the plugin lists /sys/bus/mdev/devices (a VF vGPU: not)
                name = vgpu_resource(printed_name(g.function.device, vd.type))
                sandbox[name] = sandbox.get(name, 0) + 1
            elif vd.vf is not None:  # KubeVirt's own plugin, once permitted as gpud suggests
                name = vfs[selector(g.function.device, vd)][0]
                sandbox[name] = sandbox.get(name, 0) + 1
    return Advertised(dict(sorted(resources.items())), dict(sorted(sandbox.items())), tuple(problems))
