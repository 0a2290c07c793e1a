"""kubevirt-gpu-device-plugin resource names, exactly as the plugin derives them.

The expected names are not gpud's output: each is the plugin's rule (pkg/device_plugin/
device_plugin.go getDeviceName) applied by hand to the line of the plugin's own bundled pci.ids
(utils/pci.ids, Version 2025.07.11, at d26f2374) quoted next to it, and the synthetic cases are
the plugin's own unit tests (device_plugin_test.go, "getDeviceName() Tests").
"""

from __future__ import annotations

import pytest

from gpud import profiles
from gpud.kubevirt_names import find_device, kubevirt_name, plugin_name
from gpud.sim import catalog

# device id -> (line in the plugin's pci.ids, resource the plugin advertises)
PLUGIN_TABLE = {
    0x20B0: ("GA100 [A100 SXM4 40GB]", "nvidia.com/GA100_A100_SXM4_40GB"),
    0x20B2: ("GA100 [A100 SXM4 80GB]", "nvidia.com/GA100_A100_SXM4_80GB"),
    0x2330: ("GH100 [H100 SXM5 80GB]", "nvidia.com/GH100_H100_SXM5_80GB"),
    0x2331: ("GH100 [H100 PCIe]", "nvidia.com/GH100_H100_PCIE"),
    0x2321: ("GH100 [H100L 94GB]", "nvidia.com/GH100_H100L_94GB"),
    0x2335: ("GH100 [H200 SXM 141GB]", "nvidia.com/GH100_H200_SXM_141GB"),
    0x26B9: ("AD102GL [L40S]", "nvidia.com/AD102GL_L40S"),
    0x26B1: ("AD102GL [RTX 6000 Ada Generation]", "nvidia.com/AD102GL_RTX_6000_ADA_GENERATION"),
    # the RTX 6000 Ada's HD-audio function: on vfio-pci with its GPU, the plugin advertises it too
    0x22BA: ("AD102 High Definition Audio Controller", "nvidia.com/AD102_HIGH_DEFINITION_AUDIO_CONTROLLER"),
    # "-" is outside [a-zA-Z0-9_.] and dropped; " / " becomes "___"
    0x20B3: ("GA100 [A100-SXM-64GB]", "nvidia.com/GA100_A100SXM64GB"),
    0x2342: ("GH100 [GH200 120GB / 480GB]", "nvidia.com/GH100_GH200_120GB___480GB"),
    # the models the simulator gained beside the k8s work (same file, same rule by hand)
    0x20B5: ("GA100 [A100 PCIe 80GB]", "nvidia.com/GA100_A100_PCIE_80GB"),
    0x20B7: ("GA100GL [A30 PCIe]", "nvidia.com/GA100GL_A30_PCIE"),
    0x2348: ("GH100 [GH200 144G HBM3e]", "nvidia.com/GH100_GH200_144G_HBM3E"),
    0x2901: ("GB100 [B200]", "nvidia.com/GB100_B200"),
    0x2941: ("GB100 [HGX GB200]", "nvidia.com/GB100_HGX_GB200"),
    0x2BB5: ("GB202GL [RTX PRO 6000 Blackwell Server Edition]",
             "nvidia.com/GB202GL_RTX_PRO_6000_BLACKWELL_SERVER_EDITION"),
    # the vGPU work's models (same file, same rule by hand)
    0x1EB8: ("TU104GL [Tesla T4]", "nvidia.com/TU104GL_TESLA_T4"),
    0x20F1: ("GA100 [A100 PCIe 40GB]", "nvidia.com/GA100_A100_PCIE_40GB"),
}


# simulated models the plugin's pci.ids (2025.07.11) has no line for: it names them by the bare id
NOT_IN_PLUGIN_PCI_IDS = {0x31C2: "GB300 (the file's nearest line is 31c0 GB110)"}


def test_every_simulated_model_is_in_the_table():
    simulated = {m.device for m in profiles.MODELS.values()} | {m.audio_device for m in profiles.MODELS.values()
                                                                if m.audio_device}
    assert simulated <= set(PLUGIN_TABLE) | set(NOT_IN_PLUGIN_PCI_IDS), "add the new model's line from the plugin's pci.ids"
    assert {catalog.model(k).device for k in catalog.offered()} <= set(PLUGIN_TABLE) | set(NOT_IN_PLUGIN_PCI_IDS)


