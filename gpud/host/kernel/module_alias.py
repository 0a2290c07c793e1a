"""Which VFIO driver takes a PCI device: a VFIO variant driver when the kernel's modules.alias
names one for it, else vfio-pci.

Linux lets a VFIO variant driver (nvgrace_gpu_vfio_pci for Grace GPUs, mlx5_vfio_pci, ...) list
device ids that match only through driver_override (PCI_DRIVER_OVERRIDE_DEVICE_VFIO); kbuild
writes them into modules.alias with the modalias prefixed "vfio_" (`alias
vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci`). The userspace algorithm given
with that change (linux-pci, "PCI: Add a PCI_ID_F_VFIO_DRIVER_OVERRIDE flag to struct
pci_device_id", 2021): read the device's modalias, prefix it with "vfio_", select the
modules.alias entry with the fewest '*', modprobe that module, write it to driver_override and
probe (docs/hardware/grace.md).
"""

from __future__ import annotations

import os
from fnmatch import fnmatchcase

VFIO_PCI_MODULE = "vfio_pci"


def default_path() -> str:
    """This machine's kernel's modules.alias (depmod writes it for every installed kernel)."""
    return f"/lib/modules/{os.uname().release}/modules.alias"


class ModuleAliases:
    """The `alias vfio_pci:...` lines of one modules.alias, read again when the file changes."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or default_path()
        self._seen: tuple[float, int] | None = None
        self._vfio: list[tuple[str, str]] = []  # (pattern, module)

    def _load(self) -> list[tuple[str, str]]:
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen, self._vfio = None, []
            return []
        key = (st.st_mtime, st.st_size)
        if key != self._seen:
            out = []
            with open(self.path, errors="replace") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 3 and parts[0] == "alias" and parts[1].startswith("vfio_pci:"):
                        out.append((parts[1], parts[2]))
            self._seen, self._vfio = key, out
        return self._vfio

    def vfio_variant(self, modalias: str | None) -> str | None:
        """The variant driver's module for a device of `modalias` (`pci:v...`), or None when the
        best match is vfio-pci itself or nothing matches (plain vfio-pci)."""
        if not modalias:
            return None
        name = "vfio_" + modalias.strip()
        matches = [(pattern.count("*"), module) for pattern, module in self._load() if fnmatchcase(name, pattern)]
        if not matches:
            return None
        module = min(matches)[1]
        return None if module == VFIO_PCI_MODULE else module
