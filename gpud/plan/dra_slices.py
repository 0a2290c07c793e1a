"""The node's DRA ResourceSlices (resource.k8s.io/v1) from what gpud observed. Pure: no I/O.

One pool per node (named after the node), every device once, published by gpud's kubelet plugin
(gpud.engine.dra) so that the real kube-scheduler allocates ResourceClaims from it:

* whole GPUs (`type: gpu`): container GPUs with MIG off;
* static MIG devices (`type: mig`): the MIG devices the layout made, one per compute instance;
* passthrough GPUs (`type: vfio`): a GPU the layout put on vfio-pci, one device per GPU whose
  prepare hands the VM the whole IOMMU group (its companions are listed in `iommuGroupMembers`);
* vGPUs (`type: vgpu`): the vGPU devices a vm-vgpu layout created, as KubeVirt's DRA support
  (VEP 10) takes them: an mdev by its `mDevUUID`, a vendor-VFIO vGPU by its VF's
  `resource.kubernetes.io/pciBusID` (the GPU's own address is then `parentPciBusID`);
* dynamic GPUs (`mig-devices: dynamic`) as partitionable devices (KEP-4815): one counter set per GPU
  with one counter per memory slice, one per profile whose instance count bounds it (the single
  `+me` profile holding the media engines), compute slices, multiprocessors and memory;
  every profile at every placement is a device consuming its placement's memory slices and its
  share of the rest, the whole GPU a device consuming everything. The scheduler then can never
  allocate two overlapping placements, nor the whole GPU beside a slice. Engines are published as
  capacities, not counters: NVML's per-profile engine figures do not add up (an RTX PRO 6000's
  `1g.24gb+me.all` reports all four decoders beside plain 1g's reporting one each), and the
  exclusive ones are bounded by their profile's instance count.

Attribute names are those of NVIDIA's DRA driver (k8s-dra-driver-gpu: `type`, `uuid`,
`parentUUID`, `profile`, `productName`, `architecture`, `cudaComputeCapability`, `driverVersion`,
`cudaDriverVersion`; its `brand` is not, gpud does not read NVML's brand)
plus the standard `resource.kubernetes.io/pciBusID` and `resource.kubernetes.io/pcieRoot`
(k8s.io/dynamic-resource-allocation deviceattribute; the root complex is read from sysfs by
gpud.host.kernel.sysfs.pcie_root), so CEL selectors written for NVIDIA's driver carry over and a claim
can ask for a GPU and a NIC under one root complex (`matchAttribute`).

Limits honoured (k8s.io/api resource/v1 types.go, v0.36.3): devices and sharedCounters live in
separate slices of the pool; at most 8 counter sets per slice and 32 counters per set; at most 64
devices per slice once devices consume counters or carry taints (128 otherwise); names are DNS labels.

Capacity used outside Kubernetes is never offered: a placement overlapping a foreign instance (a
lease made through gpudctl, an instance nobody leased) and the whole GPU beside it are left out.
A GPU that is missing or unhealthy (stuck, gone) publishes nothing. A GPU the driver reported an
Xid for keeps its devices, each carrying the device taint `<driver>/xid=<code>` (NoSchedule, or
None for an application's error), as NVIDIA's DRA driver taints them (docs/dra.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from msgspec import Struct, field

from gpud.layout.desired import DesiredGpu
from gpud.layout.resolve import gpu_profiles
from gpud.model import ComputeInstance, Gpu, GpuInstance, MigProfile, Placement
from gpud.pci import is_vfio
from gpud.profiles import by_device

DEFAULT_DRIVER = "gpu.gpud.io"  # gpud's own driver name; `--dra-driver gpu.nvidia.com` is NVIDIA's
NVIDIA_DRIVER = "gpu.nvidia.com"
STANDARD = "resource.kubernetes.io/"
# what KubeVirt (VEP 10, GPUsWithDRA) reads for a mediated device; not standardised yet
# (kubernetes/kubernetes#135552)
MDEV_UUID = "mDevUUID"

MAX_COUNTER_SETS = 8  # ResourceSliceMaxCounterSets
MAX_COUNTERS = 32  # ResourceSliceMaxCountersPerCounterSet
MAX_DEVICES = 128  # ResourceSliceMaxDevices
MAX_DEVICES_CONSUMING = 64  # ResourceSliceMaxDevicesWithAdvancedFeatures

# (MigProfile attribute, capacity name): engines as NVIDIA's driver names capacities
_ENGINES = (("copy_engines", "copyEngines"), ("decoders", "decoders"), ("encoders", "encoders"),
            ("jpegs", "jpegEngines"), ("ofas", "ofaEngines"))


class DraInputs(Struct, frozen=True):
    """What gpud observed and decided, as the slice builder needs it."""

    node: str
    gpus: tuple[Gpu, ...]
    desired: Mapping[str, DesiredGpu] = field(default_factory=dict)  # PCI -> what the layout asks
    driver: str = DEFAULT_DRIVER
    driver_version: str | None = None  # NVML: "550.54.15"
    cuda_version: int | None = None  # NVML's nvmlSystemGetCudaDriverVersion: 12080 for CUDA 12.8
    unhealthy: frozenset[str] = frozenset()  # PCI addresses of GPUs not to offer (XID, lost)
    # PCI -> placements held by something other than a DRA claim (leases from gpudctl, foreign
    # instances): never offered
    foreign: Mapping[str, tuple[Placement, ...]] = field(default_factory=dict)
    pcie_roots: Mapping[str, str] = field(default_factory=dict)  # PCI -> "pci0000:15" (sysfs)
    # PCI -> device taints (KEP-5055) every device of that GPU carries: an Xid the driver reported
    taints: Mapping[str, tuple[dict, ...]] = field(default_factory=dict)
    generation: int = 1


class SliceDevice(Struct, frozen=True):
    """One published device and what prepare needs to know about it (not published)."""

    name: str
    kind: str  # gpu | mig | vfio | vgpu
    pci: str  # the GPU's PCI address
    profile: str | None = None  # MIG profile name for mig devices (static or dynamic)
    placement: Placement | None = None  # dynamic MIG: the placement this device stands for
    mig_uuid: str | None = None  # static MIG: the MIG device's UUID
    dynamic: bool = False
    group: tuple[str, ...] = ()  # vfio: every function of the IOMMU group; vgpu: its VF
    vgpu_uuid: str | None = None


class DraSlices(Struct, frozen=True):
    slices: list[dict]  # ResourceSlice objects, as the API takes them
    devices: dict[str, SliceDevice]  # device name -> what it is

    def attributes(self, name: str) -> dict:
        """The attributes the named device is published with ({} for none of this pool)."""
        for s in self.slices:
            for d in s["spec"].get("devices") or ():
                if d["name"] == name:
                    return dict(d["attributes"])
        return {}


def device_name(*parts: object) -> str:
    """A DNS label from parts: `gpu-0-mig-1g-10gb-me-3`."""
    text = "-".join(str(p) for p in parts).lower()
    text = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    return text[:63].rstrip("-")


def semver(version: str | None) -> str | None:
    """A driver version as a semantic version ("570.124.06" -> "570.124.6"); None if not numeric."""
    if not version:
        return None
    parts = version.split(".")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        return None
    nums = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(nums)


def _s(v: str) -> dict:
    return {"string": v}


def _common(gpu: Gpu, inputs: DraInputs) -> dict[str, dict]:
    model = by_device(gpu.function.device)
    attrs: dict[str, dict] = {STANDARD + "pciBusID": _s(gpu.pci)}
    root = inputs.pcie_roots.get(gpu.pci)
    if root:
        attrs[STANDARD + "pcieRoot"] = _s(root)
    name = gpu.nvml.name if gpu.nvml is not None else (model.name if model is not None else None)
    if name:
        attrs["productName"] = _s(name)
    if model is not None:
        attrs["architecture"] = _s(model.arch)
    cc = gpu.nvml.compute_capability if gpu.nvml is not None and gpu.nvml.compute_capability else (
        model.compute_capability if model is not None else None)
    if cc:
        attrs["cudaComputeCapability"] = {"version": f"{cc[0]}.{cc[1]}.0"}
    v = semver(inputs.driver_version)
    if v:
        attrs["driverVersion"] = {"version": v}
    if inputs.cuda_version:
        major, minor = divmod(inputs.cuda_version, 1000)
        attrs["cudaDriverVersion"] = {"version": f"{major}.{minor // 10}.0"}
    attrs["index"] = {"int": gpu.index}
    return attrs


def _mi(mb: int) -> dict:
    return {"value": f"{mb}Mi"}


def _profile_capacity(p: MigProfile) -> dict[str, dict]:
    cap = {"memory": _mi(p.memory_mb), "multiprocessors": {"value": str(p.sms)}}
    for attr, cname in _ENGINES:
        cap[cname] = {"value": str(getattr(p, attr))}
    return cap


def _instances_counter(p: MigProfile) -> str | None:
    """The counter bounding how many instances of `p` may exist at once, where the profile's
    instance count is below its placements (the one `1g.10gb+me` per H100 holding the media
    extensions): NVML refuses the next one with INSUFFICIENT_RESOURCES."""
    return device_name(p.name, "instances") if p.instance_count < len(p.placements) else None


def _totals(profiles: Sequence[MigProfile], memory_mb: int) -> dict[str, int]:
    """A dynamic GPU's counter set: one counter per memory slice (placements overlap through them),
    one per profile whose instance count bounds it, and the compute slices, multiprocessors and
    memory that any set of instances that fits could use in sum."""
    nslices = max((pl.start + pl.size for p in profiles for pl in p.placements), default=0)
    out = {f"memory-slice-{i}": 1 for i in range(nslices)}
    for p in profiles:
        c = _instances_counter(p)
        if c:
            out[c] = p.instance_count
    out["compute-slices"] = max((p.slices for p in profiles), default=0)
    out["multiprocessors"] = max((max(p.sms, p.sms * p.instance_count) for p in profiles), default=0)
    out["memory"] = max(memory_mb, max((p.memory_mb for p in profiles), default=0))
    return out


def _consumes(p: MigProfile, pl: Placement) -> dict[str, int]:
    out = {f"memory-slice-{i}": 1 for i in range(pl.start, pl.start + pl.size)}
    c = _instances_counter(p)
    if c:
        out[c] = 1
    out["compute-slices"] = p.slices
    out["multiprocessors"] = p.sms
    out["memory"] = p.memory_mb
    return out


def _counters(values: Mapping[str, int]) -> dict[str, dict]:
    return {k: ({"value": f"{v}Mi"} if k == "memory" else {"value": str(v)}) for k, v in values.items() if v}


def _workload(gpu: Gpu, want: DesiredGpu | None) -> str:
    if want is not None:
        return want.workload
    return "vm-passthrough" if is_vfio(gpu.function.driver) else "container"


def _static_mig(gpu: Gpu, base: dict, out: list[tuple[dict, SliceDevice]]) -> None:
    assert gpu.nvml is not None
    for gi in gpu.nvml.instances:
        p = gpu.nvml.profile(gi.profile_id)
        for ci in gi.cis:
            out.append(_static_mig_device(gpu, base, gi, ci, p))


def _static_mig_device(gpu: Gpu, base: dict, gi: GpuInstance, ci: ComputeInstance,
                       p: MigProfile | None) -> tuple[dict, SliceDevice]:
    pname = p.name if p is not None else f"profile-{gi.profile_id}"
    if p is not None and ci.slices != p.slices:
        pname = f"{ci.slices}c.{pname}"
    name = device_name("gpu", gpu.index, "mig", gi.id, ci.id)
    attrs = dict(base, type=_s("mig"), profile=_s(pname), uuid=_s(ci.uuid))
    if gpu.uuid:
        attrs["parentUUID"] = _s(gpu.uuid)
    attrs["placementStart"] = {"int": gi.placement.start}
    attrs["placementSize"] = {"int": gi.placement.size}
    dev = {"name": name, "attributes": attrs}
    if p is not None:
        dev["capacity"] = _profile_capacity(p)
    return dev, SliceDevice(name, "mig", gpu.pci, profile=pname, placement=gi.placement, mig_uuid=ci.uuid)


def _dynamic(gpu: Gpu, base: dict, foreign: tuple[Placement, ...], counter_set: str,
             profiles: Sequence[MigProfile], memory_mb: int,
             out: list[tuple[dict, SliceDevice]]) -> dict:
    """Devices of one dynamic GPU; returns its counter set."""
    totals = _totals(profiles, memory_mb)
    taken = frozenset(s for pl in foreign for s in pl.slices)
    if not taken:
        attrs = dict(base, type=_s("gpu"))
        if gpu.uuid:
            attrs["uuid"] = _s(gpu.uuid)
        out.append(({"name": device_name("gpu", gpu.index), "attributes": attrs,
                     "capacity": {"memory": _mi(memory_mb)},
                     "consumesCounters": [{"counterSet": counter_set, "counters": _counters(totals)}]},
                    SliceDevice(device_name("gpu", gpu.index), "gpu", gpu.pci, dynamic=True)))
    for p in sorted(profiles, key=lambda p: (p.slices, p.memory_mb, p.name)):
        for pl in p.placements:
            if pl.slices & taken:
                continue
            name = device_name("gpu", gpu.index, "mig", p.name, pl.start)
            attrs = dict(base, type=_s("mig"), profile=_s(p.name),
                         placementStart={"int": pl.start}, placementSize={"int": pl.size})
            if gpu.uuid:
                attrs["parentUUID"] = _s(gpu.uuid)
            out.append(({"name": name, "attributes": attrs, "capacity": _profile_capacity(p),
                         "consumesCounters": [{"counterSet": counter_set, "counters": _counters(_consumes(p, pl))}]},
                        SliceDevice(name, "mig", gpu.pci, profile=p.name, placement=pl, dynamic=True)))
    return {"name": counter_set, "counters": _counters(totals)}


def gpu_devices(gpu: Gpu, inputs: DraInputs) -> tuple[list[tuple[dict, SliceDevice]], dict | None]:
    """The devices one GPU publishes, and its counter set when it is dynamic."""
    if not gpu.present or gpu.pci in inputs.unhealthy:
        return [], None
    want = inputs.desired.get(gpu.pci)
    workload = _workload(gpu, want)
    base = _common(gpu, inputs)
    out: list[tuple[dict, SliceDevice]] = []
    if workload == "vm-passthrough":
        if not is_vfio(gpu.function.driver):
            return [], None  # the layout has not moved it yet: nothing a VM could take
        group = (gpu.pci, *(c.address for c in gpu.companions))
        attrs = dict(base, type=_s("vfio"))
        if gpu.uuid:
            attrs["uuid"] = _s(gpu.uuid)
        if gpu.function.iommu_group is not None:
            attrs["iommuGroup"] = {"int": gpu.function.iommu_group}
        attrs["iommuGroupMembers"] = {"int": len(group)}
        name = device_name("gpu", gpu.index, "vfio")
        out.append(({"name": name, "attributes": attrs}, SliceDevice(name, "vfio", gpu.pci, group=group)))
        return out, None
    if gpu.nvml is None:
        return [], None
    if workload == "vm-vgpu":
        for k, v in enumerate(gpu.vgpu.devices if gpu.vgpu is not None else ()):
            if v.holders:
                continue  # a running VM has it
            name = device_name("gpu", gpu.index, "vgpu", k)
            attrs = dict(base, type=_s("vgpu"), profile=_s(v.type))
            if gpu.uuid:
                attrs["parentUUID"] = _s(gpu.uuid)
            if v.uuid:  # an mdev: KubeVirt hands the VM the mediated device by this attribute
                attrs["uuid"] = _s(v.uuid)
                attrs[MDEV_UUID] = _s(v.uuid)
            if v.vf:  # a vendor-VFIO vGPU: the VM is given the VF, KubeVirt takes it from pciBusID
                attrs[STANDARD + "pciBusID"] = _s(v.vf)
                attrs["parentPciBusID"] = _s(gpu.pci)
            out.append(({"name": name, "attributes": attrs},
                        SliceDevice(name, "vgpu", gpu.pci, profile=v.type, vgpu_uuid=v.uuid,
                                    group=(v.vf,) if v.vf else ())))
        return out, None
    if want is not None and want.dynamic:
        # MIG mode may be off until the first lease (policy.lease-mig-mode: follow): the GPU's own
        # table, else its model's
        profiles = gpu_profiles(gpu)
        if not profiles:
            return [], None
        cs = device_name("gpu", gpu.index, "counters")
        counter_set = _dynamic(gpu, base, inputs.foreign.get(gpu.pci, ()), cs, profiles, gpu.nvml.memory_mb, out)
        return out, counter_set
    if gpu.nvml.mig_mode == 1:
        _static_mig(gpu, base, out)
        return out, None
    attrs = dict(base, type=_s("gpu"), uuid=_s(gpu.nvml.uuid))
    name = device_name("gpu", gpu.index)
    out.append(({"name": name, "attributes": attrs, "capacity": {"memory": _mi(gpu.nvml.memory_mb)}},
                SliceDevice(name, "gpu", gpu.pci)))
    return out, None


def slice_name(node: str, driver: str, k: int) -> str:
    base = f"{node}-{driver}".lower().replace(".", "-")
    return f"{base[:240]}-{k}"


def build_slices(inputs: DraInputs) -> DraSlices:
    """The pool's ResourceSlices: counter slices first (8 sets each), then device slices, a GPU's
    devices kept together in one slice (up to 64 with counters, 128 without)."""
    counter_sets: list[dict] = []
    groups: list[list[tuple[dict, SliceDevice]]] = []
    for gpu in sorted(inputs.gpus, key=lambda g: g.index):
        devs, cs = gpu_devices(gpu, inputs)
        taints = inputs.taints.get(gpu.pci)
        if taints:
            devs = [(dict(d, taints=[dict(t) for t in taints]), sd) for d, sd in devs]
        if cs is not None:
            counter_sets.append(cs)
        if devs:
            groups.append(devs)
    specs: list[dict] = []
    for i in range(0, len(counter_sets), MAX_COUNTER_SETS):
        specs.append({"sharedCounters": counter_sets[i:i + MAX_COUNTER_SETS]})
    current: list[dict] = []
    consuming = False
    for devs in groups:
        # counters and taints are both "advanced features": 64 devices per slice, not 128
        group_consumes = any("consumesCounters" in d or "taints" in d for d, _ in devs)
        for chunk_start in range(0, len(devs), MAX_DEVICES_CONSUMING):
            chunk = [d for d, _ in devs[chunk_start:chunk_start + MAX_DEVICES_CONSUMING]]
            limit = MAX_DEVICES_CONSUMING if (consuming or group_consumes) else MAX_DEVICES
            if current and len(current) + len(chunk) > limit:
                specs.append({"devices": current})
                current, consuming = [], False
            current.extend(chunk)
            consuming = consuming or group_consumes
    if current:
        specs.append({"devices": current})
    slices = []
    for k, extra in enumerate(specs):
        spec = {"driver": inputs.driver, "nodeName": inputs.node,
                "pool": {"name": inputs.node, "generation": inputs.generation, "resourceSliceCount": len(specs)},
                **extra}
        slices.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                       "metadata": {"name": slice_name(inputs.node, inputs.driver, k)}, "spec": spec})
    devices = {sd.name: sd for devs in groups for _, sd in devs}
    return DraSlices(slices, devices)
