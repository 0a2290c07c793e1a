"""Observed state of a GPU host: plain immutable records shared by every layer.

Adapters (`gpud.host`) produce these, the pure core (`gpud.layout`, `gpud.plan`) consumes them.
Nothing here does I/O, so the planner and the validator can be tested on hand-made hosts.
Identifiers are the ones that stay stable: PCI address for a GPU, profile *id* (never the NVML
profile index) for a MIG profile, MIG UUID for an instance.
"""

from __future__ import annotations

from msgspec import Struct


class Placement(Struct, frozen=True, order=True):
    """Where a GPU instance sits, in memory-slice units (NVML's `{start}:size`)."""

    start: int
    size: int

    @property
    def slices(self) -> frozenset[int]:
        return frozenset(range(self.start, self.start + self.size))


class CiProfile(Struct, frozen=True):
    """A compute-instance profile inside one GI profile (what `1c.3g.40gb` names)."""

    id: int  # NVML compute instance profile id, what nvmlGpuInstanceCreateComputeInstance takes
    slices: int  # compute slices (the `1c` in `1c.3g.40gb`)
    instance_count: int
    sms: int
    # Where a CI of this profile may sit inside its GI, in compute slices (NVML's
    # nvmlGpuInstanceGetComputeInstancePossiblePlacements; each placement is `slices` wide).
    starts: tuple[int, ...] = ()


class MigProfile(Struct, frozen=True):
    """One GPU-instance profile of one GPU model, as NVML reports it."""

    id: int  # NVML GI profile id (19 = 1g, 0 = 7g ...); never the profile index constant
    name: str  # "1g.18gb", "1g.18gb+me" (without NVML's "MIG " prefix)
    slices: int  # compute slices (the `1g` in `1g.18gb`)
    memory_mb: int
    sms: int
    instance_count: int
    placements: tuple[Placement, ...]  # every allowed placement
    ci_profiles: tuple[CiProfile, ...] = ()
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpegs: int = 0
    ofas: int = 0


class Holder(Struct, frozen=True, order=True):
    """A process that keeps a GPU or MIG device busy. gpud never kills it; it waits or reports."""

    pid: int
    name: str
    device: str  # "/dev/nvidia0", a MIG UUID, or a PCI address
    vm: str | None = None  # the VM this process runs (qemu's `-name guest=<vm>`), when it is one


class ComputeInstance(Struct, frozen=True):
    id: int
    profile_id: int
    slices: int
    uuid: str  # "MIG-..." UUID of the MIG device this CI forms
    holders: tuple[Holder, ...] = ()
    start: int | None = None  # placement inside its GI, in compute slices (None: not read)


class GpuInstance(Struct, frozen=True):
    id: int
    profile_id: int
    placement: Placement
    cis: tuple[ComputeInstance, ...] = ()

    @property
    def holders(self) -> tuple[Holder, ...]:
        return tuple(h for ci in self.cis for h in ci.holders)


class PciFunction(Struct, frozen=True):
    """One PCI function as sysfs shows it."""

    address: str  # "0000:3b:00.0"
    vendor: int
    device: int
    subsystem_vendor: int
    subsystem_device: int
    class_code: int  # 0x030200
    driver: str | None = None
    driver_override: str | None = None
    iommu_group: int | None = None
    numa_node: int = -1
    # the VFIO variant driver the kernel's modules.alias names for it (nvgrace_gpu_vfio_pci on a
    # Grace GPU); None: plain vfio-pci (gpud.host.kernel.module_alias)
    vfio_variant: str | None = None

    @property
    def pci_id(self) -> str:
        return f"{self.vendor:04x}:{self.device:04x}"

    @property
    def slot(self) -> str:
        """Address without the function number: functions of one card share it."""
        return self.address.rsplit(".", 1)[0]


class NvmlGpu(Struct, frozen=True):
    """What NVML says about one GPU (only GPUs bound to the nvidia driver are visible)."""

    pci: str
    uuid: str
    name: str  # "NVIDIA H200"
    minor: int | None = None
    memory_mb: int = 0
    mig_capable: bool = False
    mig_mode: int | None = None  # 0/1, None when not MIG capable
    mig_pending: int | None = None
    profiles: tuple[MigProfile, ...] = ()
    instances: tuple[GpuInstance, ...] = ()
    processes: tuple[Holder, ...] = ()  # compute processes on the whole GPU
    compute_capability: tuple[int, int] | None = None  # CUDA (major, minor): GFD's gpu.family
    # the nvidia module's CoherentGPUMemoryMode as /proc/driver/nvidia/params states it ("driver":
    # CDMM, "numa" or "": NUMA; None: not stated), for a coherent (Grace) GPU: docs/hardware/grace.md
    coherent_memory_mode: str | None = None

    def profile(self, profile_id: int) -> MigProfile | None:
        return next((p for p in self.profiles if p.id == profile_id), None)


