"""What a VM manager needs to use each vGPU gpud made: a libvirt <hostdev> and KubeVirt entries.

- An mdev is named by its UUID: `<hostdev mode='subsystem' type='mdev' model='vfio-pci'>` with
  `<address uuid=.../>`; KubeVirt permits it with `mediatedDevices: [{mdevNameSelector: <the mdev
  type's name>, resourceName: ...}]` (the selector is matched against the type's `name` file).
- A vendor-VFIO vGPU is its VF: a plain PCI hostdev of the VF, `managed='no'`, because the VF must
  stay on the nvidia driver (libvirt's managed mode would move it to vfio-pci, which refuses it);
  KubeVirt (v1.9+, kubevirt#16890) advertises such VFs through `pciHostDevices`, per type only with
  an external device plugin, hence `externalResourceProvider: true`.
Resource names follow NVIDIA's kubevirt-gpu-device-plugin: `nvidia.com/` + the type name as the
driver prints it, spaces turned into `_` (`NVIDIA L40S-12Q` -> `nvidia.com/NVIDIA_L40S-12Q`).
"""

from __future__ import annotations

from msgspec import Struct

from gpud.kubevirt_names import vgpu_resource
from gpud.model import VgpuDevice
from gpud.vgpu_types import printed_name


class VgpuEntry(Struct, frozen=True):
    gpu: str  # PCI address of the physical GPU
    type: str  # bare type name: "L40S-12Q"
    driver_name: str  # the type as the driver prints it: "NVIDIA L40S-12Q"
    uuid: str | None  # mdev UUID
    vf: str | None  # VF PCI address (vendor VFIO)
    vfio_device: str | None  # "/dev/vfio/<group>"
    resource_name: str
    libvirt_hostdev: str
    kubevirt: dict


def mdev_hostdev(uuid: str) -> str:
    return ("<hostdev mode='subsystem' type='mdev' model='vfio-pci' display='off'>"
            f"<source><address uuid='{uuid}'/></source></hostdev>")


def pci_hostdev(address: str) -> str:
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return ("<hostdev mode='subsystem' type='pci' managed='no'><source>"
            f"<address domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'/>"
            "</source></hostdev>")


def entry(gpu: str, device_id: int, dev: VgpuDevice) -> VgpuEntry:
    name = printed_name(device_id, dev.type)
    resource = vgpu_resource(name)
    vfio = f"/dev/vfio/{dev.vfio_group}" if dev.vfio_group is not None else None
    if dev.uuid is not None:
        return VgpuEntry(gpu=gpu, type=dev.type, driver_name=name, uuid=dev.uuid, vf=None, vfio_device=vfio,
                         resource_name=resource, libvirt_hostdev=mdev_hostdev(dev.uuid),
                         kubevirt={"mediatedDevices": [{"mdevNameSelector": name, "resourceName": resource}]})
    return VgpuEntry(gpu=gpu, type=dev.type, driver_name=name, uuid=None, vf=dev.vf, vfio_device=vfio,
                     resource_name=resource, libvirt_hostdev=pci_hostdev(dev.vf or dev.parent),
                     kubevirt={"pciHostDevices": [{"pciVendorSelector": f"10DE:{device_id:04X}",
                                                   "resourceName": resource, "externalResourceProvider": True}]})
