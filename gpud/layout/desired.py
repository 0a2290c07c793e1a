"""What the layout asks of one GPU, and the problems found while reading it.

These records are the hand-off from `gpud.layout` to `gpud.plan`: the planner never sees YAML.
"""

from __future__ import annotations

import msgspec


class DesiredGpu(msgspec.Struct, frozen=True):
    pci: str
    index: int
    entry: str  # key path of the layout entry that selected this GPU: "layouts.partial-mig[0]"
    workload: str = "container"  # container | vm-passthrough | vm-vgpu
    mig_enabled: bool | None = None  # None: the entry says nothing about MIG; leave it as it is
    mig_devices: dict[str, int] = msgspec.field(default_factory=dict)  # names as written
    # vm-vgpu: type name (bare, no "NVIDIA " prefix) -> count. MIG-backed types also fill
    # mig_enabled / mig_devices with the GPU instances they need.
    vgpu_devices: dict[str, int] = msgspec.field(default_factory=dict)
    # `mig-devices: dynamic`: leases make this GPU's instances (gpud.engine.leases); the static
    # planner leaves its instances alone and only sees to the MIG mode where leases cannot.
    dynamic: bool = False


class LayoutIssue(msgspec.Struct, frozen=True):
    """One error or warning about the layout, pointing at the file, line and key path."""

    file: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        return f"{where} {self.path}: {self.message}" if self.path else f"{where}: {self.message}"
