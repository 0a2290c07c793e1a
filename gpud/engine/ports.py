"""What the engine needs from the host's services, as Protocols: the reconciler is handed these
at start (systemd/logind on a real host, absent or fakes elsewhere) and depends on nothing more."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu


class Drainer(Protocol):
    """Stops and starts the GPU client units around a disruptive step (systemd's UnitDrainer)."""

    def drained(self, units: Iterable[str]) -> contextlib.AbstractAsyncContextManager[list[str]]:
        """The body runs with `units` stopped; what was stopped is started again afterwards."""

    async def restart_if_present(self, unit: str) -> bool:
        """Restart `unit` when it is installed; False when it is not."""


class BootOverrides(Protocol):
    """Keeps the boot-time vfio-pci overrides (udev rules) in step with the layout."""

    path: str

    def sync(self, gpus: Sequence[Gpu], desired: Mapping[str, DesiredGpu]) -> bool:
        """Rewrite the overrides for the layout; True when the file changed."""


class Rebooter(Protocol):
    """Asks for one reboot (logind), recording why in the state dir; False when an earlier reboot
    for the same cause did not settle it."""

    async def __call__(self, state_dir: str, reason: str) -> bool: ...
