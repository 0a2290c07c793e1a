"""What the engine is handed at start and depends on: the host's adapters (`Hardware`, built by
gpud.hardware for a real or a simulated host) and the host's services as Protocols (systemd and
logind on a real host, absent or fakes elsewhere)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import msgspec

from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.nvidia.gpu_reset import GpuReset
from gpud.host.nvidia.nvml import Nvml
from gpud.host.nvidia.sriov_manage import SriovManage
from gpud.host.nvidia.vgpu_sysfs import VgpuSysfs
from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu
from gpud.plan.operand_impact import Impact


class Clock(Protocol):
    """Time for the waits a step bounds itself (a driver registering, udev making a node)."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The system's monotonic clock: what the daemon waits by."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Hardware(msgspec.Struct):
    """The adapters one daemon drives, chosen once at start (real host or simulator). The engine
    builds none of them: gpud.hardware does, with the paths and deadlines the host config gives."""

    sysfs: Sysfs
    nvml: Nvml
    procs: Procs
    vgpu: VgpuSysfs  # both vGPU interfaces, over `sysfs` and `procs`
    reset: GpuReset | None = None  # nvidia-smi -r for nvidia-bound GPUs; None: resets are left to the operator
    vf_tool: SriovManage | None = None  # NVIDIA's sriov-manage: VFs on and off; None: VFs are not changed
    clock: Clock = msgspec.field(default_factory=SystemClock)  # a test's own where real waits cost only time


class UnitStopper(Protocol):
    def drained(self, units: Iterable[str]) -> contextlib.AbstractAsyncContextManager[list[str]]:
        """The body runs with `units` stopped; what was stopped is started again afterwards."""


class UnitRestarter(Protocol):
    async def restart_if_present(self, unit: str) -> bool:
        """Restart `unit` when it is installed; False when it is not."""


class Drainer(UnitStopper, UnitRestarter, Protocol):
    """Stops and starts the GPU client units around a disruptive step (systemd's UnitDrainer); a
    caller that needs only one half names that half."""


class BootOverrides(Protocol):
    """Keeps the boot-time vfio-pci overrides (udev rules) in step with the layout."""

    path: str

    def sync(self, gpus: Sequence[Gpu], desired: Mapping[str, DesiredGpu]) -> bool:
        """Rewrite the overrides for the layout; True when the file changed."""


class Rebooter(Protocol):
    """Asks for one reboot (logind), recording why in the state dir; False when an earlier reboot
    for the same cause did not settle it."""

    async def __call__(self, state_dir: str, reason: str) -> bool: ...


class OperandsNotPaused(Exception):
    """The operands that see the changing GPUs could not be taken off the node: change nothing."""


class OperandGuard(Protocol):
    """The seam between a pass and the cluster's GPU operands: what the pass calls around the GPUs
    it changes. Without Kubernetes there is none; with `--kube-node` it is the kube agent
    (gpud.engine.kube.agent), which nothing here imports (that would pull in the Kubernetes client)."""

    def operands_paused(self, impact: Impact) -> contextlib.AbstractAsyncContextManager[None]:
        """The body runs with the operands that see `impact`'s GPUs paused (none for no change);
        raises OperandsNotPaused before the body when they cannot be."""

    async def before_reboot(self, reason: str) -> None:
        """Called before the engine asks for a reboot."""
