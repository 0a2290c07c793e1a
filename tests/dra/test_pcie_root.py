"""`resource.kubernetes.io/pcieRoot` as Kubernetes' helper defines it (k8s.io/dynamic-resource-
allocation deviceattribute GetPCIeRootAttributeByPCIBusID, v0.36.3): the first directory under
/sys/devices on the way to the function, read from the bus/pci/devices link. Checked against the
simulator's sysfs tree (the oracle: the kernel path the link resolves to, by os.path.realpath), the
real H200 capture's realpath, and a tree shaped like a bare-metal host's (bridges between the
root complex and the GPU, a second PCI domain)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpud.host.kernel.sysfs import pcie_root
from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu, NvmlGpu, PciFunction
from gpud.plan.dra_slices import STANDARD, DraInputs, build_slices
from gpud.profiles import MODELS
from gpud.sim import cli as simcli
from gpud.sim import state as simstate
from tests.support.pci_oracle import realpath_root

CAPTURE = Path(__file__).resolve().parents[1] / "fixtures" / "h200" / "nvml-sysfs-readonly.json"


def test_every_simulated_gpu_gets_the_root_its_sysfs_link_leads_to(tmp_path):
    simcli.create(tmp_path, ["h100-80gb:2", "rtx6000-ada:1"])
    sys_root = tmp_path / "sys"
    gpus = sorted(simstate.load(tmp_path).gpus)
    assert len(gpus) == 3
    for address in gpus:
        assert pcie_root(address, str(sys_root)) == realpath_root(sys_root, address)
    # the real H200 (a VM: the GPU straight on the root bus) resolves the same way
    real = json.loads(CAPTURE.read_text())["sysfs_pci_device"]["realpath"]
    assert real.split("/")[3] == pcie_root(gpus[0], str(sys_root)) == "pci0000:00"


def _link(sys_root: Path, address: str, chain: list[str]) -> None:
    dev = sys_root / "devices" / Path(*chain, address)
    dev.mkdir(parents=True)
    bus = sys_root / "bus" / "pci" / "devices"
    bus.mkdir(parents=True, exist_ok=True)
    (bus / address).symlink_to(os.path.relpath(dev, bus))


def test_behind_bridges_and_in_a_second_domain(tmp_path):
    _link(tmp_path, "0000:18:00.0", ["pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0"])
    _link(tmp_path, "0001:9a:00.0", ["pci0001:97", "0001:97:01.0"])
    assert pcie_root("0000:18:00.0", str(tmp_path)) == "pci0000:15" == realpath_root(tmp_path, "0000:18:00.0")
    assert pcie_root("0001:9a:00.0", str(tmp_path)) == "pci0001:97" == realpath_root(tmp_path, "0001:9a:00.0")


@pytest.mark.parametrize("address, target, said", [
    ("0000:3b:00.0", None, "No such file"),
    ("0000:3b:00.0", "../../../devices/platform/0000:3b:00.0", "not under devices/pci"),
    ("0000:3b:00.0", "../../../devices/pci0000:3a/0000:3b:00.1", "does not end in 0000:3b:00.0"),
    ("0000:3B:00.0", "../../../devices/pci0000:3a/0000:3B:00.0", "not in domain:bus:device.function form"),
    ("3b:00.0", "../../../devices/pci0000:3a/3b:00.0", "not in domain:bus:device.function form"),
])
def test_what_the_helper_refuses_is_refused_by_name(tmp_path, address, target, said):
    bus = tmp_path / "bus" / "pci" / "devices"
    bus.mkdir(parents=True)
    if target is not None:
        (bus / address).symlink_to(target)
    with pytest.raises(ValueError, match=said):
        pcie_root(address, str(tmp_path))


def test_every_device_of_a_gpu_carries_its_root():
    h100 = MODELS["h100-80gb"]
    pci = "0000:18:00.0"
    fn = PciFunction(pci, 0x10DE, h100.device, 0x10DE, h100.subsystem_device or 0, 0x030200, driver="nvidia")
    nv = NvmlGpu(pci, "GPU-x", h100.name, minor=0, memory_mb=h100.memory_mb, mig_capable=True, mig_mode=0,
                 profiles=h100.profiles, compute_capability=h100.compute_capability)
    desired = {pci: DesiredGpu(pci, 0, "layouts.d[0]", mig_enabled=True, dynamic=True)}
    built = build_slices(DraInputs("n", (Gpu(0, fn, nvml=nv),), desired, pcie_roots={pci: "pci0000:15"}))
    devices = [d for s in built.slices for d in s["spec"].get("devices") or ()]
    assert len(devices) > 1
    assert {d["attributes"][STANDARD + "pcieRoot"]["string"] for d in devices} == {"pci0000:15"}
    unknown = build_slices(DraInputs("n", (Gpu(0, fn, nvml=nv),), desired))
    assert not any(STANDARD + "pcieRoot" in d["attributes"]
                   for s in unknown.slices for d in s["spec"].get("devices") or ())
