"""What a VM manager needs to use each vGPU gpud made: a libvirt <hostdev> and KubeVirt entries.

- An mdev is named by its UUID: `<hostdev mode='subsystem' type='mdev' model='vfio-pci'>` with
  `<address uuid=.../>`; KubeVirt permits it with `mediatedDevices: [{mdevNameSelector: <the mdev
  type's name>, resourceName: ..., externalResourceProvider: true}]`: the selector is matched
  against the type's `name` file, and NVIDIA's kubevirt-gpu-device-plugin, not KubeVirt, advertises
  the resource (external). Its resource name is `nvidia.com/` + the `mdev_type/name` the plugin
  reads from sysfs, spaces turned into `_` (`GRID A100-10C` -> `nvidia.com/GRID_A100-10C` on an
  R580 A100 host): read from the device, the model's prefix table is only the fallback.
- A vendor-VFIO vGPU is its VF: a plain PCI hostdev of the VF, `managed='no'`, because the VF must
  stay on the nvidia driver (libvirt's managed mode would move it to vfio-pci, which refuses it).
  KubeVirt's own PCI device plugin advertises such VFs (kubevirt#16890: a VF on `nvidia` with a
  non-zero `current_vgpu_type`), so the entry is `externalResourceProvider: false`; the resource is
  named `nvidia.com/` + the type as the driver prints it in `creatable_vgpu_types`, spaces turned
  into `_` (`NVIDIA L40S-12Q` -> `nvidia.com/NVIDIA_L40S-12Q`), the name KubeVirt's VMs request.
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
    name = dev.driver_name or printed_name(device_id, dev.type)
    resource = vgpu_resource(name)
    vfio = f"/dev/vfio/{dev.vfio_group}" if dev.vfio_group is not None else None
    if dev.uuid is not None:
        return VgpuEntry(gpu=gpu, type=dev.type, driver_name=name, uuid=dev.uuid, vf=None, vfio_device=vfio,
                         resource_name=resource, libvirt_hostdev=mdev_hostdev(dev.uuid),
                         kubevirt={"mediatedDevices": [{"mdevNameSelector": name, "resourceName": resource,
                                                        "externalResourceProvider": True}]})
    return VgpuEntry(gpu=gpu, type=dev.type, driver_name=name, uuid=None, vf=dev.vf, vfio_device=vfio,
                     resource_name=resource, libvirt_hostdev=pci_hostdev(dev.vf or dev.parent),
                     kubevirt={"pciHostDevices": [{"pciVendorSelector": f"10DE:{device_id:04X}",
                                                   "resourceName": resource, "externalResourceProvider": False}]})
