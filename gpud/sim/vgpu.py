"""The simulated vGPU host: SR-IOV VFs, NVIDIA's vendor-VFIO attributes, and mediated devices.

Two host interfaces exist and gpud must find out which one a GPU has (docs/vgpu.md):
- vendor-specific VFIO: the GPU's VFs (`sriov_numvfs`) each carry `nvidia/creatable_vgpu_types`
  (a header line, then `ID : Name` lines, shrinking as sibling VFs take types, header-only when
  nothing more fits), `nvidia/current_vgpu_type` (write an id to create, `0` to free) and, for
  MIG-backed types, `nvidia/gpu_instance_id` / `placement_id`;
- mdev: `<parent>/mdev_supported_types/nvidia-<N>/{name,description,available_instances,device_api,create}`
  and `/sys/bus/mdev/devices/<uuid>/remove`; on SR-IOV GPUs the parents are the VFs (one vGPU
  each), on older cards (T4) the GPU itself.

What fits on one GPU follows NVIDIA's rules: time-sliced vGPUs on one GPU are all of one type, at
most the type's per-GPU count; MIG-backed vGPUs need MIG on and a GPU instance of their profile,
as many to an instance as the type allows (`VgpuType.per_gi`: one on Ampere and Hopper, eight
DC-1-3Q on an RTX PRO 6000's 1g.24gb+gfx), one type per instance. Kernel semantics are the 6.1
kernel's where the kernel decides (`sriov_numvfs_store` in drivers/pci/iov.c;
`create_store`/`remove_store` in drivers/vfio/mdev): ERANGE above sriov_totalvfs, EBUSY to change
a non-zero VF count, EEXIST for a UUID in use, and a `remove` of an mdev a VM holds open *blocks*
until it is closed (vfio_unregister_group_dev waits).
Where only NVIDIA's closed driver decides, the choice is written next to the code and in
docs/vgpu.md.
"""

from __future__ import annotations

import errno
import re
import time
from collections.abc import Callable
from typing import Protocol

from gpud import profiles, vgpu_types
from gpud.sim.kstrto import kstrtou, sysfs_error
from gpud.sim.state import SimFunction, SimMdev, SimProcess, SimState, SimVf, SimVgpu, locked
from gpud.sim.uevents import Uevent
from gpud.vgpu_types import SYNTHETIC_ID_BASE, VgpuModel, VgpuType

INTERFACES = ("vfio", "mdev")
# The mdev driver NVIDIA's vGPU manager binds its mdevs to (the `nvidia_vgpu_vfio` module's).
MDEV_DRIVER = "nvidia_vgpu_vfio"
VF_OFFSET = 4  # first VF at function 4 of the PF's slot, stride 1 (as NVIDIA GPUs enumerate them)
CREATABLE_HEADER = "ID    : vGPU Name"
FIRST_VGPU_GROUP = 200  # IOMMU groups handed to VFs and mdevs
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


class SimType:
    """A catalogue type with the ids the simulated driver shows for it (synthetic where the sources
    give none: SYNTHETIC_ID_BASE + its position in the model's table)."""

    def __init__(self, vtype: VgpuType, position: int):
        self.type = vtype
        self.name = vtype.name
        self.vfio_id = vtype.vfio_id if vtype.vfio_id is not None else SYNTHETIC_ID_BASE + position
        self.mdev_id = vtype.mdev_id if vtype.mdev_id is not None else SYNTHETIC_ID_BASE + position
        self.profile = vtype.mig_profile
        self.per_gi = vtype.per_gi


def vgpu_model(st: SimState, pf: str) -> VgpuModel | None:
    fn = st.functions.get(pf)
    return vgpu_types.by_device(fn.device) if fn is not None else None


def sim_types(model: VgpuModel) -> list[SimType]:
    return [SimType(t, i) for i, t in enumerate(model.types)]


def vf_address(pf: str, index: int) -> str:
    domain, bus, rest = pf.split(":")
    dev, fn = (int(x, 16) for x in rest.split("."))
    devfn = (dev << 3 | fn) + VF_OFFSET + index
    return f"{domain}:{bus}:{devfn >> 3:02x}.{devfn & 7}"


