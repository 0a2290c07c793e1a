"""Which GPUs a reset of one GPU takes with it: pure, from the PCI functions sysfs lists.

On an NVSwitch baseboard (HGX/DGX) the GPUs share an NVLink fabric, and nvidia-smi's manual says a
GPU whose NVLink peers cannot be reset with it must be reset in one command with all of them
(before Ampere, or on Ampere without Fabric Manager); the tool refuses a reset that leaves one out.
gpud never runs that multi-GPU reset on its own: the plan names every GPU it would disrupt, and a
refused single-GPU reset leaves the GPU `reset-required` (docs/hardware/gpu-reset.md).

An NVSwitch is an NVIDIA PCI function of class 0x0680 (bridge, other): pci.ids names 10de:1af1
"GA100 [A100 NVSwitch]" and 10de:22a3 "GH100 [H100 NVSwitch]".
"""

from __future__ import annotations

from collections.abc import Sequence

from gpud.model import PciFunction

NVIDIA_VENDOR = 0x10DE
BRIDGE_OTHER = 0x0680  # PCI base class 06 (bridge), subclass 80 (other)
DISPLAY_CLASS = 0x03  # GPUs: VGA 0x0300, 3D controller 0x0302


def nvswitches(functions: Sequence[PciFunction]) -> list[str]:
    return sorted(f.address for f in functions if f.vendor == NVIDIA_VENDOR and f.class_code >> 8 == BRIDGE_OTHER)


def reset_takes_along(pci: str, functions: Sequence[PciFunction]) -> list[str]:
    """The other GPUs on nvidia that a reset of `pci` disrupts: all of them on an NVSwitch system,
    none elsewhere."""
    if not nvswitches(functions):
        return []
    return sorted(f.address for f in functions
                  if f.vendor == NVIDIA_VENDOR and f.class_code >> 16 == DISPLAY_CLASS
                  and f.driver == "nvidia" and f.address != pci)
