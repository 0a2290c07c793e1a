"""`gpudctl passthrough`: what a VM manager needs to take each GPU gpud put on vfio-pci.

The resource name is derived exactly as NVIDIA's kubevirt-gpu-device-plugin derives it from the
PCI ids database (upper-case, "/" and "." and whitespace runs -> "_", then anything but
[A-Za-z0-9_.] dropped: "GH100 [H100 PCIe]" -> "GH100_H100_PCIE"), so the KubeVirt
`permittedHostDevices` snippet gpud prints matches what that plugin advertises. Debian's pci.ids
can predate a GPU (the 2023 file has no H200, 0x2335): then the model name stands in, then the id.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from functools import lru_cache

from msgspec import Struct

from gpud.model import Gpu
from gpud.profiles import known_model_name

PCI_IDS_PATHS = ("/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids", "/usr/pci.ids")
RESOURCE_PREFIX = "nvidia.com/"


class PassthroughEntry(Struct, frozen=True):
    pci: str
    index: int
    vendor_device: str  # KubeVirt pciVendorSelector: "10DE:2335"
    device_name: str  # pci.ids name or the model name: "GH100 [H100 PCIe]"
    resource_name: str  # "nvidia.com/GH100_H100_PCIE"
    iommu_group: int | None
    vfio_device: str | None  # "/dev/vfio/7" (None when the node is not there: not usable yet)
    numa_node: int | None
    companions: tuple[str, ...]  # other endpoints of the group (all must go to the same VM or none)
    libvirt_hostdev: str
    name_source: str  # "pci.ids" | "model" | "device-id"


def plugin_device_name(name: str) -> str:
    """kubevirt-gpu-device-plugin's getDeviceName() transformation of a pci.ids device name."""
    s = name.strip().upper().replace("/", "_").replace(".", "_")
    s = re.sub(r"\s+", "_", s)
    return re.sub(r"[^a-zA-Z0-9_.]+", "", s)


@lru_cache(maxsize=8)
def _pci_ids(path: str, mtime: float) -> dict[tuple[int, int], str]:
    """vendor, device -> device name from a pci.ids file (subsystem lines are skipped)."""
    names: dict[tuple[int, int], str] = {}
    vendor: int | None = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            if line.startswith("C "):  # the class list follows the vendors: done
                break
            if not line.startswith("\t"):
                try:
                    vendor = int(line[:4], 16)
                except ValueError:
                    vendor = None
                continue
            if line.startswith("\t\t") or vendor is None:
                continue
            ident, _, name = line[1:].rstrip("\n").partition(" ")
            try:
                names[(vendor, int(ident, 16))] = name.strip()
            except ValueError:
                continue
    return names


def pci_ids_name(vendor: int, device: int, paths: Iterable[str] = PCI_IDS_PATHS) -> str | None:
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        return _pci_ids(p, st.st_mtime).get((vendor, device))
    return None


def libvirt_hostdev(address: str, *, comment: str | None = None) -> str:
    """A <hostdev> for `virsh attach-device`; managed='no' because gpud, not libvirt, owns the
    binding (managed='yes' would rebind to the native driver when the VM stops)."""
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    note = f"  <!-- {comment} -->\n" if comment else ""
    return (
        "<hostdev mode='subsystem' type='pci' managed='no'>\n"
        f"{note}"
        "  <source>\n"
        f"    <address domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'/>\n"
        "  </source>\n"
        "</hostdev>\n"
    )


def entry_for(gpu: Gpu, *, dev_root: str = "/dev", pci_ids: Iterable[str] = PCI_IDS_PATHS) -> PassthroughEntry:
    f = gpu.function
    name = pci_ids_name(f.vendor, f.device, pci_ids)
    source = "pci.ids"
    if not name:
        name, source = known_model_name(gpu), "model"
    if not name:
        name, source = f"{f.device:04X}", "device-id"
    group = f.iommu_group
    node = os.path.join(dev_root, "vfio", str(group)) if group is not None else None
    companions = tuple(c.address for c in gpu.companions)
    comment = f"IOMMU group {group} also holds {', '.join(companions)}: give them to this VM or to none" if companions else None
    return PassthroughEntry(
        pci=f.address,
        index=gpu.index,
        vendor_device=f"{f.vendor:04X}:{f.device:04X}",
        device_name=name,
        resource_name=RESOURCE_PREFIX + plugin_device_name(name),
        iommu_group=group,
        vfio_device=f"/dev/vfio/{group}" if node is not None and os.path.exists(node) else None,
        numa_node=f.numa_node if f.numa_node >= 0 else None,
        companions=companions,
        libvirt_hostdev=libvirt_hostdev(f.address, comment=comment),
        name_source=source,
    )


def entries(gpus: Iterable[Gpu], *, dev_root: str = "/dev", pci_ids: Iterable[str] = PCI_IDS_PATHS) -> list[PassthroughEntry]:
    """GPUs on vfio-pci, in index order."""
    pci_ids = tuple(pci_ids)
    return [entry_for(g, dev_root=dev_root, pci_ids=pci_ids) for g in sorted(gpus, key=lambda g: g.index)
            if g.function.driver == "vfio-pci"]


def kubevirt_entry(e: PassthroughEntry) -> dict:
    # externalResourceProvider: the device plugin (kubevirt-gpu-device-plugin) advertises the
    # resource; KubeVirt's own plugin would need the GPU in its permitted list instead.
    return {"pciVendorSelector": e.vendor_device, "resourceName": e.resource_name, "externalResourceProvider": True}


def kubevirt_yaml(items: Iterable[PassthroughEntry]) -> str:
    """The KubeVirt CR `spec.configuration.permittedHostDevices` snippet, one entry per model."""
    seen: dict[str, PassthroughEntry] = {}
    for e in items:
        seen.setdefault(e.vendor_device, e)
    if not seen:
        return "permittedHostDevices:\n  pciHostDevices: []\n"
    lines = ["permittedHostDevices:", "  pciHostDevices:"]
    for e in seen.values():
        lines += [
            f'  - pciVendorSelector: "{e.vendor_device}"',
            f"    resourceName: {e.resource_name}",
            "    externalResourceProvider: true",
        ]
    return "\n".join(lines) + "\n"
