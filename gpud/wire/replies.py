"""The typed result of each op of the gpud socket protocol (`RESULTS`), and their decoding.

gpud/wire/protocol.py holds the envelope these travel in (frames, requests, responses, events, the
arguments of each op); this module holds what a `Response.result` is, op by op (the table ops'
structs in wire_tables.py). The daemon builds these structs (gpud/api/replies.py) and `gpudctl`
decodes into them, so like wire.py this module imports only the standard library, msgspec and
the contract's own modules: every import here is paid by every `gpudctl` run that decodes a reply.

Unknown fields are ignored on decode and every field added later gets a default, so old clients
keep working against newer daemons. Reply structs do not omit defaults: `gpudctl ... --json`
prints them and scripts need a stable shape.
"""

# No `from __future__ import annotations` here: msgspec would then compile every field's annotation
# string when a client first decodes a reply (~60 for a status), which costs more than evaluating
# them once as the classes are made. Classes are defined before they are used in annotations.
from typing import Any

import msgspec

from gpud.wire.protocol import PROTOCOL, Event, FrameError
from gpud.wire.tables import (
    MigComputeProfilesReply,
    MigProfilesReply,
    PassthroughReply,
    Placement,
    VgpuTypesReply,
)


class HolderInfo(msgspec.Struct, kw_only=True):
    pid: int
    name: str
    device: str = ""  # "/dev/nvidia0", a MIG UUID, a PCI address (GPU or VF) or an mdev UUID
    vm: str | None = None  # the VM a qemu holder runs (its `-name guest=...`)


class InstanceStatus(msgspec.Struct, kw_only=True):
    profile: str  # "1g.18gb", or "1c.3g.71gb" for a CI smaller than its GI
    placement: Placement
    gi: int
    ci: int | None = None  # None: a GPU instance without a compute instance (no MIG device yet)
    uuid: str | None = None
    holders: list[HolderInfo] = []
    ci_placement: Placement | None = None  # the CI's slot in its GI, in compute slices


class MigStatus(msgspec.Struct, kw_only=True):
    capable: bool = False
    mode: str | None = None  # "enabled" | "disabled" | None (not capable / not visible to NVML)
    pending: str | None = None  # the mode after the next reset, when it differs from `mode`
    instances: list[InstanceStatus] = []


class VgpuDeviceStatus(msgspec.Struct, kw_only=True):
    type: str  # "L40S-12Q"
    uuid: str | None = None  # mdev UUID (mdev interface)
    vf: str | None = None  # VF PCI address (vendor-VFIO interface)
    parent: str = ""  # the VF or GPU the vGPU hangs off
    gi: int | None = None  # GPU instance of a MIG-backed vGPU
    holders: list[HolderInfo] = []


class VgpuStatus(msgspec.Struct, kw_only=True):
    interface: str | None = None  # "vfio" | "mdev" | "sriov" (VFs not enabled yet)
    offered: list[str] = []  # type names the GPU offers now (creatable somewhere on it)
    vfs: int = 0  # VFs enabled
    devices: list[VgpuDeviceStatus] = []
    rebuilt: list[str] = []  # vGPUs gpud recreated from its record since it started ("T4-4Q <uuid>")


class GroupMember(msgspec.Struct, kw_only=True):
    pci: str
    driver: str | None = None
    class_: str = msgspec.field(default="", name="class")  # "0x030200"


class LeaseInfo(msgspec.Struct, kw_only=True):
    """One lease (gpud.engine.leases): what a job needs to use it, and who holds it."""

    id: str
    gpu: str  # PCI address
    index: int | None = None  # the GPU's index
    profile: str  # "1g.10gb" ... or "gpu" for a whole-GPU lease
    placement: str | None = None  # "start:size" in memory slices
    uuid: str | None = None  # MIG-... for CUDA_VISIBLE_DEVICES (the GPU's own UUID for a whole GPU)
    devices: list[str] = []  # /dev/nvidiaN and its MIG capability nodes
    owner: str = ""
    uid: int = 0
    pid: int | None = None
    created: float = 0.0  # Unix seconds
    age_s: float = 0.0
    state: str = "held"  # intent | gi-made | held | releasing | vanished
    note: str = ""