def _event(action: str, subsystem: str, address: str | None, driver: str | None) -> Uevent:
    """A kernel uevent, sent by the simulated kernel once the change is saved."""
    return Uevent(action, subsystem, address, driver)


def _gi_profile_names(st: SimState, pf: str) -> dict[int, str]:
    """GI id -> profile name of the GPU's current GPU instances."""
    gpu = st.gpus.get(pf)
    if gpu is None:
        return {}
    model = profiles.MODELS.get(gpu.model)
    names = {p.id: p.name for p in model.profiles} if model else {}
    return {gi.id: names.get(gi.profile_id, "") for gi in gpu.gis}


def placed(st: SimState, pf: str) -> list[tuple[SimType, int]]:
    """(type, GI id or -1) of every vGPU on the GPU at `pf`."""
    v = st.vgpu.get(pf)
    model = vgpu_model(st, pf)
    if v is None or model is None:
        return []
    types = sim_types(model)
    out: list[tuple[SimType, int]] = []
    by_vfio = {t.vfio_id: t for t in types}
    by_mdev = {t.mdev_id: t for t in types}
    for vf in v.vfs:
        if vf.vgpu_type:
            out.append((by_vfio[vf.vgpu_type], vf.gpu_instance_id))
    for m in v.mdevs:
        out.append((by_mdev[m.type_id], m.gpu_instance_id))
    return out


def _gi_room(st: SimState, pf: str, stype: SimType) -> dict[int, int]:
    """GI id -> how many more vGPUs of this type each instance of its profile takes: an instance
    holds one type, up to the type's per-instance count."""
    on: dict[int, list[str]] = {}
    for t, gi in placed(st, pf):
        on.setdefault(gi, []).append(t.name)
    room = {}
    for gi, name in _gi_profile_names(st, pf).items():
        types = on.get(gi, [])
        if name == stype.profile and all(t == stype.name for t in types):
            room[gi] = max(0, stype.per_gi - len(types))
    return room


def _free_gi(st: SimState, pf: str, stype: SimType) -> int | None:
    """The instance a new vGPU of this type goes onto (the driver's choice, modelled): the
    lowest-id instance already carrying the type with room, else the lowest-id empty one."""
    room = _gi_room(st, pf, stype)
    carrying = {gi for t, gi in placed(st, pf) if t.name == stype.name}
    for gi in sorted(room, key=lambda g: (g not in carrying, g)):
        if room[gi] > 0:
            return gi
    return None


def room(st: SimState, pf: str, stype: SimType) -> int:
    """How many more vGPUs of this type the GPU can take, whatever the parent."""
    gpu = st.gpus.get(pf)
    fn = st.functions.get(pf)
    if gpu is None or fn is None or not fn.present or fn.driver != "nvidia":
        return 0
    now = placed(st, pf)
    if gpu.mig_mode:
        if stype.profile is None:
            return 0
        return sum(_gi_room(st, pf, stype).values())
    if stype.profile is not None:
        return 0
    if now and now[0][0].name != stype.name:
        return 0  # time-sliced vGPUs on one GPU are all of one type
    return max(0, stype.type.max_instances - len(now))


def _vf_busy(v: SimVgpu, address: str) -> bool:
    """Does this VF already carry a vGPU (vendor VFIO type, or an mdev on it)?"""
    vf = next((x for x in v.vfs if x.address == address), None)
    return (vf is not None and vf.vgpu_type != 0) or any(m.parent == address for m in v.mdevs)


def creatable(st: SimState, pf: str, parent: str) -> list[SimType]:
    """Types one more vGPU on `parent` (a VF, or the GPU for non-SR-IOV mdev) could have."""
    v = st.vgpu.get(pf)
    model = vgpu_model(st, pf)
    if v is None or model is None:
        return []
    if parent != pf and _vf_busy(v, parent):
        return []
    return [t for t in sim_types(model) if room(st, pf, t) > 0]


def available_instances(st: SimState, pf: str, parent: str, stype: SimType) -> int:
    v = st.vgpu[pf]
    if parent != pf:  # a VF parent holds one vGPU
        return 1 if not _vf_busy(v, parent) and room(st, pf, stype) > 0 else 0
    return room(st, pf, stype)


