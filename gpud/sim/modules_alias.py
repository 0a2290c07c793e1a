"""The simulated host's modules.alias (DIR/lib/modules/<this kernel's release>/modules.alias):
the lines of the modules the simulated host has that choose a GPU's driver, written by
`gpud-sim create` (a real file lists every module's aliases; only these are modelled).

- nvidia claims NVIDIA display controllers (class 03, subclasses 00 and 02);
- vfio_pci's table is one PCI_DRIVER_OVERRIDE_DEVICE_VFIO(PCI_ANY_ID, PCI_ANY_ID) entry:
  `vfio_pci:v*d*sv*sd*bc*sc*i*` (the example of the kernel change that added the "vfio_" prefix);
- a host with a Grace GPU (an arm64 kernel: nvgrace-gpu-vfio-pci depends on ARM64) has
  nvgrace_gpu_vfio_pci's override-only ids (drivers/vfio/pci/nvgrace-gpu/main.c,
  nvgrace_gpu_vfio_pci_table). docs/hardware/grace.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpud.profiles import MODELS
from gpud.sim.state import SimState
from gpud.sim.sysfs_tree import NVGRACE, NVGRACE_IDS


def path(host_dir: str | os.PathLike) -> Path:
    return Path(host_dir) / "lib" / "modules" / os.uname().release / "modules.alias"


def text(state: SimState) -> str:
    lines = ["alias pci:v000010DEd*sv*sd*bc03sc00i00* nvidia", "alias pci:v000010DEd*sv*sd*bc03sc02i00* nvidia",
             "alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci"]
    if any(MODELS[g.model].coherent for g in state.gpus.values()):
        lines += [f"alias vfio_pci:v000010DEd{dev:08X}sv*sd*bc*sc*i* {NVGRACE}" for dev in NVGRACE_IDS]
    return "\n".join(lines) + "\n"


def write(host_dir: str | os.PathLike, state: SimState) -> Path:
    p = path(host_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text(state))
    return p
