"""SR-IOV VFs of an NVIDIA GPU through NVIDIA's `sriov-manage -e|-d <BDF>` (--sriov-manage).

Why not `sriov_numvfs`: the nvidia PCI driver has no `.sriov_configure`, so the kernel answers a
write on a PF bound to nvidia with ENOENT (docs/hardware/sriov.md). NVIDIA's script takes the
driver's unbind lock, moves the PF to pci-pf-stub, writes `sriov_numvfs`, binds nvidia back, turns
persistence mode on and binds the VFs to nvidia. The unbind lock is refused ("Cannot obtain
unbindLock") while anything holds the GPU, an NVML client included: the caller closes its own NVML
session first, and a refusal is retried a bounded number of times (another client's brief NVML
look is the usual cause; vgpu-device-manager and cubecos retry the same way), then reported so that
the caller can name what holds the GPU.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable

from msgspec import Struct

from gpud.host.readonly import refuse_if

DEFAULT_PATH = "/usr/lib/nvidia/sriov-manage"
# One run at a time in this process: the script writes pci-pf-stub's `new_id` (and `remove_id`),
# which the kernel makes global to the driver: every unbound device of that vendor:device probes
# against it. Two GPUs of one model enabled side by side, one run's `new_id` grabbed the other GPU
# while it was unbound, and that GPU's own bind failed EBUSY (left on pci-pf-stub with no vGPUs,
# about one first apply in three). The runs of different GPUs are serialised here; the rest of
# each GPU's work stays parallel.
KERNEL_GLOBAL = threading.Lock()
LOCK_REFUSED = "Cannot obtain unbindLock"


class VfResult(Struct, frozen=True):
    ok: bool
    exit_status: int | None
    output: str  # the tool's stdout + stderr, or why it could not run
    attempts: int = 1

    @property
    def lock_refused(self) -> bool:
        return LOCK_REFUSED.lower() in self.output.lower()

    def summary(self) -> str:
        lines = [ln.strip() for ln in self.output.splitlines() if ln.strip()]
        text = "; ".join(lines[-2:]) if lines else "no output"
        status = f"exit {self.exit_status}" if self.exit_status is not None else "did not run"
        tries = f" after {self.attempts} attempts" if self.attempts > 1 else ""
        return f"sriov-manage {status}{tries}: {text}"


class SriovManage:
    """Runs `command -e|-d <BDF>`; `command` is a path or an argv list (a wrapper)."""

    def __init__(self, command: str | list[str] = DEFAULT_PATH, *, timeout: float = 120.0, attempts: int = 5,
                 delay: float = 1.0, read_only: bool = False, sleep: Callable[[float], None] = time.sleep) -> None:
        self.command = [command] if isinstance(command, str) else list(command)
        self.timeout = timeout
        self.attempts = max(1, attempts)
        self.delay = delay
        self.read_only = read_only
        self._sleep = sleep

    def argv(self, op: str, pf: str) -> list[str]:
        return [*self.command, op, pf]

    def enable(self, pf: str) -> VfResult:
        return self._run("-e", pf)

    def disable(self, pf: str) -> VfResult:
        return self._run("-d", pf)

    def _run(self, op: str, pf: str) -> VfResult:
        refuse_if(self.read_only, f"sriov-manage {op}", pf)
        result = VfResult(False, None, "not run")
        for attempt in range(1, self.attempts + 1):
            with KERNEL_GLOBAL:
                result = self._once(op, pf, attempt)
            if result.ok or not result.lock_refused or attempt == self.attempts:
                return result
            self._sleep(self.delay * attempt)
        return result

    def _once(self, op: str, pf: str, attempt: int) -> VfResult:
        argv = self.argv(op, pf)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout, check=False,
                                  stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            return VfResult(False, None, f"{argv[0]} not found (NVIDIA's vGPU host driver installs it; "
                                         "set --sriov-manage)", attempt)
        except subprocess.TimeoutExpired:
            return VfResult(False, None, f"{' '.join(argv)} did not finish in {self.timeout:g}s", attempt)
        output = (done.stdout + ("\n" if done.stdout and done.stderr else "") + done.stderr).strip()
        # The script's exit status does not always say: after a refused lock it may still exit 0.
        return VfResult(done.returncode == 0 and LOCK_REFUSED.lower() not in output.lower(), done.returncode,
                        output, attempt)


__all__ = ["DEFAULT_PATH", "LOCK_REFUSED", "SriovManage", "VfResult"]
