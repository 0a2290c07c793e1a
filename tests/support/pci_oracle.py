"""Where a PCI function sits, as the OS resolves the kernel's sysfs links: an oracle that shares
no code with gpud's own reading of them."""

from __future__ import annotations

import os
from pathlib import Path


def realpath_root(sys_root: Path, address: str) -> str:
    """The oracle: where the kernel's link leads, as the OS resolves it, first part under devices/."""
    real = Path(os.path.realpath(sys_root / "bus" / "pci" / "devices" / address))
    return real.relative_to(sys_root.resolve() / "devices").parts[0]
