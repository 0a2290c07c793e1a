"""GPU reset the way the driver supports it: `nvidia-smi -r -i <PCI>` while nvidia is bound.

Why not sysfs `reset`: with the nvidia module bound, NVIDIA's tools never reset through sysfs;
mig-parted shuts NVML down and runs `nvidia-smi -r -i <ids>`, and only uses a PCI reset when the
module is not loaded (docs/hardware/gpu-reset.md). A sysfs reset under a bound nvidia driver resets
the function behind the driver's back. So: nvidia-bound GPUs go through nvidia-smi, whose exit
status and words say whether it worked and why not; a function no nvidia driver is bound to is
reset through sysfs (with the deadline the caller's sysfs adapter gives it).

The caller must close its own NVML session first: nvidia-smi refuses ("In use by another client")
while any client, gpud included, holds the GPU's device node.
"""

from __future__ import annotations

import subprocess
from typing import Any

from msgspec import Struct

from gpud.host.readonly import refuse_if

IN_USE_WORDS = "In use by another client"
IN_USE_WORDS_OLD = "is currently in use by another process"  # older drivers (gpu-operator#118)
# Services that commonly keep a GPU open and block a reset (gpu-operator#118, DCGM#276,
# mig-parted#181): named in the GPU's state when they run, whether or not gpud could see their fds.
KNOWN_HOLDERS = ("nvidia-persistenced", "nv-hostengine", "nv-fabricmanager", "nvidia-fabricmanager", "Xorg")


class ResetResult(Struct, frozen=True):
    ok: bool
    method: str  # "nvidia-smi" | "sysfs"
    exit_status: int | None  # nvidia-smi's; None for sysfs or when it could not run
    output: str  # nvidia-smi's stdout + stderr, or the error

    @property
    def in_use(self) -> bool:
        return IN_USE_WORDS in self.output or IN_USE_WORDS_OLD in self.output

    def summary(self) -> str:
        """One line for a GPU's state: the tool's first meaningful words."""
        lines = [ln.strip() for ln in self.output.splitlines() if ln.strip()]
        text = "; ".join(lines[:2]) if lines else "no output"
        if self.method == "nvidia-smi" and self.exit_status is not None:
            return f"nvidia-smi exit {self.exit_status}: {text}"
        return text


class GpuReset:
    """Resets one GPU: `command` is nvidia-smi (a path, or an argv list for a wrapper)."""

    def __init__(self, command: str | list[str] = "nvidia-smi", *, sysfs: Any = None, timeout: float = 120.0,
                 read_only: bool = False) -> None:
        self.command = [command] if isinstance(command, str) else list(command)
        self.sysfs = sysfs  # used only for a function no nvidia driver is bound to
        self.timeout = timeout
        self.read_only = read_only

    def argv(self, pci: str) -> list[str]:
        return [*self.command, "-r", "-i", pci]

    def reset(self, pci: str, driver: str | None) -> ResetResult:
        refuse_if(self.read_only, "reset", pci)
        if driver != "nvidia":
            return self._sysfs_reset(pci)
        argv = self.argv(pci)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout, check=False,
                                  stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            return ResetResult(False, "nvidia-smi", None, f"{argv[0]} not found (set --nvidia-smi)")
        except subprocess.TimeoutExpired:
            return ResetResult(False, "nvidia-smi", None, f"{' '.join(argv)} did not finish in {self.timeout:g}s")
        output = (done.stdout + ("\n" if done.stdout and done.stderr else "") + done.stderr).strip()
        return ResetResult(done.returncode == 0, "nvidia-smi", done.returncode, output)

    def _sysfs_reset(self, pci: str) -> ResetResult:
        if self.sysfs is None:
            return ResetResult(False, "sysfs", None, "no sysfs access to reset it")
        try:
            self.sysfs.reset(pci)
        except OSError as e:
            return ResetResult(False, "sysfs", None, f"sysfs reset of {pci} failed: {e}")
        return ResetResult(True, "sysfs", None, "")


__all__ = ["GpuReset", "ResetResult", "KNOWN_HOLDERS"]
