"""What the host around the GPUs offers gpud, read without changing anything (`gpud qualify`).

Every answer comes from a file the kernel or a service keeps, under roots that default to the real
ones and point into a simulated host directory under `--sim`:
- systemd: `/run/systemd/system` is a directory exactly when systemd is PID 1 (sd_booted(3));
- D-Bus system bus: the socket `$DBUS_SYSTEM_BUS_ADDRESS` names, else `/run/dbus/system_bus_socket`
  (the D-Bus specification's default), accepting a connection (a connect changes nothing);
- udev: `/run/udev/control` is the socket systemd-udevd listens on (what `udevadm control` uses);
- a kernel module is loaded when `/sys/module/<name>` exists, and can be loaded when
  `modules.dep` or `modules.builtin` of the running kernel (`/lib/modules/$(uname -r)`) lists it;
- running services are found by process name in `/proc/<pid>/comm`, which the kernel truncates to
  15 bytes (TASK_COMM_LEN 16 with the NUL), so "nv-fabricmanager" shows as "nv-fabricmanage".
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable

from msgspec import Struct

from gpud.host.kernel.procs import process_name

COMM_LEN = 15  # bytes of a process name the kernel keeps in /proc/<pid>/comm


class Found(Struct, frozen=True):
    """One answer with the evidence it was read from (a path, a socket), said in the report."""

    present: bool
    evidence: str


class ModuleState(Struct, frozen=True):
    name: str
    loaded: bool
    available: bool | None  # None: the kernel's module lists could not be read
    evidence: str


class HostServices:
    def __init__(self, *, proc_root: str = "/proc", sys_root: str = "/sys", run_root: str = "/run",
                 modules_root: str = "/lib/modules", kernel_release: str | None = None,
                 system_bus: str | None = None):
        self.proc_root = proc_root
        self.sys_root = sys_root
        self.run_root = run_root
        self.modules_root = modules_root
        self.kernel_release = kernel_release or os.uname().release
        self.system_bus = system_bus

    def systemd(self) -> Found:
        path = os.path.join(self.run_root, "systemd", "system")
        return Found(os.path.isdir(path), path)

    def udev(self) -> Found:
        path = os.path.join(self.run_root, "udev", "control")
        return Found(os.path.exists(path), path)

    def system_bus_path(self) -> str:
        if self.system_bus:
            return self.system_bus
        address = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS", "")
        for part in address.split(";"):
            if part.startswith("unix:path="):
                return part.split("=", 1)[1].split(",")[0]
        return os.path.join(self.run_root, "dbus", "system_bus_socket")

    def dbus(self) -> Found:
        """The system bus accepts a connection (no message is sent)."""
        path = self.system_bus_path()
        if not os.path.exists(path):
            return Found(False, f"{path} does not exist")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            try:
                s.connect(path)
            except OSError as e:
                return Found(False, f"{path}: {e.strerror or e}")
        return Found(True, path)

    def module(self, name: str) -> ModuleState:
        mod = name.replace("-", "_")
        loaded = os.path.isdir(os.path.join(self.sys_root, "module", mod))
        base = os.path.join(self.modules_root, self.kernel_release)
        listed: bool | None = None
        read = []
        for list_name in ("modules.dep", "modules.builtin"):
            path = os.path.join(base, list_name)
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            read.append(path)
            listed = bool(listed) or _lists_module(text, mod)
        evidence = f"/sys/module/{mod} {'present' if loaded else 'absent'}; " + (
            f"{' and '.join(read)} {'list' if listed else 'do not list'} it" if read
            else f"no modules.dep under {base}")
        return ModuleState(name, loaded, listed, evidence)

    def running(self, names: Iterable[str]) -> dict[str, list[int]]:
        """name -> pids of processes whose comm is that name (as the kernel truncates it)."""
        wanted = {n[:COMM_LEN]: n for n in names}
        out: dict[str, list[int]] = {n: [] for n in wanted.values()}
        try:
            pids = sorted((p for p in os.listdir(self.proc_root) if p.isdigit()), key=int)
        except OSError:
            return out
        for pid in pids:
            comm = process_name(self.proc_root, pid)
            if comm is not None and comm in wanted:
                out[wanted[comm]].append(int(pid))
        return out

    def nvidia_kernel_module(self) -> str | None:
        """The first line of /proc/driver/nvidia/version ("NVRM version: NVIDIA UNIX Open Kernel
        Module for x86_64  580.159.04  Release Build ..."), None when the module is not loaded."""
        try:
            with open(os.path.join(self.proc_root, "driver", "nvidia", "version"), encoding="utf-8",
                      errors="replace") as f:
                return f.readline().strip()
        except OSError:
            return None

    def kernel_cmdline(self) -> str | None:
        try:
            with open(os.path.join(self.proc_root, "cmdline"), encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return None

    def iommu_groups(self) -> int | None:
        """How many IOMMU groups the kernel made (0: no IOMMU in use); None when unreadable."""
        try:
            return len([n for n in os.listdir(os.path.join(self.sys_root, "kernel", "iommu_groups"))
                        if n.isdigit()])
        except FileNotFoundError:
            return 0
        except OSError:
            return None

    def reset_methods(self, address: str) -> str | None:
        """The kernel's reset methods of a PCI function (`reset_method`, Linux 5.15+), e.g. "flr bus"."""
        try:
            with open(os.path.join(self.sys_root, "bus", "pci", "devices", address, "reset_method"),
                      encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return None


def _lists_module(text: str, mod: str) -> bool:
    """modules.dep lines start `kernel/drivers/vfio/pci/vfio-pci.ko.xz:`; file names use - or _."""
    for line in text.splitlines():
        path = line.split(":", 1)[0]
        base = os.path.basename(path)
        stem = base.split(".ko", 1)[0] if ".ko" in base else None
        if stem is not None and stem.replace("-", "_") == mod:
            return True
    return False
