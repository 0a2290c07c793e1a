"""The CDI spec regenerated with NVIDIA Container Toolkit's own tool after MIG devices changed.

mig-manager does this under the GPU Operator's default `cdi.enabled=true` (NVIDIA/mig-parted
deployments/gpu-operator/reconfigure-mig.sh: `nvidia-ctk cdi generate --output=...` before the
operands are restored), because containers get MIG devices by the CDI names in that spec and the
toolkit does not notice a MIG change on its own (nvidia-container-toolkit #1828). Used when the
toolkit's own refresh unit (nvidia-cdi-refresh.service) is not installed.
"""

from __future__ import annotations

import asyncio
import os

DEFAULT_SPEC = "/var/run/cdi/nvidia.yaml"
TIMEOUT_S = 120.0


class CdiError(Exception):
    """nvidia-ctk did not regenerate the spec; the message says why."""


class CdiGenerator:
    """`prefix`: how a program runs on this host (empty on a real one); `driver_root`: where the
    driver's libraries and device nodes are (nvidia-ctk's --driver-root; / needs no flag)."""

    def __init__(self, nvidia_ctk: str, output: str = DEFAULT_SPEC, *, timeout: float = TIMEOUT_S,
                 prefix: tuple[str, ...] = (), driver_root: str = "/") -> None:
        self.nvidia_ctk, self.output, self.timeout = nvidia_ctk, output, timeout
        self.prefix, self.driver_root = prefix, driver_root

    def argv(self) -> list[str]:
        root = [] if self.driver_root == "/" else [f"--driver-root={self.driver_root}"]
        return [*self.prefix, self.nvidia_ctk, "cdi", "generate", *root, f"--output={self.output}"]

    async def __call__(self) -> str:
        """Run it; returns what happened. Raises CdiError (not found, failed, timed out)."""
        os.makedirs(os.path.dirname(self.output) or ".", exist_ok=True)
        try:
            proc = await asyncio.create_subprocess_exec(*self.argv(), stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
        except OSError as e:
            raise CdiError(f"{self.nvidia_ctk}: {e.strerror or e}") from e
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise CdiError(f"{' '.join(self.argv())}: no answer in {self.timeout:.0f}s") from None
        if proc.returncode != 0:
            tail = out.decode(errors="replace").strip().splitlines()[-3:]
            raise CdiError(f"{' '.join(self.argv())} exited {proc.returncode}: {' / '.join(tail)}")
        return f"CDI spec regenerated: {' '.join(self.argv())}"
