"""GPU reset the way the driver supports it: `nvidia-smi -r -i <PCI>` while nvidia is bound.

Why not sysfs `reset`: with the nvidia module bound, NVIDIA's tools never reset through sysfs;
mig-parted shuts NVML down and runs `nvidia-smi -r -i <ids>`, and only uses a PCI reset when the
module is not loaded (docs/hardware/gpu-reset.md). A sysfs reset under a bound nvidia driver resets
the function behind the driver's back. So: nvidia-bound GPUs go through nvidia-smi, whose exit
status and words say whether it worked and why not; a function no nvidia driver is bound to is
reset through sysfs (with the deadline the caller's sysfs adapter gives it).

The caller must close its own NVML session first: nvidia-smi refuses ("In use by another client")
while any client, gpud included, holds the GPU's device node.

Persistence mode counts as an attachment too (NVIDIA/NVSentinel#1690, PR #1692; gpu-operator#118),
in legacy mode (`nvidia-smi -pm 1`, which NVIDIA's sriov-manage itself sets) as with
nvidia-persistenced: a GPU with persistence on is turned off for the reset (`nvidia-smi -pm 0 -i
<PCI>`, which goes through the daemon when one runs) and on again after, on the error path too.
The intent is written to `intent_path` before and removed after, so that a gpud killed between
the two restores it at its next start (`restore_pending`) instead of leaving it off.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from msgspec import Struct

from gpud.host.readonly import refuse_if

IN_USE_WORDS = "In use by another client"
IN_USE_WORDS_OLD = "is currently in use by another process"  # older drivers (gpu-operator#118)
# Services that commonly keep a GPU open and block a reset (gpu-operator#118, DCGM#276,
# mig-parted#181): named in the GPU's state when they run, whether or not gpud could see their fds.
# Not Fabric Manager: nvidia-smi(1)'s -r section has it *running* for a GPU to reset alone on Ampere
# NVSwitch systems, and Hopper and later do not depend on it (docs/hardware/gpu-reset.md).
PERSISTENCED = "nvidia-persistenced"  # /proc/PID/comm shows its first 15 characters
KNOWN_HOLDERS = (PERSISTENCED, "nv-hostengine", "Xorg")


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
                 read_only: bool = False, intent_path: str | None = None) -> None:
        self.command = [command] if isinstance(command, str) else list(command)
        self.sysfs = sysfs  # used only for a function no nvidia driver is bound to
        self.timeout = timeout
        self.read_only = read_only
        self.intent_path = intent_path  # GPUs whose persistence gpud turned off and must turn on again

    def argv(self, pci: str) -> list[str]:
        return [*self.command, "-r", "-i", pci]

    def _run(self, args: list[str]) -> ResetResult:
        argv = [*self.command, *args]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout, check=False,
                                  stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            return ResetResult(False, "nvidia-smi", None, f"{argv[0]} not found (set --nvidia-smi)")
        except subprocess.TimeoutExpired:
            return ResetResult(False, "nvidia-smi", None, f"{' '.join(argv)} did not finish in {self.timeout:g}s")
        output = (done.stdout + ("\n" if done.stdout and done.stderr else "") + done.stderr).strip()
        return ResetResult(done.returncode == 0, "nvidia-smi", done.returncode, output)

    def persistence(self, pci: str) -> bool | None:
        """Is persistence mode on for the GPU (None: nvidia-smi could not say)?"""
        r = self._run(["--query-gpu=persistence_mode", "--format=csv,noheader", "-i", pci])
        word = r.output.strip().splitlines()[-1].strip() if r.ok and r.output.strip() else ""
        return {"Enabled": True, "Disabled": False}.get(word)

    def set_persistence(self, pci: str, on: bool) -> ResetResult:
        refuse_if(self.read_only, "persistence mode", pci)
        return self._run(["-pm", "1" if on else "0", "-i", pci])

    def reset(self, pci: str, driver: str | None, persistent: bool | None = None) -> ResetResult:
        """`persistent`: persistence mode as the caller's NVML session read it before closing
        (nvmlDeviceGetPersistenceMode, what nvidia-smi's `persistence_mode` reports: nvidia-smi is
        built on NVML); None: nvidia-smi is asked (one more process start)."""
        refuse_if(self.read_only, "reset", pci)
        if driver != "nvidia":
            return self._sysfs_reset(pci)
        if not (self.persistence(pci) if persistent is None else persistent):
            return self._run(["-r", "-i", pci])
        self._intend(pci, True)
        off = self.set_persistence(pci, False)
        if not off.ok:
            self._intend(pci, False)
            return ResetResult(False, "nvidia-smi", off.exit_status,
                               f"persistence mode could not be turned off for the reset: {off.output}")
        result = self._run(["-r", "-i", pci])
        on = self.set_persistence(pci, True)
        if on.ok:
            self._intend(pci, False)
            return result
        return ResetResult(result.ok, result.method, result.exit_status,
                           f"{result.output}\npersistence mode could not be turned on again: {on.output}")

    # ---- the intent record (a crash between -pm 0 and -pm 1)
    def _pending(self) -> list[str]:
        if self.intent_path is None:
            return []
        from gpud.host.files import state_files  # the one safe reader: a FIFO here hung the start

        return state_files.load(self.intent_path, _decode_intent, limit=65536, what="persistence intent") or []

    def _intend(self, pci: str, pending: bool) -> None:
        if self.intent_path is None:
            return
        from gpud.host.files.safe_file import remove_file, write_file

        now = [p for p in self._pending() if p != pci] + ([pci] if pending else [])
        if now:
            os.makedirs(os.path.dirname(self.intent_path) or ".", exist_ok=True)
            write_file(self.intent_path, json.dumps(now).encode(), mode=0o600)
        else:
            try:
                remove_file(self.intent_path)
            except FileNotFoundError:
                pass

    def restore_pending(self) -> list[str]:
        """At start: persistence back on for GPUs a previous gpud left off mid-reset; returns them."""
        done = []
        for pci in self._pending():
            if self.set_persistence(pci, True).ok:
                done.append(pci)
                self._intend(pci, False)
        return done

    def _sysfs_reset(self, pci: str) -> ResetResult:
        if self.sysfs is None:
            return ResetResult(False, "sysfs", None, "no sysfs access to reset it")
        try:
            self.sysfs.reset(pci)
        except OSError as e:
            return ResetResult(False, "sysfs", None, f"sysfs reset of {pci} failed: {e}")
        return ResetResult(True, "sysfs", None, "")


def _decode_intent(data: bytes) -> list[str]:
    got = json.loads(data)
    if not isinstance(got, list) or not all(isinstance(p, str) for p in got):
        raise ValueError("expected a JSON list of PCI addresses")
    return got


__all__ = ["GpuReset", "ResetResult", "KNOWN_HOLDERS", "PERSISTENCED"]
