"""Item: KubeVirt entries for vGPUs. mdev resource names come from the device's own
`mdev_type/name` in sysfs, as kubevirt-gpu-device-plugin reads them (not from gpud's prefix
table), with `externalResourceProvider: true` (NVIDIA's plugin advertises them); a VF vGPU is
KubeVirt's own PCI device plugin's (kubevirt#16890): `externalResourceProvider: false`.

Oracle: the sysfs tree's own `name` file, rewritten here to what another driver branch prints
(a public R580 A100 host shows `GRID A100-10C` where a table would say `NVIDIA`).
"""

from __future__ import annotations

import os
from pathlib import Path

from gpud.engine.vgpu.inventory import entry
from gpud.model import VgpuDevice
from gpud.sim.cli import create
from gpud.vgpu_types import printed_name
from tests.support.vgpu_host import adapter

T4 = "0000:18:00.0"
UUID = "0b5e4c1a-7d0e-4f0a-9a3e-2d5f6a7b8c90"


def test_mdev_name_is_read_from_the_device_not_a_prefix_table(tmp_path):
    d = tmp_path / "h"
    create(d, ["t4"], vgpu="mdev")
    a = adapter(d)
    tdir, _ = a.mdev_types(T4)["T4-8Q"]
    a.create_mdev(T4, tdir, UUID)
    name_file = a._parent(T4, "mdev_supported_types", tdir, "name")  # the type the mdev's mdev_type links to
    assert os.path.realpath(a._parent(T4, UUID, "mdev_type")) == os.path.realpath(os.path.dirname(name_file))
    with open(name_file, "w") as f:
        f.write("NVIDIA T4-8Q\n")  # another driver branch's spelling of the same type
    assert printed_name(0x1EB8, "T4-8Q") == "GRID T4-8Q"  # what the table would have said
    (dev,) = a.read(T4).devices
    assert dev.driver_name == "NVIDIA T4-8Q" and dev.type == "T4-8Q"
    e = entry(T4, 0x1EB8, dev)
    assert e.resource_name == "nvidia.com/NVIDIA_T4-8Q"
    assert e.kubevirt == {"mediatedDevices": [{"mdevNameSelector": "NVIDIA T4-8Q", "resourceName": "nvidia.com/NVIDIA_T4-8Q",
                                               "externalResourceProvider": True}]}


def test_a100_r580_name_as_the_host_prints_it():
    dev = VgpuDevice(type="A100-10C", parent="0000:2a:00.0", uuid=UUID, driver_name="GRID A100-10C")
    e = entry("0000:2a:00.0", 0x20B2, dev)
    assert e.driver_name == "GRID A100-10C" and e.resource_name == "nvidia.com/GRID_A100-10C"


def test_vf_vgpu_is_kubevirts_own_not_external():
    dev = VgpuDevice(type="L40S-12Q", parent="0000:18:00.5", vf="0000:18:00.5", type_id=1153, vfio_group=202)
    e = entry("0000:18:00.0", 0x26B9, dev)
    assert e.kubevirt == {"pciHostDevices": [{"pciVendorSelector": "10DE:26B9", "resourceName": "nvidia.com/NVIDIA_L40S-12Q",
                                              "externalResourceProvider": False}]}


def test_vf_selector_is_the_vfs_own_uevent_pci_id(tmp_path):
    """KubeVirt v1.9 matches pciVendorSelector against each function's uevent PCI_ID
    (pkg/virt-handler/device-manager/common.go, GetDevicePCIID), so gpud reads the VF's own: a VF
    whose uevent says another device id than its PF is selected by that id, not the PF's."""
    from gpud.sim.state import load
    from tests.sim.vfs import set_vfs
    from tests.support.vgpu_layouts import L40S

    d = tmp_path / "h"
    create(d, ["l40s"], vgpu="vfio")
    a = adapter(d)
    set_vfs(d, L40S, 2)
    vf = load(d).vgpu[L40S].vfs[1].address
    a.set_vf_type(vf, next(i for i, n in a.creatable_on(vf) if n == "L40S-12Q"))
    uevent = Path(a._dev(vf, "uevent"))
    text = uevent.read_text()
    assert "PCI_ID=10DE:26B9" in text
    uevent.write_text(text.replace("PCI_ID=10DE:26B9", "PCI_ID=10de:26ba"))  # what another VF id would read
    (dev,) = a.read(L40S).devices
    assert dev.pci_id == "10DE:26BA"
    assert entry(L40S, 0x26B9, dev).kubevirt["pciHostDevices"][0]["pciVendorSelector"] == "10DE:26BA"
