"""vGPUs through sysfs, on either host interface, found out per GPU at run time.

- vendor-specific VFIO (SR-IOV, the newer stack): the GPU's VFs (`sriov_numvfs`, `virtfnN`) each
  have `nvidia/creatable_vgpu_types` (header, then `ID : Name` lines), `nvidia/current_vgpu_type`
  (write an id to create, `0` to free) and `nvidia/gpu_instance_id` for MIG-backed types;
- mdev (the older stack): `<parent>/mdev_supported_types/nvidia-N/{name,available_instances,create}`
  and `/sys/bus/mdev/devices/<uuid>/remove`; the parents are the VFs on SR-IOV GPUs (A100), the
  GPU itself otherwise (T4).

The interface is never inferred from the GPU's generation: a GPU with `mdev_supported_types` on
itself is mdev; an SR-IOV GPU is whichever its first VF shows; an SR-IOV GPU without VFs is
`sriov` until they are enabled. Each write is one `os.write` (through `Sysfs.write`), errors come
back with what they mean for that attribute. A vGPU's holders are the processes with its
`/dev/vfio/<group>` open, named with the VM from a qemu command line (`-name guest=<vm>`).

Type ids are only numbers: names come from the creatable lists (remembered once seen, in
`names_file` so a daemon restart on a full GPU still names its vGPUs) and from gpud.vgpu_types.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re

from gpud.host.files import state_files
from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs, SysfsError
from gpud.model import Holder, VgpuDevice, VgpuOffer, VgpuState
from gpud.vgpu_types import by_device, strip_prefix

log = logging.getLogger(__name__)

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_VIRTFN = re.compile(r"virtfn(\d+)")

MEANINGS: dict[tuple[str, int], str] = {
    ("sriov_numvfs", errno.ERANGE): "more VFs than the GPU's sriov_totalvfs",
    ("sriov_numvfs", errno.EBUSY): "VFs are enabled already (the count changes only from 0), or a VF still carries a vGPU",
    ("sriov_numvfs", errno.ENOENT): "the GPU's driver cannot enable SR-IOV through sysfs (nvidia has no "
                                    "sriov_configure: NVIDIA's sriov-manage does it), or no driver is bound",
    ("current_vgpu_type", errno.EINVAL): "this type is not creatable on this VF now (its creatable list lacks it)",
    ("current_vgpu_type", errno.EBUSY): "the VF already carries a vGPU, or a VM holds it",
    ("current_vgpu_type", errno.EIO): "the driver failed to set up the vGPU: for a MIG-backed type check that its "
                                      "GPU instance exists (enabling VFs through sriov-manage destroys every "
                                      "GPU instance), then the kernel log (NVRM lines) and nvidia-vgpu-mgr",
    ("current_vgpu_type", errno.EPERM): "the driver does not permit this change on this VF: check that the VF is "
                                        "on nvidia, that the GPU's mode fits the type (MIG mode on for MIG-backed "
                                        "types, off for time-sliced ones) and that nvidia-vgpu-mgr runs",
    ("create", errno.EEXIST): "an mdev with this UUID exists already",
    ("create", errno.EINVAL): "not a UUID",
    ("create", errno.ENOSPC): "no instance of this type is available on this parent",
    ("create", errno.EUSERS): "no instance of this type is available on this parent",
    ("remove", errno.ENODEV): "no such mdev",
    ("remove", errno.EAGAIN): "the mdev is being created or removed",
}


class VgpuError(SysfsError):
    pass


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return None


def _int(text: str | None, default: int = 0) -> int:
    try:
        return int(text, 0) if text is not None else default
    except ValueError:
        return default


def uevent_pci_id(text: str | None) -> str | None:
    """The `PCI_ID=10DE:26B9` line of a PCI device's uevent, upper-case: the id KubeVirt's PCI
    device plugin reads (pkg/virt-handler/device-manager/common.go, GetDevicePCIID)."""
    for line in (text or "").splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "PCI_ID" and value.strip():
            return value.strip().upper()
    return None


def parse_creatable(text: str) -> list[tuple[int, str]]:
    """`creatable_vgpu_types` -> [(id, bare name)]; the header line and blank lines are skipped."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(":")
        if not sep:
            continue
        try:
            type_id = int(left.strip())
        except ValueError:
            continue  # the header ("ID    : vGPU Name")
        out.append((type_id, strip_prefix(right.strip())))
    return out


