"""Which GPUs a reset takes along, from the PCI functions alone. NVSwitch ids are checked against
the pci.ids gpud ships (gpud/data/kubevirt-nvidia-pci.ids), not against the simulator's catalog."""

from __future__ import annotations

from pathlib import Path

from gpud.model import PciFunction
from gpud.plan.reset_scope import nvswitches, reset_takes_along

PCI_IDS = (Path(__file__).resolve().parents[2] / "gpud/data/kubevirt-nvidia-pci.ids").read_text()


def fn(address, device, class_code, driver):
    return PciFunction(address=address, vendor=0x10DE, device=device, subsystem_vendor=0x10DE,
                       subsystem_device=0, class_code=class_code, driver=driver)


def nvswitch_ids() -> set[int]:
    return {int(line.split()[0], 16) for line in PCI_IDS.splitlines()
            if line.startswith("\t") and not line.startswith("\t\t") and "NVSwitch" in line}


def test_pci_ids_names_the_nvswitches_the_simulator_uses():
    from gpud.sim.catalog import NVSWITCH_DEVICE

    assert set(NVSWITCH_DEVICE.values()) <= nvswitch_ids()


GPUS = [fn("0000:18:00.0", 0x20B2, 0x030200, "nvidia"), fn("0000:2a:00.0", 0x20B2, 0x030200, "nvidia"),
        fn("0000:3a:00.0", 0x20B2, 0x030200, "vfio-pci"), fn("0000:18:00.1", 0x1AEF, 0x040300, "snd_hda_intel")]


def test_without_nvswitch_a_reset_takes_nothing_along():
    assert nvswitches(GPUS) == [] and reset_takes_along("0000:18:00.0", GPUS) == []


def test_with_nvswitch_a_reset_takes_the_other_gpus_on_nvidia():
    switch = fn("0000:c0:00.0", 0x1AF1, 0x068000, "nvidia-nvswitch")
    funcs = [*GPUS, switch]
    assert nvswitches(funcs) == ["0000:c0:00.0"]
    assert reset_takes_along("0000:18:00.0", funcs) == ["0000:2a:00.0"]  # not the vfio GPU, not audio
    # nvidia-smi(1) -r: Ampere without Fabric Manager takes the peers; with it, or on Hopper and
    # later, a GPU resets alone
    assert reset_takes_along("0000:18:00.0", funcs, arch="ampere", fabric_manager=False) == ["0000:2a:00.0"]
    assert reset_takes_along("0000:18:00.0", funcs, arch="ampere", fabric_manager=True) == []
    for arch in ("hopper", "blackwell"):
        assert reset_takes_along("0000:18:00.0", funcs, arch=arch, fabric_manager=False) == []
