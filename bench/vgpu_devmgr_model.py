"""A model of NVIDIA vgpu-device-manager's apply (cmd/nvidia-vgpu-dm/apply/config.go and
pkg/vgpu/config.go at commit acb72704), run against the same simulated sysfs as gpud.

Per GPU of the config:
1. Count the GPU's mdevs by type; equal to the config -> skip the GPU.
2. Parents: the mdev parents whose physical function is the GPU; none -> fail ("no parent devices
   found for GPU at index N": every vendor-VFIO host, where VFs carry no mdev_supported_types).
3. Every type must be supported by the first parent, else fail.
4. Clear: delete every mdev of the GPU (busy or not: on a 6.1 kernel the write to `remove` of an
   mdev a VM holds open blocks until the VM lets go; the model stops there and reports it).
5. Create, per type, on parents with available instances, each mdev with a fresh random UUID; too
   few instances -> fail, with whatever was created so far left in place.
VFs are enabled beforehand, as the GPU Operator's vGPU manager container does with sriov-manage
(those writes are counted too). MIG-backed types rely on mig-parted having run first (the
scenarios preset the MIG layout).
"""

from __future__ import annotations

import os
import uuid

from gpud.host.kernel.sysfs import Sysfs, SysfsError
from gpud.vgpu_types import strip_prefix


class DevMgrFailed(Exception):
    pass


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _parents(sysfs: Sysfs, pf: str) -> list[str]:
    base = os.path.join(sysfs.root, "bus/pci/devices", pf)
    if os.path.isdir(os.path.join(base, "mdev_supported_types")):
        return [pf]
    vfs = sorted((int(e[6:]), os.path.basename(os.readlink(os.path.join(base, e))))
                 for e in os.listdir(base) if e.startswith("virtfn"))
    return [vf for _, vf in vfs if os.path.isdir(os.path.join(sysfs.root, "bus/pci/devices", vf, "mdev_supported_types"))]


def _types(sysfs: Sysfs, parent: str) -> dict[str, str]:
    tdir = os.path.join(sysfs.root, "bus/pci/devices", parent, "mdev_supported_types")
    return {strip_prefix(_read(os.path.join(tdir, t, "name"))): t for t in sorted(os.listdir(tdir))}


def _mdevs(sysfs: Sysfs, parents: list[str]) -> list[tuple[str, str, str]]:
    """(parent, uuid, type name) of the GPU's mdevs."""
    out = []
    for p in parents:
        base = os.path.join(sysfs.root, "bus/pci/devices", p)
        names = {v: k for k, v in _types(sysfs, p).items()}
        for e in sorted(os.listdir(base)):
            link = os.path.join(base, e, "mdev_type")
            if os.path.islink(link):
                out.append((p, e, names[os.path.basename(os.readlink(link))]))
    return out


def apply(sysfs: Sysfs, pf: str, config: dict[str, int], *, held: set[str], total_vfs: int) -> None:
    """Apply `config` to the GPU at `pf` the way vgpu-device-manager does; raises DevMgrFailed."""
    base = os.path.join(sysfs.root, "bus/pci/devices", pf)
    if total_vfs and _read(os.path.join(base, "sriov_numvfs")) == "0":
        sysfs.write(f"bus/pci/devices/{pf}/sriov_numvfs", str(total_vfs))
    parents = _parents(sysfs, pf)
    current: dict[str, int] = {}
    for _, _, name in _mdevs(sysfs, parents):
        current[name] = current.get(name, 0) + 1
    if current == {k: v for k, v in config.items() if v > 0}:
        return
    if not parents:
        raise DevMgrFailed(f"no parent devices found for GPU {pf}")
    supported = _types(sysfs, parents[0])
    for name in config:
        if name not in supported:
            raise DevMgrFailed(f"vGPU type {name} is not supported on GPU {pf}")
    for _parent, mdev, name in _mdevs(sysfs, parents):
        if mdev in held:
            raise DevMgrFailed(f"deleting {name} {mdev}: the remove write blocks while a VM holds it (6.1 kernel)")
        sysfs.write(f"bus/mdev/devices/{mdev}/remove", "1")
    for name, count in config.items():
        remaining = count
        for parent in parents:
            if remaining == 0:
                break
            tdir = _types(sysfs, parent)[name]
            available = int(_read(os.path.join(sysfs.root, "bus/pci/devices", parent, "mdev_supported_types", tdir,
                                               "available_instances")))
            for _ in range(min(remaining, max(0, available))):
                try:
                    sysfs.write(f"bus/pci/devices/{parent}/mdev_supported_types/{tdir}/create", str(uuid.uuid4()))
                except SysfsError as e:
                    raise DevMgrFailed(f"unable to create {name} on {parent}: {e}") from e
                remaining -= 1
        if remaining > 0:
            raise DevMgrFailed(f"failed to create {count} {name} vGPU devices on the GPU")