def vfio_cdevs(device_dir: str) -> list[str]:
    """The vfio cdev names (`vfioN`) a device's sysfs directory lists under `vfio-dev/`."""
    try:
        return sorted(e for e in os.listdir(os.path.join(device_dir, "vfio-dev")) if e.startswith("vfio"))
    except OSError:
        return []


def qemu_vm_name(proc_root: str, pid: int) -> str | None:
    """The guest name of a qemu process: `-name guest=web-1,debug-threads=on` or `-name web-1`."""
    try:
        with open(os.path.join(proc_root, str(pid), "cmdline"), "rb") as f:
            args = f.read().decode("utf-8", "replace").split("\0")
    except OSError:
        return None
    for i, arg in enumerate(args[:-1]):
        if arg in ("-name", "--name"):
            for part in args[i + 1].split(","):
                key, sep, value = part.partition("=")
                if not sep:
                    return key or None
                if key == "guest":
                    return value or None
    return None


NAMES_FILE = "vgpu-names.json"  # in the state directory: the type name table of the last good read


def names_path(state_dir: str | None) -> str | None:
    """Where the name table lives for a state directory (None: no state directory, no table)."""
    return os.path.join(state_dir, NAMES_FILE) if state_dir else None


class VgpuSysfs:
    def __init__(self, sysfs: Sysfs, procs: Procs, *, names_file: str | None = None):
        self.sysfs = sysfs
        self.procs = procs
        self.names_file = names_file
        self._names: dict[str, dict[int, str]] = self._load_names()  # "10de:26b9" -> id -> name

    # ---- type names
    def _load_names(self) -> dict[str, dict[int, str]]:
        if self.names_file is None:
            return {}
        def decode(data: bytes) -> dict[str, dict[int, str]]:
            raw = json.loads(data)
            if not isinstance(raw, dict) or not all(isinstance(v, dict) and all(isinstance(n, str) for n in v.values())
                                                    for v in raw.values()):
                raise state_files.BadStateFile("expected {device: {type id: name}}")
            return {str(k): {int(i): n for i, n in v.items()} for k, v in raw.items()}
        return state_files.load(self.names_file, decode, what="vGPU type name table") or {}

    def _learn(self, device_key: str, pairs: list[tuple[int, str]]) -> None:
        known = self._names.setdefault(device_key, {})
        new = {i: n for i, n in pairs if known.get(i) != n}
        if not new:
            return
        known.update(new)
        if self.names_file is not None:
            body = json.dumps({k: {str(i): n for i, n in v.items()} for k, v in self._names.items()})
            try:
                state_files.save(self.names_file, body.encode())
            except OSError as e:  # only a cache of names: the next read learns them again
                log.warning("%s: not written (%s)", self.names_file, e)

    def _name_of(self, device: int, type_id: int) -> str:
        name = self._names.get(f"10de:{device:04x}", {}).get(type_id)
        if name is None and (model := by_device(device)) is not None:
            name = next((t.name for t in model.types if type_id in (t.vfio_id, t.mdev_id)), None)
        return name or f"type-{type_id}"

    # ---- reading
    def _dev(self, *parts: str) -> str:
        return os.path.join(self.sysfs.root, "bus/pci/devices", *parts)

    def _parent_rel(self, parent: str) -> str:
        """sysfs path (relative to the root) of an mdev parent: `class/mdev_bus/<parent>` lists every
        registered parent, PCI or not (the kernel's mtty sample registers a virtual one)."""
        if os.path.exists(os.path.join(self.sysfs.root, "class/mdev_bus", parent)):
            return f"class/mdev_bus/{parent}"
        return f"bus/pci/devices/{parent}"

    def _parent(self, parent: str, *parts: str) -> str:
        return os.path.join(self.sysfs.root, self._parent_rel(parent), *parts)

    def vfs(self, pf: str) -> list[str]:
        try:
            entries = os.listdir(self._dev(pf))
        except OSError:
            return []
        found = sorted((int(m.group(1)), e) for e in entries if (m := _VIRTFN.fullmatch(e)))
        return [os.path.basename(os.readlink(self._dev(pf, e))) for _, e in found]

    def interface(self, pf: str, vfs: list[str] | None = None) -> str | None:
        if os.path.isdir(self._parent(pf, "mdev_supported_types")):
            return "mdev"
        if not os.path.exists(self._dev(pf, "sriov_totalvfs")):
            return None  # neither interface: two stat calls for every GPU without vGPUs
        vfs = self.vfs(pf) if vfs is None else vfs
        if vfs:
            if os.path.exists(self._dev(vfs[0], "nvidia", "creatable_vgpu_types")):
                return "vfio"
            if os.path.isdir(self._dev(vfs[0], "mdev_supported_types")):
                return "mdev"
        if _int(_read(self._dev(pf, "sriov_totalvfs"))) > 0:
            return "sriov"
        return None

    def _group(self, path: str) -> int | None:
        try:
            return int(os.path.basename(os.readlink(os.path.join(path, "iommu_group"))))
        except (OSError, ValueError):
            return None

    def _holders(self, group: int | None, device: str, path: str | None = None) -> tuple[Holder, ...]:
        """Processes with the vGPU open: through /dev/vfio/<group>, or through its vfio cdev
        (`<dev>/vfio-dev/vfioN` -> /dev/vfio/devices/vfioN, kernels 6.8+), which an iommufd VMM
        opens instead of the group."""
        paths = [f"/dev/vfio/{group}"] if group is not None else []
        if path is not None:
            paths += [f"/dev/vfio/devices/{n}" for n in vfio_cdevs(path)]
        if not paths:
            return ()
        found = self.procs.holders(paths)
        return tuple(Holder(pid=h.pid, name=h.name, device=device,
                            vm=qemu_vm_name(self.procs.proc_root, h.pid)) for h in found)

    def read(self, pf: str) -> VgpuState:
        if self.interface(pf, []) is None:
            return VgpuState(interface=None)
        device = _int(_read(self._dev(pf, "device")))
        key = f"10de:{device:04x}"
        vfs = self.vfs(pf)
        interface = self.interface(pf, vfs)
        total = _int(_read(self._dev(pf, "sriov_totalvfs")))
        model = by_device(device)
        counts: dict[str, list] = {}  # name -> [type id, parents that can take one more]
        devices: list[VgpuDevice] = []
        if interface == "vfio":
            for vf in vfs:
                pairs = parse_creatable(_read(self._dev(vf, "nvidia", "creatable_vgpu_types")) or "")
                self._learn(key, pairs)
                current = _int(_read(self._dev(vf, "nvidia", "current_vgpu_type")))
                if current:
                    gi = _int(_read(self._dev(vf, "nvidia", "gpu_instance_id")), -1)
                    group = self._group(self._dev(vf))
                    devices.append(VgpuDevice(type=self._name_of(device, current), parent=vf, vf=vf,
                                              type_id=current, gi=gi if gi >= 0 else None, vfio_group=group,
                                              holders=self._holders(group, vf, self._dev(vf)),
                                              pci_id=uevent_pci_id(_read(self._dev(vf, "uevent")))))
                    continue
                for type_id, name in pairs:
                    counts.setdefault(name, [type_id, 0])[1] += 1
        elif interface == "mdev":
            parents = [pf] if os.path.isdir(self._parent(pf, "mdev_supported_types")) else vfs
            for parent in parents:
                tdir = self._parent(parent, "mdev_supported_types")
                try:
                    type_dirs = sorted(os.listdir(tdir))
                except OSError:
                    continue
                for t in type_dirs:
                    name = strip_prefix(_read(os.path.join(tdir, t, "name")) or t)
                    type_id = _int(t.rpartition("-")[2], -1)
                    self._learn(key, [(type_id, name)])
                    entry = counts.setdefault(name, [type_id, 0])
                    entry[1] += _int(_read(os.path.join(tdir, t, "available_instances")))
                for e in sorted(os.listdir(self._parent(parent))):
                    if not _UUID.fullmatch(e):
                        continue
                    mpath = self._parent(parent, e)
                    try:
                        tname = os.path.basename(os.readlink(os.path.join(mpath, "mdev_type")))
                    except OSError:
                        continue
                    printed = (_read(os.path.join(mpath, "mdev_type", "name")) or "").strip() or None
                    name = strip_prefix(printed or _read(os.path.join(tdir, tname, "name")) or tname)
                    group = self._group(mpath)
                    devices.append(VgpuDevice(type=name, parent=parent, uuid=e, type_id=_int(tname.rpartition("-")[2], -1),
                                              vfio_group=group, holders=self._holders(group, e, mpath),
                                              gi=self._mdev_gi(mpath), driver_name=printed))
        offers = []
        for name, (type_id, n) in counts.items():
            vtype = model.find(name) if model is not None else None
            if vtype is not None:  # a free VF lists a type it could take; the GPU caps the total
                same = sum(1 for d in devices if d.type == name)
                n = min(n, max(0, vtype.max_instances - same))
            offers.append(VgpuOffer(type=name, type_id=type_id, creatable=n))
        return VgpuState(interface=interface, total_vfs=total, vfs=tuple(vfs), offers=tuple(offers),
                         devices=tuple(devices))

    def _mdev_gi(self, mpath: str) -> int | None:
        gi = _read(os.path.join(mpath, "nvidia", "gpu_instance_id"))
        return _int(gi, -1) if gi is not None and _int(gi, -1) >= 0 else None

    # ---- writing (one os.write each, through Sysfs.write)
    def _write(self, relpath: str, value: str) -> None:
        try:
            self.sysfs.write(relpath, value)
        except SysfsError as e:
            name = os.path.basename(relpath)
            text = MEANINGS.get((name, e.errno or 0))
            if text is None:
                raise
            raise VgpuError(e.errno or 0, text, e.path) from e

    def set_num_vfs(self, pf: str, count: int) -> None:
        """The raw kernel write: refused (ENOENT) while nvidia is bound; gpud enables an NVIDIA GPU's
        VFs through gpud.host.nvidia.sriov_manage instead."""
        self._write(f"bus/pci/devices/{pf}/sriov_numvfs", str(count))

    def set_vf_type(self, vf: str, type_id: int) -> None:
        """Give the VF a vGPU type (its id from the VF's creatable list), or free it with 0."""
        self._write(f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", str(type_id))

    def creatable_on(self, vf: str) -> list[tuple[int, str]]:
        return parse_creatable(_read(self._dev(vf, "nvidia", "creatable_vgpu_types")) or "")

    def mdev_types(self, parent: str) -> dict[str, tuple[str, int]]:
        """bare type name -> (type directory, available_instances) on one mdev parent."""
        tdir = self._parent(parent, "mdev_supported_types")
        out = {}
        try:
            entries = sorted(os.listdir(tdir))
        except OSError:
            return {}
        for t in entries:
            name = strip_prefix(_read(os.path.join(tdir, t, "name")) or t)
            out[name] = (t, _int(_read(os.path.join(tdir, t, "available_instances"))))
        return out

    def create_mdev(self, parent: str, type_dir: str, uuid: str) -> None:
        self._write(f"{self._parent_rel(parent)}/mdev_supported_types/{type_dir}/create", uuid)

    def remove_mdev(self, uuid: str) -> None:
        """Remove an mdev. The caller checks holders first: on a 6.1 kernel the write blocks until a
        VM that has the device open closes it (docs/vgpu.md)."""
        self._write(f"bus/mdev/devices/{uuid}/remove", "1")
