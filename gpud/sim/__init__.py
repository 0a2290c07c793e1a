"""The GPU host simulator: a host directory (`gpud-sim create DIR`) plus a fake NVML library.

`install(DIR)` points pynvml at the simulated host and returns the paths and callables the
sysfs/procs adapters take instead of /sys, /proc, /dev and os.write, so gpud.host runs unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class _Store:
    """`store(abs_path, data)` of the simulated kernel; imported on first use so that installing the
    fake NVML does not need the kernel model (and no import cycle forms)."""

    def __init__(self, host_dir: Path):
        self.host_dir = host_dir
        self._impl: Callable[[str | os.PathLike, bytes], int] | None = None

    def __call__(self, abs_path: str | os.PathLike, data: bytes) -> int:
        if self._impl is None:
            from gpud.sim.kernel import Store

            self._impl = Store(self.host_dir)
        return self._impl(abs_path, data)

    def child_spec(self) -> tuple[str, str]:
        """How the sysfs writer process rebuilds this store (gpud.host.kernel.deadline_write)."""
        return "gpud.sim.kernel:Store", str(self.host_dir)


class _Modprobe:
    """`modprobe(name)` on the simulated host (loads the module, its driver claims devices)."""

    def __init__(self, host_dir: Path):
        self.host_dir = host_dir

    def __call__(self, name: str) -> None:
        from gpud.sim.kernel import modprobe

        modprobe(self.host_dir, name)


@dataclass(frozen=True)
class SimHost:
    host_dir: Path
    sys_root: Path
    proc_root: Path
    dev_root: Path
    uevent_socket: Path
    store: Callable[[str, bytes], int]
    modprobe: Callable[[str], None]


def host(host_dir: str | os.PathLike) -> SimHost:
    """The SimHost record of DIR without touching pynvml."""
    d = Path(host_dir).resolve()
    return SimHost(host_dir=d, sys_root=d / "sys", proc_root=d / "proc", dev_root=d / "dev",
                   uevent_socket=d / "run" / "uevent.sock", store=_Store(d), modprobe=_Modprobe(d))


def install(host_dir: str | os.PathLike, *, process: bool = False) -> SimHost:
    """Replace pynvml's C library with the fake one serving DIR; `uninstall()` restores it.
    `process`: the fake library runs in a child process (gpud.sim.nvml_process)."""
    import gpud.sim.nvml_lib as nvml_lib
    from gpud.sim.state import state_path

    h = host(host_dir)
    if not state_path(h.host_dir).is_file():
        raise FileNotFoundError(f"{h.host_dir}: not a simulated host (run `gpud-sim create {h.host_dir}`)")
    if process:
        from gpud.sim.nvml_process import RemoteNvmlLib

        nvml_lib.swap_in(RemoteNvmlLib(str(h.host_dir)))
    else:
        nvml_lib.install(str(h.host_dir))
    return h


def uninstall() -> None:
    import gpud.sim.nvml_lib as nvml_lib

    nvml_lib.uninstall()
