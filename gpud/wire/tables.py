"""The typed results of the table ops of the gpud socket protocol: `mig-profiles` and
`mig-compute-profiles` (nvidia-smi mig -lgip/-lcip's rows), `passthrough` (devices and vGPUs for
VMs, with libvirt's and KubeVirt's configuration) and `vgpu-types`. Part of the client's contract
with gpud/wire/protocol.py and gpud/wire/replies.py (whose RESULTS maps each op to its struct), and
like them it imports only the standard library, msgspec and the contract's own modules."""

# No `from __future__ import annotations` here, as in wire_replies.py (msgspec compiles annotation
# strings on first decode). Classes are defined before they are used in annotations.
from typing import Any

import msgspec


class Placement(msgspec.Struct, kw_only=True):
    start: int
    size: int


class ProfileInfo(msgspec.Struct, kw_only=True):
    id: int
    name: str  # "1g.18gb" (without NVML's "MIG " prefix)
    memory_mb: int
    sms: int = 0
    slices: int = 0
    free: int = 0
    total: int = 0
    placements: list[Placement] = []
    ce: int = 0
    dec: int = 0
    enc: int = 0
    jpg: int = 0
    ofa: int = 0
    p2p: bool = False
    # Fields of this row no source gives ("memory_mb", "sms", "placements", "free", ...): their
    # values above are placeholders a client must show as unknown, never as numbers.
    unknown: list[str] = []


class GpuProfiles(msgspec.Struct, kw_only=True):
    index: int
    pci: str
    model: str = ""
    profiles: list[ProfileInfo] = []
    # "nvml": the GPU's own answer; "table": gpud's table of known models (NVML cannot see the
    # GPU, e.g. it sits on vfio-pci), with its sources in docs/hardware/mig-profiles.md.
    source: str = "nvml"


class MigProfilesReply(msgspec.Struct, kw_only=True):
    gpus: list[GpuProfiles] = []


class ComputeProfileInfo(msgspec.Struct, kw_only=True):
    """One compute-instance profile of one GPU instance (a row of `nvidia-smi mig -lcip`)."""

    id: int  # NVML CI profile id, what `nvidia-smi mig -cci` takes
    name: str  # "1c.3g.40gb"; the GI's own name for the CI covering it ("3g.40gb")
    slices: int
    free: int  # how many more this GI can take (NVML's RemainingCapacity)
    total: int  # the profile's instance count in a GI
    sms: int
    default: bool = False  # the CI covering the whole GI (nvidia-smi marks its id with `*`)
    ce: int = 0  # shared engines: the GI's, which its CIs share
    dec: int = 0
    enc: int = 0
    jpg: int = 0
    ofa: int = 0


class GiComputeProfiles(msgspec.Struct, kw_only=True):
    gi: int
    profile: str  # the GPU instance's profile: "3g.40gb"
    placement: Placement
    profiles: list[ComputeProfileInfo] = []


class GpuComputeProfiles(msgspec.Struct, kw_only=True):
    index: int
    pci: str
    model: str = ""
    instances: list[GiComputeProfiles] = []


class MigComputeProfilesReply(msgspec.Struct, kw_only=True):
    gpus: list[GpuComputeProfiles] = []


class PassthroughDevice(msgspec.Struct, kw_only=True):
    pci: str
    vendor_device: str  # "10de:2335"
    resource_name: str = ""  # KubeVirt / device-plugin resource, "nvidia.com/GH100_H200"
    iommu_group: int | None = None
    vfio_device: str | None = None
    numa_node: int | None = None
    libvirt_hostdev: str = ""  # <hostdev> XML for `virsh attach-device`
    kubevirt: dict[str, Any] = {}  # permittedHostDevices.pciHostDevices entry


class VgpuPassthrough(msgspec.Struct, kw_only=True):
    gpu: str  # PCI address of the physical GPU
    type: str  # "L40S-12Q"
    driver_name: str = ""  # as the driver prints it: "NVIDIA L40S-12Q"
    uuid: str | None = None  # mdev UUID
    vf: str | None = None  # VF PCI address
    vfio_device: str | None = None
    resource_name: str = ""  # "nvidia.com/NVIDIA_L40S-12Q"
    libvirt_hostdev: str = ""  # mdev by UUID, or the VF as an unmanaged PCI hostdev
    kubevirt: dict[str, Any] = {}  # permittedHostDevices: mediatedDevices or pciHostDevices entry


class PassthroughReply(msgspec.Struct, kw_only=True):
    devices: list[PassthroughDevice] = []
    vgpus: list[VgpuPassthrough] = []
    # the KubeVirt CR's spec.configuration (KubeVirt >= 1.8): permittedHostDevices, one entry per
    # resource, and mediatedDevicesConfiguration.enabled=false where gpud makes the vGPUs
    kubevirt_configuration: dict[str, Any] = {}
    # what KubeVirt v1.9 does with these devices that the entries cannot say (gpud.engine.vgpu.inventory)
    kubevirt_warnings: list[str] = []


class VgpuTypeInfo(msgspec.Struct, kw_only=True):
    name: str  # "L40S-12Q"
    id: int | None = None  # the driver's id (creatable list / nvidia-N)
    mig_profile: str | None = None  # GPU instance profile a MIG-backed type needs
    framebuffer_gb: int = 0
    creatable: int = 0  # how many more the GPU can take now
    max: int | None = None  # per GPU, from gpud's table; None for a model it has no table for


class GpuVgpuTypes(msgspec.Struct, kw_only=True):
    index: int
    pci: str
    model: str = ""
    interface: str | None = None
    types: list[VgpuTypeInfo] = []


class VgpuTypesReply(msgspec.Struct, kw_only=True):
    gpus: list[GpuVgpuTypes] = []
