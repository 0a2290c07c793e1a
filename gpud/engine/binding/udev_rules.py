"""Boot persistence of passthrough: a udev rules file that sets driver_override on `add`.

driver_override lives on the kernel's device object: a reboot or a remove/rescan forgets it, and
nvidia then claims the GPU before gpud starts. A rule on ACTION=="add" writes the override while
udev processes the device's add event, before its modalias loads a driver module (the kmod builtin
runs after all rules), the way driverctl does it. The file is derived from the layout (never edited
by hand), replaced atomically and only when its content changes, and entries disappear when a GPU
goes back to containers.

Known race (also driverctl's): if the nvidia module is already loaded (initramfs, or loaded by
another GPU's add event processed first) it may bind before the rule runs; gpud's first pass after
start rebinds such a GPU. vfio-pci is loaded at boot only where a layout pins a GPU: each rule
loads it (udev's kmod builtin, outside gpud's sandbox); nothing loads it on hosts without
passthrough (no modules-load.d file). While gpud runs, it asks systemd for modprobe@vfio_pci.service
when a layout needs the module (gpud.host.systemd.modules). Keep nvidia out of the initramfs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from gpud.host.files.safe_file import UnsafeFile, read_file, remove_file, write_file
from gpud.host.readonly import refuse_if
from gpud.model import Gpu
from gpud.pci import is_bridge
from gpud.plan.binding import VFIO, vfio_driver

DEFAULT_PATH = "/etc/udev/rules.d/70-gpud-vfio.rules"

_HEADER = """\
# Written by gpud from its layout; do not edit: every change of the layout rewrites this file.
# Sets driver_override before a driver probes the device at boot, so the native driver never
# claims a vm-passthrough GPU or another endpoint of its IOMMU group, and loads vfio-pci for it:
# only hosts whose layout passes a GPU through load vfio-pci at boot.
"""


def passthrough_endpoints(gpus: Sequence[Gpu], desired: Mapping[str, object]) -> list[str]:
    """Every endpoint that must be on vfio-pci at boot: each passthrough GPU and the other
    non-bridge endpoints of its IOMMU group. `desired` maps pci -> DesiredGpu (or a workload
    string). A desired GPU not seen now (fallen off the bus) keeps its own entry."""
    wanted = {pci for pci, d in desired.items() if _workload(d) == "vm-passthrough"}
    out: set[str] = set(wanted)
    for gpu in gpus:
        if gpu.pci not in wanted:
            continue
        out.update(c.address for c in gpu.companions if not is_bridge(c.class_code))
    return sorted(out)


def _workload(d: object) -> str:
    return d if isinstance(d, str) else getattr(d, "workload", "container")


def render(endpoints: Iterable[str], drivers: Mapping[str, str] | None = None) -> str:
    """The rules file for these PCI addresses; "" when there is nothing to pin. `drivers`: an
    endpoint's VFIO variant driver where modules.alias names one (gpud.plan.binding.vfio_driver),
    else vfio-pci; the driver's module has the same name."""
    addrs = sorted(set(endpoints))
    if not addrs:
        return ""
    lines = [_HEADER]
    for a in addrs:
        _check_address(a)
        drv = (drivers or {}).get(a, VFIO)
        if not all(c.isalnum() or c in "_-" for c in drv):
            raise ValueError(f"not a driver name: {drv!r}")
        lines.append(
            f'ACTION=="add", SUBSYSTEM=="pci", KERNEL=="{a}", ATTR{{driver_override}}="{drv}", '
            f'RUN{{builtin}}+="kmod load {drv}"\n'
        )
    return "".join(lines)


def _check_address(a: str) -> None:
    """Addresses go into a file root's udevd parses: only well-formed domain:bus:slot.fn."""
    parts = a.split(":")
    ok = (
        len(parts) == 3 and len(parts[0]) == 4 and len(parts[1]) == 2 and len(parts[2]) == 4
        and parts[2][2] == "." and all(c in "0123456789abcdef" for c in (parts[0] + parts[1] + parts[2][:2] + parts[2][3]))
    )
    if not ok:
        raise ValueError(f"not a PCI address: {a!r}")


def write_if_changed(path: str, content: str, *, read_only: bool = False, mode: int = 0o644) -> bool:
    """Make `path` hold `content` ("" removes it). Atomic (temp file + fsync + rename in the same
    directory) so udevd never reads half a file. Returns whether anything changed."""
    try:
        current: str | None = read_file(path, 1 << 20).decode("utf-8", "replace")
    except FileNotFoundError:
        current = None
    except UnsafeFile:  # not a regular file: replaced by the rename below, never followed
        current = None
    if (current is None and not content) or (content and current == content):
        return False
    refuse_if(read_only, "write udev rules", path)
    if content:
        write_file(path, content.encode(), mode=mode, make_dir=True)
    else:
        remove_file(path)
    return True


class UdevRules:
    """Keeps the rules file in step with the layout."""

    def __init__(self, path: str = DEFAULT_PATH, *, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only

    def sync(self, gpus: Sequence[Gpu], desired: Mapping[str, object]) -> bool:
        """Rewrite the rules for the current layout; True when the file changed."""
        drivers = {f.address: vfio_driver(f) for g in gpus for f in (g.function, *g.companions)}
        return write_if_changed(self.path, render(passthrough_endpoints(gpus, desired), drivers), read_only=self.read_only)
