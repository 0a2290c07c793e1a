"""Who holds a GPU, a MIG device or a VFIO group open, read from a /proc root.

gpud never kills a holder: it waits for it or reports it. Holders are found the way `fuser` finds
them, by reading every <proc_root>/<pid>/fd/* link, because an unbind of a held nvidia GPU blocks
in the kernel instead of failing. Device paths are logical ("/dev/nvidia0") and mapped onto
`dev_root`, so the same code scans the simulator's DIR/proc against DIR/dev.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable

from gpud.host.readonly import refuse_if
from gpud.model import Holder

_MINOR = re.compile(r"^Device Minor:\s*(\d+)", re.M)
# nvidia-caps minor layout when /proc/driver/nvidia-caps/mig-minors is missing: 1 config, 2 monitor,
# then per GPU minor 15 GIs x (GI access + 8 CI access).
_CAPS_PER_GI, _GIS_PER_GPU = 9, 15


def process_name(proc_root: str, pid: int | str) -> str | None:
    """A process's name from <proc_root>/<pid>/comm; None when it is gone or unreadable."""
    try:
        with open(os.path.join(proc_root, str(pid), "comm"), "rb") as f:
            return f.read().decode("utf-8", "replace").rstrip("\n")
    except OSError:
        return None


class Procs:
    def __init__(self, proc_root: str = "/proc", dev_root: str = "/dev", *, read_only: bool = False,
                 store: Callable[[str, bytes], int] | None = None):
        self.proc_root = os.path.abspath(proc_root)
        self.dev_root = os.path.abspath(dev_root)
        self.read_only = read_only
        self._store = store  # the simulator's kernel store (it answers the unbindLock write)

    def real_path(self, device: str) -> str:
        """Logical /dev/... path -> path under dev_root."""
        if device == "/dev" or device.startswith("/dev/"):
            return self.dev_root + device[4:]
        return device

    def holders(self, device_paths: Iterable[str]) -> list[Holder]:
        """Processes with any of `device_paths` open, one Holder per (pid, device), sorted."""
        wanted: dict[str, str] = {}
        for dev in device_paths:
            real = self.real_path(dev)
            wanted[real] = dev
            wanted.setdefault(os.path.realpath(real), dev)
        if not wanted:
            return []
        out: set[Holder] = set()
        try:
            pids = [n for n in os.listdir(self.proc_root) if n.isdigit()]
        except FileNotFoundError:
            return []
        for pid in pids:
            fd_dir = os.path.join(self.proc_root, pid, "fd")
            try:
                fds = os.listdir(fd_dir)
            except OSError:  # vanished, or not ours to look at
                continue
            found = set()
            for fd in fds:
                try:
                    target = os.readlink(os.path.join(fd_dir, fd))
                except OSError:
                    continue
                held = wanted.get(target)
                if held is not None:
                    found.add(held)
            if found:
                comm = process_name(self.proc_root, pid)
                if comm is None:
                    continue
                out |= {Holder(pid=int(pid), name=comm, device=d) for d in found}
        return sorted(out)

    def running(self, names: Iterable[str]) -> list[Holder]:
        """Processes whose name is one of `names` (host services known to keep GPUs open, named
        when a reset is refused even if their descriptors are not readable to us)."""
        wanted = {n[:15] for n in names}  # comm is cut at 15 characters
        try:
            pids = sorted((n for n in os.listdir(self.proc_root) if n.isdigit()), key=int)
        except FileNotFoundError:
            return []
        out = []
        for pid in pids:
            comm = process_name(self.proc_root, pid)
            if comm is not None and comm in wanted:
                out.append(Holder(pid=int(pid), name=comm, device="/dev/nvidiactl"))
        return out

    def _gpu_file(self, bdf: str, name: str) -> str:
        return os.path.join(self.proc_root, "driver", "nvidia", "gpus", bdf, name)

    def nvidia_minor(self, bdf: str) -> int | None:
        """The /dev/nvidia<minor> of a GPU bound to nvidia (minors can change across rebinds)."""
        try:
            with open(self._gpu_file(bdf, "information"), encoding="utf-8", errors="replace") as f:
                m = _MINOR.search(f.read())
        except OSError:
            return None
        return int(m.group(1)) if m else None

    def mig_cap_minor(self, gpu_minor: int, gi: int, ci: int | None = None) -> int:
        """nvidia-caps minor of a GI (ci None) or CI access capability: /dev/nvidia-caps/nvidia-cap<N>."""
        key = f"gpu{gpu_minor}/gi{gi}/access" if ci is None else f"gpu{gpu_minor}/gi{gi}/ci{ci}/access"
        try:
            with open(os.path.join(self.proc_root, "driver", "nvidia-caps", "mig-minors"), encoding="utf-8") as f:
                for line in f:
                    name, _, minor = line.strip().rpartition(" ")
                    if name == key:
                        return int(minor)
        except (OSError, ValueError):
            pass
        base = 3 + gpu_minor * _CAPS_PER_GI * _GIS_PER_GPU + gi * _CAPS_PER_GI
        return base if ci is None else base + 1 + ci

    def take_unbind_lock(self, bdf: str) -> bool:
        """Ask the nvidia driver for the GPU's unbind lock: granted only when nothing uses it."""
        return self._unbind_lock(bdf, b"1")

    def release_unbind_lock(self, bdf: str) -> bool:
        return not self._unbind_lock(bdf, b"0")

    def _unbind_lock(self, bdf: str, value: bytes) -> bool:
        refuse_if(self.read_only, "unbindLock", bdf)
        path = self._gpu_file(bdf, "unbindLock")
        try:
            if self._store is not None:
                self._store(path, value)
            else:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.write(fd, value)
                finally:
                    os.close(fd)
            with open(path, "rb") as f:
                return f.read().strip() == b"1"
        except OSError:
            return False
