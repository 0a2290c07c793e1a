"""libvirt and KubeVirt entries for vGPUs: mdevs by UUID, VF vGPUs as unmanaged PCI hostdevs;
the <hostdev> text parses as XML and carries what libvirt reads."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from gpud.engine.vgpu.inventory import entry
from gpud.model import VgpuDevice
from tests.support.present import present


def test_mdev_entry() -> None:
    dev = VgpuDevice(type="T4-4Q", parent="0000:5d:00.0", uuid="0b5e4c1a-7d0e-4f0a-9a3e-2d5f6a7b8c90", vfio_group=201)
    e = entry("0000:5d:00.0", 0x1EB8, dev)
    host = ET.fromstring(e.libvirt_hostdev)
    assert (host.get("type"), host.get("model")) == ("mdev", "vfio-pci")
    assert present(host.find("source/address")).get("uuid") == dev.uuid
    assert e.kubevirt == {"mediatedDevices": [{"mdevNameSelector": "GRID T4-4Q", "resourceName": "nvidia.com/GRID_T4-4Q",
                                               "externalResourceProvider": True}]}
    assert e.vfio_device == "/dev/vfio/201"


def test_vf_entry() -> None:
    dev = VgpuDevice(type="L40S-12Q", parent="0000:18:00.5", vf="0000:18:00.5", type_id=1153, vfio_group=202)
    e = entry("0000:18:00.0", 0x26B9, dev)
    host = ET.fromstring(e.libvirt_hostdev)
    assert (host.get("type"), host.get("managed")) == ("pci", "no")  # the VF stays on nvidia
    addr = host.find("source/address")
    assert (present(addr).get("domain"), present(addr).get("bus"), present(addr).get("slot"), present(addr).get("function")) == ("0x0000", "0x18", "0x00", "0x5")
    assert e.kubevirt == {"pciHostDevices": [{"pciVendorSelector": "10DE:26B9", "resourceName": "nvidia.com/NVIDIA_L40S-12Q",
                                              "externalResourceProvider": False}]}