def parents(st: SimState, pf: str) -> list[str]:
    """mdev parents of the GPU: its VFs on SR-IOV GPUs, else the GPU itself."""
    v = st.vgpu[pf]
    model = vgpu_model(st, pf)
    if model is not None and model.sriov:
        return [vf.address for vf in v.vfs]
    return [pf]


def owner(st: SimState, address_or_uuid: str) -> tuple[str, SimVgpu] | None:
    """(PF address, its SimVgpu) of a VF address or an mdev UUID."""
    for pf, v in st.vgpu.items():
        if address_or_uuid == pf or any(vf.address == address_or_uuid for vf in v.vfs):
            return pf, v
        if any(m.uuid == address_or_uuid.lower() for m in v.mdevs):
            return pf, v
    return None


def find_mdev(st: SimState, uuid: str) -> tuple[str, SimMdev] | None:
    for pf, v in st.vgpu.items():
        for m in v.mdevs:
            if m.uuid == uuid.lower():
                return pf, m
    return None


def holders_of(st: SimState, device: str) -> list:
    """SimProcesses holding a VF (by PCI address) or an mdev (by UUID) open."""
    return [p for p in st.processes if p.device == device]


def _next_group(st: SimState) -> int:
    used = {f.iommu_group for f in st.functions.values() if f.iommu_group is not None}
    used |= {m.iommu_group for v in st.vgpu.values() for m in v.mdevs}
    g = FIRST_VGPU_GROUP
    while g in used:
        g += 1
    return g


def vfio_group_of(st: SimState, device: str) -> int | None:
    """/dev/vfio/<group> a VM opens for this vGPU: the mdev's group, or a VF's once it has a type."""
    found = find_mdev(st, device)
    if found is not None:
        return found[1].iommu_group
    for v in st.vgpu.values():
        for vf in v.vfs:
            if vf.address == device and vf.vgpu_type:
                fn = st.functions.get(vf.address)
                return fn.iommu_group if fn is not None else None
    return None


def process_devices(st: SimState, proc: SimProcess) -> list[str] | None:
    """Device paths a process holding a vGPU has open; None when `proc` holds no vGPU."""
    if owner(st, proc.device) is None or proc.device in st.vgpu:
        return None
    group = vfio_group_of(st, proc.device)
    return ["vfio/vfio", f"vfio/{group}"] if group is not None else []


def cmdline(proc: SimProcess) -> str | None:
    """The NUL-separated command line of a simulated VM process (libvirt's qemu style)."""
    if not proc.vm:
        return None
    args = ["/usr/bin/qemu-system-x86_64", "-name", f"guest={proc.vm},debug-threads=on", "-machine", "q35"]
    return "\0".join(args) + "\0"


# ---- rendering (called by gpud.sim.sysfs_tree.desired_tree)

