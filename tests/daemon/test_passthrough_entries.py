"""Issue 29 item 12: `gpudctl passthrough` prints one KubeVirt permittedHostDevices entry per
resource, not one per GPU or VF: two passthrough H100s are one pciHostDevices entry; four L40S VF
vGPUs of one type one pciHostDevices entry; two T4 mdevs one mediatedDevices entry. The devices
themselves (libvirt hostdevs) stay one per device, counted against the simulator's state file."""

from __future__ import annotations

import json

import pytest

from tests.scenarios.definitions import layout
from tests.support.vgpu_layouts import L40S_AND_T4 as VGPU_LAYOUT

pytestmark = pytest.mark.daemon


def _kubevirt_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("KubeVirt permittedHostDevices (spec.configuration.permittedHostDevices):")
    return lines[start + 1:]


def test_one_entry_per_resource_for_passthrough_gpus(daemon):
    d = daemon(["h100-80gb:3"], layout({"devices": [0, 1], "workload": "vm-passthrough"}))
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    out = d.ctl("passthrough").stdout
    assert out.count("libvirt <hostdev> for ") == 2
    entries = _kubevirt_lines(out)
    assert entries[0] == "  pciHostDevices:" and len(entries) == 2, entries
    assert json.loads(entries[1].removeprefix("    - "))["pciVendorSelector"] == "10DE:2330"


def test_one_entry_per_resource_for_vgpus(daemon):
    d = daemon(["l40s", "t4"], VGPU_LAYOUT, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    out = d.ctl("passthrough").stdout
    assert out.count("libvirt <hostdev> for ") == 6  # 4 VFs, 2 mdevs
    entries = _kubevirt_lines(out)
    kinds = [ln.strip() for ln in entries if not ln.startswith("    - ")]
    assert kinds == ["mediatedDevices:", "pciHostDevices:"], entries
    resources = [json.loads(ln.removeprefix("    - "))["resourceName"] for ln in entries if ln.startswith("    - ")]
    assert sorted(resources) == ["nvidia.com/GRID_T4-4Q", "nvidia.com/NVIDIA_L40S-12Q"], resources


def _kubevirt_19_discovery(sys_root, permitted: dict) -> dict[str, set[str]]:
    """KubeVirt v1.9's own PCI device plugin discovery, restated from its source as the oracle
    (pkg/virt-handler/device-manager: device_controller.go builds a map lower-cased
    pciVendorSelector -> resourceName from the non-external pciHostDevices, a later entry replacing
    an earlier; pci_device.go discoverPermittedHostPCIDevices walks /sys/bus/pci/devices, reads
    PCI_ID from each uevent, and keeps a match on vfio-pci, or on another driver when nvidia.go
    shouldPermitNvidia says so: driver nvidia, no sriov_totalvfs, nvidia/current_vgpu_type not ""
    or "0"). resourceName -> the PCI addresses it would advertise."""
    supported = {e["pciVendorSelector"].lower(): e["resourceName"]
                 for e in permitted.get("pciHostDevices", []) if not e.get("externalResourceProvider")}
    found: dict[str, set[str]] = {}
    base = sys_root / "bus/pci/devices"
    for dev in sorted(base.iterdir()):
        pci_id = next((ln.split("=", 1)[1].strip().lower() for ln in (dev / "uevent").read_text().splitlines()
                       if ln.startswith("PCI_ID")), None)
        if pci_id not in supported:
            continue
        driver = (dev / "driver").resolve().name if (dev / "driver").exists() else ""
        if driver != "vfio-pci":
            vgpu_type = dev / "nvidia/current_vgpu_type"
            if driver != "nvidia" or (dev / "sriov_totalvfs").exists() or not vgpu_type.exists() \
                    or vgpu_type.read_text().strip() in ("", "0"):
                continue
        found.setdefault(supported[pci_id], set()).add(dev.name)
    return found


def _sim_vfs_with_vgpu(host) -> set[str]:
    st = json.loads((host / "state.json").read_text())
    return {vf["address"] for v in st["vgpu"].values() for vf in v["vfs"] if vf.get("vgpu_type")}


MIXED = """\
version: v1
layouts:
  vms:
    - devices: [0]
      workload: vm-vgpu
      vgpu-devices: {"L40S-12Q": 2}
    - devices: [1]
      workload: vm-vgpu
      vgpu-devices: {"L40S-24Q": 1}
    - devices: [2]
      workload: vm-passthrough
"""


def test_sriov_vgpu_entries_are_what_kubevirt_1_9_advertises(daemon):
    """KubeVirt v1.9 (kubevirt#16890) advertises exactly the VFs gpud gave a vGPU type under the
    entry gpud prints, matched by the VF's own uevent PCI_ID: one type, one resource named after it."""
    d = daemon(["l40s:2"], layout({"devices": [0, 1], "workload": "vm-vgpu", "vgpu-devices": {"L40S-12Q": 2}}),
               vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    r = json.loads(d.ctl("passthrough", "--json").stdout)
    permitted = r["kubevirt_configuration"]["permittedHostDevices"]
    assert permitted == {"pciHostDevices": [{"pciVendorSelector": "10DE:26B9", "resourceName": "nvidia.com/NVIDIA_L40S-12Q",
                                             "externalResourceProvider": False}]}
    vfs = _sim_vfs_with_vgpu(d.host)
    assert len(vfs) == 4
    assert _kubevirt_19_discovery(d.host / "sys", permitted) == {"nvidia.com/NVIDIA_L40S-12Q": vfs}
    assert r["kubevirt_warnings"] == []


def test_sriov_vgpu_types_of_one_model_share_kubevirts_resource_with_a_warning(daemon):
    """Two types on two L40S: KubeVirt keys its plugins by PCI id, so one entry (a second with the same
    selector would replace the first), named for the model, and a warning; a third L40S on vfio-pci
    lands in that resource too (KubeVirt takes every matching function on vfio-pci), and gpud says so."""
    d = daemon(["l40s:3"], MIXED, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    r = json.loads(d.ctl("passthrough", "--json").stdout)
    permitted = r["kubevirt_configuration"]["permittedHostDevices"]
    ours = [e for e in permitted["pciHostDevices"] if not e["externalResourceProvider"]]
    assert len(ours) == 1 and ours[0]["pciVendorSelector"] == "10DE:26B9", permitted
    resource = ours[0]["resourceName"]
    assert resource.endswith("_VGPU") and "12Q" not in resource, resource
    pf = next(g["pci"] for g in d.status()["gpus"] if g["index"] == 2)
    assert _kubevirt_19_discovery(d.host / "sys", permitted) == {resource: _sim_vfs_with_vgpu(d.host) | {pf}}
    assert {v["resource_name"] for v in r["vgpus"]} == {resource}
    types_warning, pf_warning = r["kubevirt_warnings"]
    assert "L40S-12Q" in types_warning and "L40S-24Q" in types_warning and resource in types_warning
    assert pf in pf_warning and resource in pf_warning
    assert f"warning: GPU {pf} on vfio-pci" in d.ctl("passthrough").stdout
