"""vm-vgpu in layout.yaml: type names checked against each GPU's own model with the valid names in
a located error, MIG-backed types turned into the MIG layout they need (vgpu-device-manager's
naming), and vgpu-device-manager files loading unchanged."""

from __future__ import annotations

import textwrap

from gpud.layout import check_text
from gpud.model import Gpu, PciFunction
from tests.support.example_layout import EXAMPLE, uncommented


def gpu(index: int, device: int, address: str) -> Gpu:
    return Gpu(index=index, function=PciFunction(address=address, vendor=0x10DE, device=device,
                                                 subsystem_vendor=0x10DE, subsystem_device=0, class_code=0x030200,
                                                 driver="nvidia"))


GPUS = [gpu(0, 0x26B9, "0000:18:00.0"), gpu(1, 0x20F1, "0000:2a:00.0"), gpu(2, 0x2335, "0000:3a:00.0"),
        gpu(3, 0x1EB8, "0000:5d:00.0")]
H200_TYPES = ("H200X-4C, H200X-7C, H200X-8C, H200X-14C, H200X-17C, H200X-28C, H200X-35C, H200X-70C, H200X-141C, "
              "H200X-1-18C, H200X-1-18CME, H200X-1-35C, H200X-2-35C, H200X-3-71C, H200X-4-71C, H200X-7-141C")


def check(text: str):
    return check_text(textwrap.dedent(text), "layout.yaml", GPUS)


def test_the_issue_example_resolves() -> None:
    r = check("""\
        version: v1
        layouts:
          mixed-node:
            - devices: [0]
              workload: vm-vgpu
              vgpu-devices: {"L40S-12Q": 4}
            - devices: [1]
              workload: vm-vgpu
              vgpu-devices: {"NVIDIA A100-1-5C": 4, "A100-2-10C": 1}
            - devices: [2]
              workload: vm-vgpu
              vgpu-devices: {"H200X-1-18C": 3, "H200X-3-71C": 1}
            - devices: [3]
              workload: vm-vgpu
              vgpu-devices: {"GRID T4-2Q": 8}
        """)
    assert r.errors == []
    got = {d.pci: (d.mig_enabled, d.mig_devices, d.vgpu_devices) for d in r.desired.values()}
    assert got == {
        "0000:18:00.0": (False, {}, {"L40S-12Q": 4}),
        "0000:2a:00.0": (True, {"1g.5gb": 4, "2g.10gb": 1}, {"A100-1-5C": 4, "A100-2-10C": 1}),
        "0000:3a:00.0": (True, {"1g.18gb": 3, "3g.71gb": 1}, {"H200X-1-18C": 3, "H200X-3-71C": 1}),
        "0000:5d:00.0": (False, {}, {"T4-2Q": 8}),
    }


def test_unknown_types_are_located_errors_with_the_valid_names() -> None:
    r = check("""\
        version: v1
        layouts:
          x:
            - devices: [2]
              workload: vm-vgpu
              vgpu-devices: {"BOGUS-TYPE": 1, "L40S-12Q": 1}
        """)
    assert [str(e) for e in r.errors] == [
        f"layout.yaml:6 layouts.x[0].vgpu-devices.BOGUS-TYPE: BOGUS-TYPE is not a vGPU type of NVIDIA H200 at "
        f"0000:3a:00.0; valid: {H200_TYPES}",
        f"layout.yaml:6 layouts.x[0].vgpu-devices.L40S-12Q: L40S-12Q is not a vGPU type of NVIDIA H200 at "
        f"0000:3a:00.0; valid: {H200_TYPES}",
    ]
    assert r.desired == {}


def test_mixing_kinds_and_explicit_mig_keys_are_errors() -> None:
    r = check("""\
        version: v1
        layouts:
          x:
            - devices: [2]
              workload: vm-vgpu
              vgpu-devices: {"H200X-4C": 1, "H200X-1-18C": 1}
            - devices: [1]
              workload: vm-vgpu
              mig-enabled: true
              mig-devices: {"1g.5gb": 7}
              vgpu-devices: {"A100-1-5C": 7}
        """)
    assert [str(e) for e in r.errors] == [
        "layout.yaml:6 layouts.x[0].vgpu-devices: H200X-4C is time-sliced and H200X-1-18C is MIG-backed: one GPU "
        "runs one kind (MIG off or on), not both (NVIDIA H200 at 0000:3a:00.0)",
        "layout.yaml:9 layouts.x[1].mig-enabled: vgpu-devices decide the MIG layout (MIG-backed types turn MIG on "
        "with their GPU instances, time-sliced ones turn it off); leave out mig-enabled and mig-devices "
        "(NVIDIA A100-PCIE-40GB at 0000:2a:00.0)",
    ]


def test_vgpu_device_manager_file_loads_unchanged() -> None:
    # NVIDIA/vgpu-device-manager examples/config-example.yaml style: no workload key, device-filter
    r = check_text(textwrap.dedent("""\
        version: v1
        vgpu-configs:
          default:
            - device-filter: ["0x26B910DE"]
              devices: all
              vgpu-devices:
                "L40S-24Q": 2
            - device-filter: "0x20F110DE"
              devices: all
              vgpu-devices:
                "A100-1-5C": 7
            - device-filter: "0x1EB810DE"
              devices: all
              vgpu-devices:
                "T4-1Q": 16
        """), "config.yaml", GPUS, select="default")
    assert r.errors == []
    assert {d.pci: (d.workload, d.vgpu_devices, d.mig_devices) for d in r.desired.values()} == {
        "0000:18:00.0": ("vm-vgpu", {"L40S-24Q": 2}, {}),
        "0000:2a:00.0": ("vm-vgpu", {"A100-1-5C": 7}, {"1g.5gb": 7}),
        "0000:5d:00.0": ("vm-vgpu", {"T4-1Q": 16}, {}),
    }


def test_shipped_vgpu_example_resolves_on_an_h200() -> None:
    assert EXAMPLE.exists()
    r = check_text(uncommented(), "layout.yaml", [GPUS[2]], select="vgpu")
    assert r.errors == []
    (d,) = r.desired.values()
    assert (d.mig_enabled, d.mig_devices) == (True, {"1g.18gb": 4, "3g.71gb": 1})
