"""PCI addresses, spelled the way sysfs spells them: the one key every layer joins on.

NVML says "00000000:3B:00.0", users write "3b:00.0", sysfs has "0000:3b:00.0"; everything is
normalised to the last on the way in, and ordered numerically (string order breaks on 5-digit VMD
domains).
"""

from __future__ import annotations

import re

_PCI = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{2}):([0-1][0-9a-fA-F])\.([0-7])")


def normalize_pci(text: str) -> str | None:
    """`3B:00.0`, `0000:3b:00.0`, NVML's `00000000:3B:00.0` -> `0000:3b:00.0`; None if not an address."""
    m = _PCI.fullmatch(text)
    if m is None:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def pci_sort_key(address: str) -> tuple[int, ...]:
    """Numeric order of `DDDD:BB:DD.F`; malformed addresses last (sysfs does not produce them)."""
    try:
        domain, bus, rest = address.split(":")
        dev, fn = rest.split(".")
        return (int(domain, 16), int(bus, 16), int(dev, 16), int(fn, 16))
    except ValueError:
        return (1 << 32,)


# Classes (base << 8 | sub) that sit in an IOMMU group without being endpoints (host bridge, PCI
# bridge): vfio-pci accepts them as they are (pcieport or no driver), so they are never rebound
# and never listed for vfio-pci at boot.
BRIDGE_CLASSES = (0x0600, 0x0604)


def is_bridge(class_code: int) -> bool:
    """`class_code` is sysfs's 24-bit `class` (base, sub, prog-if)."""
    return (class_code >> 8) in BRIDGE_CLASSES


VFIO_PCI = "vfio-pci"


def is_vfio(driver: str | None) -> bool:
    """vfio-pci or one of Linux's VFIO variant drivers (built on vfio-pci-core; every one in
    drivers/vfio/pci is named <something>_vfio_pci: nvgrace_gpu_vfio_pci, mlx5_vfio_pci, ...)."""
    return driver == VFIO_PCI or (driver or "").endswith("_vfio_pci")