def render(st: SimState, pci_root: str, d: Callable[[str], None],
           f: Callable[..., None], ln: Callable[[str, str], None]) -> None:
    """Add the vGPU attributes to the desired tree (`d`, `f`, `ln` as in desired_tree)."""
    any_mdev = False
    for pf, v in sorted(st.vgpu.items()):
        fn = st.functions.get(pf)
        model = vgpu_model(st, pf)
        if fn is None or not fn.present or model is None:
            continue
        base = f"sys/{pci_root}/{pf}"
        if model.sriov:
            f(f"{base}/sriov_totalvfs", f"{model.total_vfs}\n")
            f(f"{base}/sriov_numvfs", f"{len(v.vfs)}\n", 0o644)
            f(f"{base}/sriov_offset", f"{VF_OFFSET}\n")
            f(f"{base}/sriov_stride", "1\n")
            for i, vf in enumerate(v.vfs):
                ln(f"{base}/virtfn{i}", f"../{vf.address}")
        if fn.driver != "nvidia":
            continue
        types = sim_types(model)
        if v.interface == "vfio":
            for vf in v.vfs:
                vbase = f"sys/{pci_root}/{vf.address}/nvidia"
                d(vbase)
                lines = [CREATABLE_HEADER] + [f"{t.vfio_id:<5} : {model.prefix}{t.name}"
                                              for t in creatable(st, pf, vf.address)]
                f(f"{vbase}/creatable_vgpu_types", "\n".join(lines) + "\n")
                f(f"{vbase}/current_vgpu_type", f"{vf.vgpu_type}\n", 0o644)
                gi = vf.gpu_instance_id if vf.vgpu_type else -1
                f(f"{vbase}/gpu_instance_id", f"{gi}\n")
                f(f"{vbase}/placement_id", f"{_placement(st, pf, gi)}\n")
                if vf.vgpu_type:
                    vfn = st.functions.get(vf.address)
                    if vfn is not None and vfn.iommu_group is not None:
                        d("dev/vfio")
                        f("dev/vfio/vfio", "", 0o666)
                        f(f"dev/vfio/{vfn.iommu_group}", "", 0o600)
            continue
        any_mdev = True
        for parent in parents(st, pf):
            pbase = f"sys/{pci_root}/{parent}"
            d(f"{pbase}/mdev_supported_types")
            ln(f"sys/class/mdev_bus/{parent}", f"../../{pci_root}/{parent}")
            for t in types:
                tbase = f"{pbase}/mdev_supported_types/nvidia-{t.mdev_id}"
                d(tbase)
                f(f"{tbase}/name", f"{model.prefix}{t.name}\n")
                f(f"{tbase}/description", f"num_heads=4, frl_config=60, framebuffer={t.type.parsed.framebuffer_gb * 1024}M, "
                                          f"max_resolution=5120x2880, max_instance={t.type.max_instances}\n")
                f(f"{tbase}/available_instances", f"{available_instances(st, pf, parent, t)}\n")
                f(f"{tbase}/device_api", "vfio-pci\n")
                f(f"{tbase}/create", "", 0o200)
                d(f"{tbase}/devices")
                for m in v.mdevs:
                    if m.parent == parent and m.type_id == t.mdev_id:
                        ln(f"{tbase}/devices/{m.uuid}", f"../../../{m.uuid}")
        for m in v.mdevs:
            mbase = f"sys/{pci_root}/{m.parent}/{m.uuid}"
            d(mbase)
            ln(f"{mbase}/mdev_type", f"../mdev_supported_types/nvidia-{m.type_id}")
            f(f"{mbase}/remove", "", 0o200)
            ln(f"{mbase}/iommu_group", f"../../../../kernel/iommu_groups/{m.iommu_group}")
            ln(f"{mbase}/subsystem", "../../../../bus/mdev")
            ln(f"{mbase}/driver", f"../../../../bus/mdev/drivers/{MDEV_DRIVER}")
            ln(f"sys/bus/mdev/devices/{m.uuid}", f"../../../{pci_root}/{m.parent}/{m.uuid}")
            d(f"sys/kernel/iommu_groups/{m.iommu_group}")
            d(f"sys/kernel/iommu_groups/{m.iommu_group}/devices")
            ln(f"sys/kernel/iommu_groups/{m.iommu_group}/devices/{m.uuid}",
               f"../../../../{pci_root}/{m.parent}/{m.uuid}")
            d("dev/vfio")
            f("dev/vfio/vfio", "", 0o666)
            f(f"dev/vfio/{m.iommu_group}", "", 0o600)
    if any_mdev:
        for p in ("sys/class", "sys/class/mdev_bus", "sys/bus/mdev", "sys/bus/mdev/devices", "sys/bus/mdev/drivers",
                  f"sys/bus/mdev/drivers/{MDEV_DRIVER}"):
            d(p)


def _placement(st: SimState, pf: str, gi_id: int) -> int:
    gpu = st.gpus.get(pf)
    if gpu is None or gi_id < 0:
        return -1
    gi = next((g for g in gpu.gis if g.id == gi_id), None)
    return gi.start if gi is not None else -1


# ---- kernel write semantics (called by gpud.sim.kernel.Store)

# PF drivers with a `.sriov_configure` callback: pci-pf-stub (pci_sriov_configure_simple) and
# vfio-pci (vfio_pci_core_sriov_configure). The nvidia driver has none (nv-pci.c): on a PF bound
# to nvidia the kernel answers ENOENT ("driver does not support SR-IOV configuration via sysfs").
SRIOV_CONFIGURE = ("pci-pf-stub", "vfio-pci")


