"""Issue 29 item 12: `gpudctl passthrough` prints one KubeVirt permittedHostDevices entry per
resource, not one per GPU or VF: two passthrough H100s are one pciHostDevices entry; four L40S VF
vGPUs of one type one pciHostDevices entry; two T4 mdevs one mediatedDevices entry. The devices
themselves (libvirt hostdevs) stay one per device, counted against the simulator's state file."""

from __future__ import annotations

import json

import pytest

from tests.daemon.test_daemon_vgpu import LAYOUT as VGPU_LAYOUT
from tests.scenarios.definitions import layout

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
