"""The nvidia module's parameters as the driver states them in /proc/driver/nvidia/params, one
`Name: value` per line, strings quoted (kernel-open/nvidia/nv-procfs.c, nv_procfs_read_params:
`CoherentGPUMemoryMode: "%s"`, empty when the parameter was not given)."""

from __future__ import annotations

import os


def coherent_memory_mode(proc_root: str = "/proc") -> str | None:
    """CoherentGPUMemoryMode ("driver": CDMM; "numa" or "": memory onlined as a NUMA node, the
    driver's default, kernel-open/nvidia/nv-reg.h); None when the file or the line is absent (a
    driver without the parameter, or none loaded)."""
    try:
        with open(os.path.join(proc_root, "driver", "nvidia", "params")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        name, sep, value = line.partition(":")
        if sep and name.strip() == "CoherentGPUMemoryMode":
            return value.strip().strip('"')
    return None