class GpuStatus(msgspec.Struct, kw_only=True):
    index: int
    pci: str
    uuid: str | None = None  # NVML's; on vfio-pci the one gpud last read; None: never seen by NVML
    model: str = ""
    pci_id: str = ""  # "10de:2335"
    driver: str | None = None
    workload: str = "container"
    iommu_group: int | None = None
    numa_node: int | None = None
    mig: MigStatus = msgspec.field(default_factory=MigStatus)
    converged: bool = False
    # converged | applying | waiting | failed | stuck | reset-required | reboot-required |
    # unmanaged | read-only | gone
    state: str = "unmanaged"
    message: str = ""
    holders: list[HolderInfo] = []
    group: list[GroupMember] = []
    vfio_device: str | None = None  # "/dev/vfio/42" when bound to vfio-pci
    vgpu: VgpuStatus | None = None  # None: the GPU shows no vGPU interface
    dynamic: bool = False  # mig-devices: dynamic: its instances are made by leases
    leases: list[LeaseInfo] = []
    lease_free: dict[str, int] = {}  # dynamic GPUs: GI profile -> how many more leases of it fit now


class LayoutStatus(msgspec.Struct, kw_only=True):
    path: str
    selected: str | None = None  # the layout name chosen for this host
    chosen: bool = False  # `selected` was chosen by `gpudctl select`, over the file's own
    valid: bool = False
    errors: list[str] = []
    warnings: list[str] = []
    errors_omitted: int = 0  # errors left out of `errors` to keep the reply small (MAX_LISTED)
    warnings_omitted: int = 0


class KubeAgentStatus(msgspec.Struct, kw_only=True):
    """`gpud --kube-node`: the operator's label protocol as gpud follows it on this node."""

    node: str
    connected: bool = False
    selected: str | None = None  # the layout nvidia.com/mig.config (or vgpu.config) selects
    state: str | None = None  # what gpud last wrote to nvidia.com/mig.config.state
    message: str = ""
    paused: list[str] = []  # nvidia.com/gpu.deploy.* labels paused now
    other_agents: list[str] = []  # pods of the operator's mig-manager & co. that kept gpud from changing GPUs
    workload_config: str | None = None  # nvidia.com/gpu.workload.config: the operand family the operator runs
    unserved: list[str] = []  # GPUs of a mixed layout that family does not serve, and which operands are missing


class Advertised(msgspec.Struct, kw_only=True):
    """What the device plugins will advertise for this node as its GPUs are now."""

    mig_strategy: str = "mixed"
    resources: dict[str, int] = {}  # k8s-device-plugin: nvidia.com/gpu, nvidia.com/mig-1g.10gb
    sandbox: dict[str, int] = {}  # kubevirt-gpu-device-plugin: nvidia.com/GH100_H100_SXM5_80GB
    problems: list[str] = []  # why the device plugin would refuse to start


class DraClaimStatus(msgspec.Struct, kw_only=True):
    uid: str
    claim: str  # namespace/name
    devices: list[str] = []
    leases: list[str] = []  # the MIG leases its prepare made (gpudctl leases lists them)


class DraXid(msgspec.Struct, kw_only=True):
    pci: str
    xid: int
    effect: str  # the devices' taint: NoSchedule, or None (an application's Xid: still scheduled)
    text: str = ""


class DraStatus(msgspec.Struct, kw_only=True):
    """--dra: the pool gpud publishes as the node's DRA driver, and the claims it prepared."""

    driver: str
    node: str
    generation: int = 0
    slices: int = 0
    devices: int = 0
    registered: bool | None = None  # what the kubelet last said (None: it has not called)
    claims: list[DraClaimStatus] = []
    xids: list[DraXid] = []  # GPUs whose devices carry an Xid taint (until initialised afresh)
    taints_dropped: bool = False  # the API server drops taints: those GPUs are withdrawn instead


