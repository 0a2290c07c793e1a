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
  KubeVirt's own PCI device plugin advertises such VFs (kubevirt#16890, v1.9), so the entry is
  `externalResourceProvider: false`. How KubeVirt v1.9 takes them (pkg/virt-handler/device-manager:
  device_controller.go, pci_device.go, nvidia.go, common.go): it keys one plugin per lower-cased
  `pciVendorSelector` (a later entry with the same selector replaces an earlier one), walks
  /sys/bus/pci/devices, reads each function's `PCI_ID` from its uevent, and puts under that
  selector's resource every matching function on vfio-pci and every matching one on `nvidia` that is
  no PF (no `sriov_totalvfs`) and has a `nvidia/current_vgpu_type` other than 0. So the selector is
  the VF's own PCI id as its uevent says, one entry per id, and the resource cannot tell vGPU types
  apart: the VFs of one id with one type are `nvidia.com/` + the type as the driver prints it
  (`NVIDIA L40S-12Q` -> `nvidia.com/NVIDIA_L40S-12Q`), with several types
  `nvidia.com/<the model's plugin name>_VGPU` and a warning (`kubevirt_warnings`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from msgspec import Struct

from gpud.kubevirt_names import selector, vgpu_resource
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


def kubevirt_warnings(resources: Mapping[str, tuple[str, tuple[str, ...]]],
                      passthrough: Iterable[tuple[str, str, str]]) -> list[str]:
    """What KubeVirt v1.9 does with these VFs that a reader would not expect: several vGPU types
    under one PCI id share one resource; a GPU on vfio-pci with the VFs' PCI id (`passthrough`:
    (PCI address, selector, NVIDIA plugin's resource)) lands in their resource too, since KubeVirt's
    plugin takes every matching function on vfio-pci."""
    out = []
    for sel, (resource, names) in resources.items():
        if len(names) > 1:
            out.append(f"vGPU VFs with PCI id {sel} carry {len(names)} types ({', '.join(names)}): KubeVirt (v1.9) "
                       f"advertises every vGPU VF of one PCI id under one resource ({resource}), so a VM cannot "
                       "choose among these types; give the GPUs of one model one vGPU type where VMs must choose")
    for pci, sel, plugin_resource in passthrough:
        got = resources.get(sel.upper())
        if got is not None:
            out.append(f"GPU {pci} on vfio-pci has the PCI id {sel} of vGPU VFs: KubeVirt's own plugin for that id "
                       f"advertises it under {got[0]} too (it takes every matching function on vfio-pci), besides "
                       f"NVIDIA's plugin's {plugin_resource or 'resource'}: a VM asking for a vGPU may get the whole GPU")
    return out


def entry(gpu: str, device_id: int, dev: VgpuDevice,
          resources: Mapping[str, tuple[str, tuple[str, ...]]] | None = None) -> VgpuEntry:
    """`resources`: the host's `vf_resources`, which name a VF vGPU's resource (else its own type's)."""
    name = dev.driver_name or printed_name(device_id, dev.type)
    resource = vgpu_resource(name)
    vfio = f"/dev/vfio/{dev.vfio_group}" if dev.vfio_group is not None else None
    if dev.uuid is not None:
        return VgpuEntry(gpu=gpu, type=dev.type, driver_name=name, uuid=dev.uuid, vf=None, vfio_device=vfio,
                         resource_name=resource, libvirt_hostdev=mdev_hostdev(dev.uuid),
                         kubevirt={"mediatedDevices": [{"mdevNameSelector": name, "resourceName": resource,
                                                        "externalResourceProvider": True}]})
    sel = selector(device_id, dev)
    if resources is not None and sel in resources:
        resource = resources[sel][0]
    return VgpuEntry(gpu=gpu, type=dev.type, driver_name=name, uuid=None, vf=dev.vf, vfio_device=vfio,
                     resource_name=resource, libvirt_hostdev=pci_hostdev(dev.vf or dev.parent),
                     kubevirt={"pciHostDevices": [{"pciVendorSelector": sel, "resourceName": resource,
                                                   "externalResourceProvider": False}]})
