"""`gpudctl passthrough`: what a VM manager needs to take each GPU gpud put on vfio-pci.

The resource name is the one NVIDIA's kubevirt-gpu-device-plugin advertises: derived by its rules
from its own bundled pci.ids, whatever the host's pci.ids says (gpud.kubevirt_names), so the
KubeVirt `permittedHostDevices` snippet gpud prints matches what the cluster really offers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from msgspec import Struct

from gpud.kubevirt_names import kubevirt_name
from gpud.model import Gpu, PciFunction
from gpud.pci import is_vfio
from gpud.profiles import NVIDIA, known_model_name


class PassthroughEntry(Struct, frozen=True):
    pci: str
    index: int
    vendor_device: str  # KubeVirt pciVendorSelector: "10DE:2335"
    device_name: str  # the plugin's pci.ids text, else the model name: "GH100 [H100 PCIe]"
    resource_name: str  # "nvidia.com/GH100_H100_PCIE" ("" for a function no plugin advertises)
    iommu_group: int | None
    vfio_device: str | None  # "/dev/vfio/7" (None when the node is not there: not usable yet)
    numa_node: int | None
    companions: tuple[str, ...]  # other endpoints of the group (all must go to the same VM or none)
    libvirt_hostdev: str
    name_source: str  # "pci.ids <version>" (the plugin's) | "device-id" (the plugin's fallback) | "none"


def resource_of(f: PciFunction) -> tuple[str, str | None, str]:
    """(resource, pci.ids text, source) the plugin gives an NVIDIA function; ("", None, "none")
    for another vendor's (the plugin only takes 10de)."""
    if f.vendor != NVIDIA:
        return "", None, "none"
    exact = kubevirt_name(f.device)
    return exact.resource, exact.pci_ids_name, exact.source


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


def entry_for(gpu: Gpu, *, dev_root: str = "/dev") -> PassthroughEntry:
    f = gpu.function
    resource, text, source = resource_of(f)
    name = text or known_model_name(gpu) or f"{f.vendor:04x}:{f.device:04x}"
    group = f.iommu_group
    node = os.path.join(dev_root, "vfio", str(group)) if group is not None else None
    companions = tuple(c.address for c in gpu.companions)
    comment = f"IOMMU group {group} also holds {', '.join(companions)}: give them to this VM or to none" if companions else None
    return PassthroughEntry(
        pci=f.address,
        index=gpu.index,
        vendor_device=f"{f.vendor:04X}:{f.device:04X}",
        device_name=name,
        resource_name=resource,
        iommu_group=group,
        vfio_device=f"/dev/vfio/{group}" if node is not None and os.path.exists(node) else None,
        numa_node=f.numa_node if f.numa_node >= 0 else None,
        companions=companions,
        libvirt_hostdev=libvirt_hostdev(f.address, comment=comment),
        name_source=source,
    )


def entries(gpus: Iterable[Gpu], *, dev_root: str = "/dev") -> list[PassthroughEntry]:
    """GPUs on vfio-pci, in index order."""
    return [entry_for(g, dev_root=dev_root) for g in sorted(gpus, key=lambda g: g.index)
            if is_vfio(g.function.driver)]


def kubevirt_entry(e: PassthroughEntry) -> dict:
    # externalResourceProvider: the device plugin (kubevirt-gpu-device-plugin) advertises the
    # resource; KubeVirt's own plugin would need the GPU in its permitted list instead.
    return {"pciVendorSelector": e.vendor_device, "resourceName": e.resource_name, "externalResourceProvider": True}


# KubeVirt's CR field lists under spec.configuration.permittedHostDevices
KUBEVIRT_LISTS = {"pciHostDevices": "pciVendorSelector", "mediatedDevices": "mdevNameSelector"}


def kubevirt_configuration(entries: Iterable[dict], *, vgpus: bool) -> dict:
    """The KubeVirt CR's `spec.configuration` for what this host offers: `permittedHostDevices`
    with one entry per resource (KubeVirt permits a resource, and the device plugin counts the
    GPUs or VFs behind it: eight H200s are one entry, not eight), in first-seen order. Entries
    without a resource name (a function no plugin advertises) cannot be permitted and are left out.
    Where gpud makes vGPUs, virt-handler must not make or remove mdevs itself:
    `mediatedDevicesConfiguration.enabled: false`, the field KubeVirt v1.8 added in place of the
    `DisableMDEVConfiguration` feature gate (kubevirt#16220; the gate is a no-op from v1.9,
    kubevirt#17620)."""
    lists: dict[str, list[dict]] = {}
    seen: set[tuple] = set()
    for entry in entries:
        # a vGPU's entry names its list; a passthrough GPU's is one pciHostDevices item
        named = entry.items() if set(entry) <= set(KUBEVIRT_LISTS) else [("pciHostDevices", [entry])]
        for kind, items in named:
            for item in items:
                key = (kind, item.get(KUBEVIRT_LISTS[kind]), item.get("resourceName"),
                       item.get("externalResourceProvider"))
                if not item.get("resourceName") or key in seen:
                    continue
                seen.add(key)
                lists.setdefault(kind, []).append(dict(item))
    config: dict = {"mediatedDevicesConfiguration": {"enabled": False}} if vgpus else {}
    if lists:
        config["permittedHostDevices"] = {k: lists[k] for k in KUBEVIRT_LISTS if k in lists}
    return config
