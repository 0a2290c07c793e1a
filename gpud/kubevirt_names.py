"""The resource name NVIDIA's kubevirt-gpu-device-plugin advertises for a PCI function on vfio-pci.

The plugin names each NVIDIA device id it finds on vfio-pci after **its own bundled pci.ids**
(copied into its image as /usr/pci.ids), never the host's: Debian 12's 2023 file calls 10de:2330
"GH100[H100 SXM5 80GB]" where the plugin's 2025 file says "GH100 [H100 SXM5 80GB]", so a name
derived from the host's file can differ from what the cluster actually advertises. gpud therefore
ships the NVIDIA device lines of the plugin's file (gpud/data/kubevirt-nvidia-pci.ids, with its
source) and applies the plugin's rules to them, step for step (pkg/device_plugin/device_plugin.go,
getDeviceName and createDevicePlugins):

1. find the first line starting with "10de" (the vendor), then scan its device lines, skipping
   comments, stopping at the first line that does not start with a tab;
2. take the first line starting with a tab and the device id as sysfs spells it (lower-case hex,
   without "0x"), strip the id, trim spaces, upper-case;
3. "/" and "." become "_", runs of whitespace become "_", then every character outside
   [a-zA-Z0-9_.] is dropped: "GH100 [H100 SXM5 80GB]" -> "GH100_H100_SXM5_80GB";
4. an id the file does not know (or an empty result) falls back to the bare device id ("2330");
5. the resource is "nvidia.com/" + that name.

Pure apart from reading the data file shipped inside the package (once, cached).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache
from importlib import resources

from msgspec import Struct

from gpud.model import VgpuDevice
from gpud.vgpu_types import printed_name

NVIDIA_VENDOR = "10de"
RESOURCE_NAMESPACE = "nvidia.com"
DATA_FILE = "kubevirt-nvidia-pci.ids"

# Go's RE2 `\s` is ASCII whitespace only; Python's would also match Unicode spaces.
_GO_SPACE_RUN = re.compile(r"[\t\n\f\r ]+")
_NOT_KEPT = re.compile(r"[^a-zA-Z0-9_.]+")


class KubevirtName(Struct, frozen=True):
    resource: str  # "nvidia.com/GH100_H100_SXM5_80GB"
    name: str  # "GH100_H100_SXM5_80GB" (also the plugin's socket name: kubevirt-<name>.sock)
    pci_ids_name: str | None  # the pci.ids text it came from; None when the id fell back
    source: str  # "pci.ids <version>" | "device-id"


def _go_upper(text: str) -> str:
    """strings.ToUpper, as far as it matters here: only ASCII letters survive step 3, and Python's
    str.upper() would turn some non-ASCII letters into ASCII ones ("ﬁ" -> "FI") that Go keeps."""
    return "".join(c.upper() if c.isascii() else c for c in text)


def plugin_name(pci_ids_text: str) -> str:
    """Steps 2-3 on the text after the device id (getDeviceName's string transformations)."""
    name = _go_upper(pci_ids_text.strip())
    name = name.replace("/", "_").replace(".", "_")
    name = _GO_SPACE_RUN.sub("_", name)
    return _NOT_KEPT.sub("", name)


def find_device(lines: Iterable[str], device_id: str) -> str | None:
    """Step 1-2: the raw pci.ids text for `device_id` under vendor 10de, or None."""
    it = iter(lines)
    for line in it:
        if line.startswith(NVIDIA_VENDOR):
            break
    else:
        return None
    prefix = "\t" + device_id
    for line in it:
        line = line.rstrip("\n")
        if line.startswith("#"):
            continue
        if not line.startswith("\t"):
            return None  # the next vendor: not found
        if line.startswith(prefix):
            return line[len(prefix):]
    return None


@lru_cache(maxsize=1)
def _bundled() -> tuple[tuple[str, ...], str]:
    text = resources.files("gpud.data").joinpath(DATA_FILE).read_text(encoding="utf-8")
    lines = tuple(text.splitlines())
    version = next((ln.split("Version", 1)[1].split(",")[0].strip() for ln in lines
                    if ln.startswith("#") and "pci.ids" in ln and "Version" in ln), "?")
    return lines, version


def sysfs_device_id(device: int) -> str:
    """The id as the plugin reads it from sysfs `device` ("0x2330\\n" -> "2330")."""
    return f"{device:04x}"


def kubevirt_name(device: int, *, lines: Iterable[str] | None = None, version: str | None = None) -> KubevirtName:
    """The plugin's resource for NVIDIA device id `device` (by default from the bundled data)."""
    if lines is None:
        lines, bundled_version = _bundled()
        version = version or bundled_version
    ident = sysfs_device_id(device)
    raw = find_device(lines, ident)
    name = plugin_name(raw) if raw is not None else ""
    if raw is None or not name:  # createDevicePlugins: `if deviceName == "" { deviceName = k }`
        return KubevirtName(f"{RESOURCE_NAMESPACE}/{ident}", ident, None, "device-id")
    return KubevirtName(f"{RESOURCE_NAMESPACE}/{name}", name, raw.strip(), f"pci.ids {version or '?'}")


def vgpu_resource(printed: str) -> str:
    """The plugin's resource for an mdev vGPU: `nvidia.com/` + the mdev type's name with spaces
    turned into `_` (`NVIDIA L40S-12Q` -> `nvidia.com/NVIDIA_L40S-12Q`; docs/kubernetes.md). The
    plugin lists only /sys/bus/mdev/devices, so a vendor-VFIO vGPU (a VF) gets no resource from it."""
    return f"{RESOURCE_NAMESPACE}/{printed.replace(' ', '_')}"


def selector(device_id: int, dev: VgpuDevice) -> str:
    """The pciVendorSelector that matches a VF vGPU: its own uevent PCI_ID, else (not read) the PF's id."""
    return dev.pci_id or f"10DE:{device_id:04X}"


def vf_resources(vfs: Iterable[tuple[int, VgpuDevice]]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """selector -> (resource, vGPU types under it) for the VF vGPUs given as (PF device id, device):
    one resource per PCI id, as KubeVirt (v1.9) makes one PCI device plugin per lower-cased
    pciVendorSelector and puts every VF of that id with a vGPU type under it
    (gpud.engine.vgpu.inventory and docs/kubevirt.md have the rules and their source)."""
    types: dict[str, dict[str, None]] = {}
    for device_id, dev in vfs:
        if dev.vf is not None:
            types.setdefault(selector(device_id, dev), {})[dev.driver_name or printed_name(device_id, dev.type)] = None
    out = {}
    for sel, names in types.items():
        if len(names) == 1:
            out[sel] = (vgpu_resource(next(iter(names))), tuple(names))
        else:
            out[sel] = (f"{RESOURCE_NAMESPACE}/{kubevirt_name(int(sel.partition(':')[2], 16)).name}_VGPU", tuple(names))
    return out