class KubernetesStatus(msgspec.Struct, kw_only=True):
    advertised: Advertised
    agent: KubeAgentStatus | None = None  # None without --kube-node
    dra: DraStatus | None = None  # None without --dra


class StatusReply(msgspec.Struct, kw_only=True):
    # converged | applying | waiting | failed | starting | invalid-layout | ...
    phase: str
    layout: LayoutStatus
    gpus: list[GpuStatus] = []
    read_only: bool = False
    version: str = ""
    # The host as of this moment (Unix seconds; 0 before the first read) and how long ago that
    # was: gpud answers from the observation it keeps, re-read on every change it sees and at a
    # bounded rate while clients ask; `status {fresh: true}` waits for a read begun after the request.
    observed_at: float = 0.0
    observation_age: float = 0.0
    kubernetes: KubernetesStatus | None = None
    # after a reboot, what gpud's first pass rebuilt ("rebuilt after boot: GPU 0 (...): MIG on, ...")
    rebuilt_after_boot: str | None = None
    # gpud's state files that were set aside (not regular, not gpud's, not in its format) or could
    # not be written, each with what it means
    state_files: list[str] = []


class CheckReply(msgspec.Struct, kw_only=True):
    valid: bool
    errors: list[str] = []
    warnings: list[str] = []
    selected: str | None = None
    errors_omitted: int = 0
    warnings_omitted: int = 0
    checked: list[str] = []  # the layouts checked (all of them with all_layouts)
    dynamic: list[str] = []  # GPUs whose instances leases make: "GPU 0 (0000:3b:00.0): ..."


class StepInfo(msgspec.Struct, kw_only=True):
    # set-mig-mode | destroy-ci | destroy-gi | create-gi | create-ci | reset | bind | unbind ...
    action: str
    profile: str | None = None
    placement: Placement | None = None
    uuid: str | None = None
    gi: int | None = None
    ci: int | None = None
    enabled: bool | None = None  # set-mig-mode
    driver: str | None = None  # bind / unbind / driver_override
    pci: str | None = None  # binding steps: the endpoint of the IOMMU group the step acts on
    module: str | None = None  # load-module
    group: int | None = None  # verify of /dev/vfio/<group>
    type: str | None = None  # vGPU steps: the vGPU type
    vf: str | None = None  # vGPU steps: the VF (vendor VFIO)
    count: int | None = None  # enable-vfs
    message: str = ""
    ci_placement: Placement | None = None  # create-ci: the CI's slot in its GI, in compute slices


class GpuPlanInfo(msgspec.Struct, kw_only=True):
    index: int
    pci: str
    steps: list[StepInfo] = []
    infeasible: str | None = None
    blocked_by: list[HolderInfo] = []
    dynamic: str | None = None  # mig-devices: dynamic: what the file leaves to leases


class DestroyedInfo(msgspec.Struct, kw_only=True):
    pci: str
    profile: str
    placement: Placement | None = None
    uuid: str | None = None
    holders: list[HolderInfo] = []


class RebindInfo(msgspec.Struct, kw_only=True):
    """A GPU moved between drivers: what leaves which driver, and who loses it."""

    pci: str  # the GPU
    to: str  # "vfio-pci" | "native"
    detached: dict[str, str] = {}  # endpoint PCI address -> the driver it is taken from
    leaves_nvml: bool = False  # the GPU disappears from NVML and containers
    mig_instances: int = 0  # MIG GPU instances that go with the nvidia binding
    vfio_group: int | None = None  # a VM using /dev/vfio/<group> loses its device
    holders: list[HolderInfo] = []  # processes holding what leaves its driver (gpud waits for them)
    summary: str = ""


class VgpuRemovedInfo(msgspec.Struct, kw_only=True):
    pci: str  # the GPU
    type: str
    uuid: str | None = None
    vf: str | None = None
    holders: list[HolderInfo] = []