class Gpu(Struct, frozen=True):
    """A managed GPU: sysfs joined with NVML. `index` is its position in PCI-address order of all
    managed GPUs, whatever driver they sit on, so it never shifts when some are on vfio-pci."""

    index: int
    function: PciFunction
    companions: tuple[PciFunction, ...] = ()  # other endpoints of its IOMMU group / slot
    nvml: NvmlGpu | None = None
    holders: tuple[Holder, ...] = ()  # processes with its device nodes open (from /proc)
    present: bool = True
    vgpu: VgpuState | None = None  # its vGPU side, when it shows a vGPU interface (on nvidia)
    # The UUID NVML last gave for this PCI address (kept in gpud's GPU index map across restarts
    # and reboots): a GPU on vfio-pci is invisible to NVML, yet a layout may name it by UUID.
    known_uuid: str | None = None

    @property
    def pci(self) -> str:
        return self.function.address

    @property
    def uuid(self) -> str | None:
        """NVML's UUID when NVML sees the GPU, else the one remembered for its PCI address."""
        return self.nvml.uuid if self.nvml is not None and self.nvml.uuid else self.known_uuid

    @property
    def pci_id(self) -> str:
        return self.function.pci_id


class KnownGpu(Struct, frozen=True):
    """A GPU gpud has numbered, as last seen: what an index names while the card is away.

    Indices are kept per PCI address (gpud.engine.observe.gpu_index), so a GPU missing from the bus keeps
    its index and its last identity, and no other GPU ever takes that index over."""

    index: int
    pci: str
    vendor: int
    device: int
    model: str
    uuid: str | None = None

    @property
    def pci_id(self) -> str:
        return f"{self.vendor:04x}:{self.device:04x}"


class VgpuDevice(Struct, frozen=True):
    """One vGPU on a GPU: an mdev (by UUID) or a VF carrying a vendor-VFIO vGPU type."""

    type: str  # bare type name: "L40S-12Q"
    parent: str  # PCI address the vGPU hangs off: a VF, or the GPU itself (mdev on T4)
    uuid: str | None = None  # mdev UUID (the libvirt domain's handle); None for a VF vGPU
    vf: str | None = None  # VF PCI address for a vendor-VFIO vGPU
    type_id: int | None = None  # current_vgpu_type id / the N of nvidia-N
    gi: int | None = None  # GPU instance of a MIG-backed vGPU
    vfio_group: int | None = None  # /dev/vfio/<group> a VM opens
    holders: tuple[Holder, ...] = ()
    # The type as the driver prints it in the mdev's `mdev_type/name` ("GRID A100-10C"): what
    # kubevirt-gpu-device-plugin reads for the resource name and KubeVirt's mdevNameSelector
    # matches. None for a VF vGPU (no mdev_type) or a file that could not be read.
    driver_name: str | None = None
    # The VF's own PCI id as its uevent's PCI_ID gives it ("10DE:26B9"): what KubeVirt's PCI device
    # plugin matches a pciHostDevices selector against (docs/kubevirt.md). None for an mdev.
    pci_id: str | None = None


class VgpuOffer(Struct, frozen=True):
    """A type the GPU offers now, with how many more could be created (0: offered but full)."""

    type: str
    type_id: int | None
    creatable: int


class VgpuState(Struct, frozen=True):
    """The vGPU side of one GPU as sysfs shows it. `interface` is None when the GPU shows neither
    interface yet: an SR-IOV GPU before its VFs are enabled says `sriov` (which stack it runs is
    known only once VFs exist)."""

    interface: str | None  # "vfio" | "mdev" | "sriov" (VFs not enabled yet) | None
    total_vfs: int = 0
    vfs: tuple[str, ...] = ()  # enabled VFs, in virtfn order
    offers: tuple[VgpuOffer, ...] = ()
    devices: tuple[VgpuDevice, ...] = ()