@pytest.mark.parametrize("device", sorted(NOT_IN_PLUGIN_PCI_IDS), ids=lambda d: f"{d:04x}")
def test_a_model_the_plugins_pci_ids_lacks_gets_the_bare_id(device):
    got = kubevirt_name(device)
    assert (got.resource, got.source) == (f"nvidia.com/{device:04x}", "device-id")


@pytest.mark.parametrize("device", sorted(PLUGIN_TABLE), ids=lambda d: f"{d:04x}")
def test_resource_name_equals_the_plugins(device):
    text, resource = PLUGIN_TABLE[device]
    got = kubevirt_name(device)
    assert got.resource == resource
    assert got.pci_ids_name == text
    assert got.source == "pci.ids 2025.07.11"


def test_unknown_id_falls_back_to_the_bare_sysfs_id():
    # createDevicePlugins: deviceName == "" -> the id as read from sysfs (lower-case, no 0x)
    got = kubevirt_name(0x2BFF)
    assert (got.resource, got.source, got.pci_ids_name) == ("nvidia.com/2bff", "device-id", None)


# The plugin's own unit test file and expectations (device_plugin_test.go).
PLUGIN_TEST_PCI_IDS = """
8086  Intel Corporation
\t2331  DH89xxCC Chap Counter
10de NVIDIA Corporation
\t118a  GK104GL [GRID K520]
\t118b  GK104GL [GRID K2 GeForce USM]
\t118d  gk104gl [grid k520]
\t118e gk104.gl [grid/k./520]
\t2331 GH100 [H100 PCIe]
""".splitlines()


@pytest.mark.parametrize(("device", "expected"), [
    (0x118A, "GK104GL_GRID_K520"),
    (0x118D, "GK104GL_GRID_K520"),  # capital letters
    (0x118E, "GK104_GL_GRID_K__520"),  # / and . -> _
    (0x2331, "GH100_H100_PCIE"),  # another vendor's device with the same id is not taken
])
def test_plugin_unit_test_cases(device, expected):
    got = kubevirt_name(device, lines=PLUGIN_TEST_PCI_IDS, version="test")
    assert got.name == expected and got.resource == f"nvidia.com/{expected}"


def test_plugin_unit_test_missing_id():
    assert find_device(PLUGIN_TEST_PCI_IDS, "abcd") is None
    assert kubevirt_name(0xABCD, lines=PLUGIN_TEST_PCI_IDS).resource == "nvidia.com/abcd"


def test_scan_stops_at_the_next_vendor_and_skips_comments():
    lines = ["10de  NVIDIA Corporation", "# a comment", "\t1111  X [One]", "10df  Other", "\t2222  Y"]
    assert find_device(lines, "1111") == "  X [One]"
    assert find_device(lines, "2222") is None  # belongs to vendor 10df
    assert find_device(["8086  Intel", "\t2222  Y"], "2222") is None  # no NVIDIA block at all


def test_go_semantics_of_case_and_whitespace():
    assert plugin_name("  a\u00a0b ") == "AB"  # RE2 \\s is ASCII: the no-break space is dropped, not "_"
    assert plugin_name("\ufb01x") == "X"  # Go's ToUpper keeps the ligature, which is then dropped
    assert plugin_name("") == ""


def test_every_nvidia_id_matches_the_plugins_own_code():
    """tests/fixtures/kubevirt/plugin-names.tsv is the output of the plugin's getDeviceName and
    locateVendor, copied verbatim into oracle.go beside it and run (Go 1.19) over the plugin's
    complete bundled pci.ids: every NVIDIA device id in it, plus three ids it lacks."""
    from pathlib import Path

    rows = (Path(__file__).parents[1] / "fixtures/kubevirt/plugin-names.tsv").read_text().splitlines()
    assert len(rows) > 1900
    mismatches = []
    for row in rows:
        ident, resource = row.split("\t")
        got = kubevirt_name(int(ident, 16)).resource
        if got != resource:
            mismatches.append((ident, resource, got))
    assert mismatches == []