class Disruption(msgspec.Struct, kw_only=True):
    destroyed: list[DestroyedInfo] = []
    vgpus_removed: list[VgpuRemovedInfo] = []  # vGPUs the plan removes (a VM using one would lose it)
    vfs_disabled: list[str] = []  # GPUs whose SR-IOV VFs go
    mode_changes: list[str] = []  # PCI addresses
    resets: list[str] = []  # PCI addresses
    # NVSwitch system: GPUs a planned reset would take with it (the system resets them together)
    reset_with: list[str] = []
    rebinds: list[RebindInfo] = []  # GPUs (and their IOMMU groups) leaving their driver


class PlanReply(msgspec.Struct, kw_only=True):
    gpus: list[GpuPlanInfo] = []
    disruption: Disruption = msgspec.field(default_factory=Disruption)
    errors: list[str] = []
    warnings: list[str] = []
    errors_omitted: int = 0
    warnings_omitted: int = 0


class GpuApplyInfo(msgspec.Struct, kw_only=True):
    pci: str
    state: str
    message: str = ""


class ApplyReply(msgspec.Struct, kw_only=True):
    phase: str
    converged: bool = False
    message: str = ""
    gpus: list[GpuApplyInfo] = []


class VersionReply(msgspec.Struct, kw_only=True):
    version: str
    driver: str | None = None  # NVIDIA kernel driver version, None without one
    nvml: str | None = None
    protocol: int = PROTOCOL
    config: str | None = None  # the layout file this daemon keeps (what `gpudctl check` validates)


class LabelsReply(msgspec.Struct, kw_only=True):
    """The node labels: what gpud computes from the hardware now, and what NFD's file holds."""

    path: str | None = None  # the NFD feature file (None: not written)
    label_set: str = "all"  # all (GFD's + gpud's) | gpud
    result: str | None = None  # of the last write: written | unchanged | no-directory | error: ...
    file: dict[str, str] | None = None  # what the file holds (None: no file, or refused)
    file_refused: str | None = None  # why what is at the path is not shown (a link, a FIFO, not gpud's)
    labels: dict[str, str] = {}  # computed now
    warnings: list[str] = []  # labels left out, with why


class EventsReply(msgspec.Struct, kw_only=True):
    events: list[Event] = []  # recent history, oldest first
    following: bool = False  # EventFrames follow on this connection
    omitted: int = 0  # older events of the history left out so the reply fits in one frame


class LoopLag(msgspec.Struct, kw_only=True):
    samples: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0


class StatsReply(msgspec.Struct, kw_only=True):
    """The daemon's own health, over the window since start or the last `reset`: how late the
    event loop ran (a probe's wake-ups), what it served, how often it read the host, its memory."""

    window_s: float = 0.0
    loop_lag: LoopLag = msgspec.field(default_factory=LoopLag)
    requests: dict[str, int] = {}  # per op, answered in the window
    observations: int = 0  # reads of the host in the window
    rss_bytes: int = 0  # resident set now (VmRSS)
    peak_rss_bytes: int = 0  # since start (VmHWM)


class ReleaseReply(msgspec.Struct, kw_only=True):
    lease: LeaseInfo
    message: str = ""


class LeasesReply(msgspec.Struct, kw_only=True):
    leases: list[LeaseInfo] = []


RESULTS: dict[str, type[msgspec.Struct]] = {
    "status": StatusReply,
    "check": CheckReply,
    "plan": PlanReply,
    "apply": ApplyReply,
    "reload": LayoutStatus,
    "select": LayoutStatus,
    "events": EventsReply,
    "version": VersionReply,
    "mig-profiles": MigProfilesReply,
    "mig-compute-profiles": MigComputeProfilesReply,
    "passthrough": PassthroughReply,
    "stats": StatsReply,
    "labels": LabelsReply,
    "vgpu-types": VgpuTypesReply,
    "lease": LeaseInfo,
    "release": ReleaseReply,
    "leases": LeasesReply,
}


def decode_result(op: str, result: Any) -> Any:
    """Type a Response.result by its op (plain value for ops without a result struct)."""
    typ = RESULTS.get(op)
    if typ is None:
        return result
    try:
        return msgspec.convert(result, typ)
    except msgspec.ValidationError as e:
        raise FrameError(f"malformed {op} result from gpud: {e}") from None
