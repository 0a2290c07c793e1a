"""Which GPUs a reset of one GPU takes with it: pure, from the PCI functions sysfs lists, the GPU's
architecture and whether Fabric Manager runs.

nvidia-smi(1), `-r`: on Ampere NVSwitch systems (HGX A100) a GPU resets on its own while Fabric
Manager is running; with Fabric Manager stopped all NVLink peers must be reset in one command, and
the tool refuses a reset that leaves one out. Hopper and later NVSwitch systems have no such
dependency. So Fabric Manager is never stopped for a reset, and other GPUs are taken along only on
Ampere without it (docs/hardware/gpu-reset.md). gpud never runs that multi-GPU reset on its own:
the plan names every GPU it would disrupt, and a refused single-GPU reset leaves the GPU
`reset-required`.

An NVSwitch is an NVIDIA PCI function of class 0x0680 (bridge, other): pci.ids names 10de:1af1
"GA100 [A100 NVSwitch]" and 10de:22a3 "GH100 [H100 NVSwitch]".
"""

from __future__ import annotations

from collections.abc import Sequence

from gpud.model import PciFunction

NVIDIA_VENDOR = 0x10DE
BRIDGE_OTHER = 0x0680  # PCI base class 06 (bridge), subclass 80 (other)
DISPLAY_CLASS = 0x03  # GPUs: VGA 0x0300, 3D controller 0x0302
FABRIC_MANAGER = "nv-fabricmanager"  # the process; the unit is nvidia-fabricmanager.service
# Architectures whose NVSwitch systems reset GPUs alone whatever Fabric Manager does.
NO_FABRIC_DEPENDENCY = ("hopper", "blackwell")


def nvswitches(functions: Sequence[PciFunction]) -> list[str]:
    return sorted(f.address for f in functions if f.vendor == NVIDIA_VENDOR and f.class_code >> 8 == BRIDGE_OTHER)


def reset_takes_along(pci: str, functions: Sequence[PciFunction], *, arch: str | None = None,
                      fabric_manager: bool | None = None) -> list[str]:
    """The other GPUs on nvidia that a reset of `pci` disrupts: its NVLink peers on an Ampere (or
    unknown) NVSwitch system whose Fabric Manager is not known to run; none elsewhere."""
    if not nvswitches(functions) or arch in NO_FABRIC_DEPENDENCY or fabric_manager:
        return []
    return sorted(f.address for f in functions
                  if f.vendor == NVIDIA_VENDOR and f.class_code >> 16 == DISPLAY_CLASS
                  and f.driver == "nvidia" and f.address != pci)