def sriov_numvfs(st: SimState, pf: str, data: bytes, path: str, events: list) -> None:
    """drivers/pci/iov.c sriov_numvfs_store: ERANGE above sriov_totalvfs; the same count is a no-op;
    ENOENT with no driver bound or one without sriov_configure (nvidia); EBUSY to change a non-zero
    count. VFs probe their driver (nvidia) as they appear (sriov_drivers_autoprobe)."""
    n = kstrtou(data, path, 16)
    fn = st.functions.get(pf)
    v = st.vgpu.get(pf)
    model = vgpu_model(st, pf)
    if fn is None or not fn.present or v is None or model is None or not model.sriov:
        raise sysfs_error(errno.ENOENT, path)
    if n > model.total_vfs:
        raise sysfs_error(errno.ERANGE, path)
    if n == len(v.vfs):
        return
    if fn.driver not in SRIOV_CONFIGURE:
        raise sysfs_error(errno.ENOENT, path)
    if n == 0:
        # NVIDIA's choice (not the kernel's): VFs carrying vGPUs are not torn down.
        if any(vf.vgpu_type for vf in v.vfs) or v.mdevs:
            raise sysfs_error(errno.EBUSY, path)
        for vf in v.vfs:
            vfn = st.functions.pop(vf.address, None)
            if vfn is not None and vfn.driver:
                events.append(_event("unbind", "pci", vf.address, None))
            events.append(_event("remove", "pci", vf.address, None))
        v.vfs = []
        return
    if v.vfs:
        raise sysfs_error(errno.EBUSY, path)
    for i in range(n):
        address = vf_address(pf, i)
        st.functions[address] = SimFunction(
            address=address, vendor=fn.vendor, device=fn.device, subsystem_vendor=fn.subsystem_vendor,
            subsystem_device=fn.subsystem_device, class_code=fn.class_code, revision=fn.revision,
            native_driver="nvidia", driver="nvidia", iommu_group=_next_group(st), numa_node=fn.numa_node,
            physfn=pf)
        v.vfs.append(SimVf(address=address))
        events.append(_event("add", "pci", address, None))
        events.append(_event("bind", "pci", address, "nvidia"))
    st.functions = dict(sorted(st.functions.items()))


def current_vgpu_type(st: SimState, vf_addr: str, data: bytes, path: str, events: list) -> None:
    """`<VF>/nvidia/current_vgpu_type`: an id from the VF's creatable list creates, 0 frees.
    NVIDIA's choices, modelled: a VF that has a type must be freed first (EBUSY), an id not in its
    creatable list is EINVAL, and a VF a VM holds open cannot be freed (EBUSY)."""
    type_id = kstrtou(data, path, 32)
    found = owner(st, vf_addr)
    if found is None:
        raise sysfs_error(errno.ENOENT, path)
    pf, v = found
    vf = next(x for x in v.vfs if x.address == vf_addr)
    if type_id == 0:
        if vf.vgpu_type and holders_of(st, vf_addr):
            raise sysfs_error(errno.EBUSY, path)
        vf.vgpu_type, vf.gpu_instance_id = 0, -1
        events.append(_event("change", "pci", vf_addr, "nvidia"))
        return
    if vf.vgpu_type:
        raise sysfs_error(errno.EBUSY, path)
    stype = next((t for t in creatable(st, pf, vf_addr) if t.vfio_id == type_id), None)
    if stype is None:
        raise sysfs_error(errno.EINVAL, path)
    gi_id = _free_gi(st, pf, stype) if stype.profile else None
    vf.gpu_instance_id = -1 if gi_id is None else gi_id
    vf.vgpu_type = type_id
    events.append(_event("change", "pci", vf_addr, "nvidia"))


def mdev_create(st: SimState, parent: str, type_dir: str, data: bytes, path: str, events: list) -> None:
    """mdev_sysfs.c create_store + mdev_device_create; the vendor driver refuses a type with no
    available instance (ENOSPC, as the kernel's mtty sample does)."""
    if len(data) < 36 or len(data) > 37:
        raise sysfs_error(errno.EINVAL, path)
    text = data[:36].decode("ascii", "replace")
    if not _UUID.fullmatch(text):
        raise sysfs_error(errno.EINVAL, path)
    uuid = text.lower()
    found = owner(st, parent)
    if found is None or not type_dir.startswith("nvidia-"):
        raise sysfs_error(errno.ENOENT, path)
    pf, v = found
    if find_mdev(st, uuid) is not None:
        raise sysfs_error(errno.EEXIST, path)
    model = vgpu_model(st, pf)
    stype = next((t for t in sim_types(model) if f"nvidia-{t.mdev_id}" == type_dir), None) if model else None
    if stype is None:
        raise sysfs_error(errno.ENOENT, path)
    if available_instances(st, pf, parent, stype) < 1:
        raise sysfs_error(errno.ENOSPC, path)
    gi = _free_gi(st, pf, stype) if stype.profile else -1
    v.mdevs.append(SimMdev(uuid=uuid, parent=parent, type_id=stype.mdev_id, iommu_group=_next_group(st),
                           gpu_instance_id=gi if gi is not None else -1))
    events.append(_event("add", "mdev", uuid, None))
    events.append(_event("bind", "mdev", uuid, "nvidia-vgpu-vfio"))


def mdev_remove_now(st: SimState, uuid: str, events: list) -> bool:
    """Remove the mdev if nothing holds it; False while a VM has it open (the writer waits)."""
    found = find_mdev(st, uuid)
    if found is None:
        return True
    pf, m = found
    if holders_of(st, m.uuid):
        return False
    st.vgpu[pf].mdevs.remove(m)
    events.append(_event("unbind", "mdev", m.uuid, None))
    events.append(_event("remove", "mdev", m.uuid, None))
    return True



class _KernelStore(Protocol):
    """The simulated kernel's write path (gpud.sim.kernel.Store, which imports this module)."""

    dir: str
    poll_interval: float
    on_block: Callable[[str], None] | None

    def _change(self, fn: Callable[[SimState, list[Uevent]], object]) -> object: ...


def mdev_remove(store: _KernelStore, uuid: str, data: bytes, path: str) -> None:
    """mdev_sysfs.c remove_store: 0 does nothing; otherwise the device goes, and while a VM holds it
    open the write blocks (6.1: vfio_unregister_group_dev waits for the release)."""

    value = kstrtou(data, path, 64)
    if not value:
        return
    while True:
        if store._change(lambda st, events: mdev_remove_now(st, uuid, events)):
            return
        if store.on_block is not None:
            store.on_block(uuid)
        time.sleep(store.poll_interval)
        with locked(store.dir, write=False) as st:
            if find_mdev(st, uuid) is None:
                return


def clear_for_reboot(st: SimState) -> None:
    """What a reboot or a driver reload does to the vGPU side (cozystack/ansible-cozystack#70 in
    docs/vgpu.md): VFs disabled (sriov_numvfs 0, their PCI functions gone), every vendor-VFIO type
    and every mdev gone, and the VMs that held them with them. Called on a locked state; the caller
    renders the trees (`gpud-sim reboot` does the rest of a reboot)."""
    vgpu_devices = {vf.address for v in st.vgpu.values() for vf in v.vfs} | {
        m.uuid for v in st.vgpu.values() for m in v.mdevs}
    st.processes = [p for p in st.processes if p.device.lower() not in vgpu_devices]
    for v in st.vgpu.values():
        for vf in v.vfs:
            st.functions.pop(vf.address, None)
        v.vfs, v.mdevs = [], []


def setup(st: SimState, interface: str) -> None:
    """`gpud-sim create --vgpu vfio|mdev`: every vGPU-capable GPU gets that interface where it has
    it (a card without SR-IOV, e.g. T4, has only mdev; the RTX PRO 6000 Blackwell only vfio)."""
    if interface not in INTERFACES:
        raise ValueError(f"--vgpu {interface!r}: expected one of {', '.join(INTERFACES)}")
    for address in st.gpus:
        model = vgpu_model(st, address)
        if model is not None:
            shown = interface if model.sriov else "mdev"
            st.vgpu[address] = SimVgpu(interface=shown if model.mdev else "vfio")
