"""PCI functions and driver binding through sysfs (a real /sys, or the simulator's DIR/sys).

Reads are plain file reads, except `driver_override`: the kernel takes the device lock to show it,
and an unbind stuck in an nvidia driver holds that lock forever, so that one attribute is read on
a helper thread (one for all the functions of a host read), each read with a deadline; on timeout
the last value seen is reported and the address is listed in `Sysfs.stuck` (the read thread is left
behind, never piled up: the address is not read again until that read returns).
Writes are one `os.write` on an fd opened O_WRONLY (a buffered file object would report the
kernel's error only at close), or the simulator's `store(abs_path, bytes)`; errors come back as
SysfsError with the errno and what it means for that attribute (docs/hardware/driver-binding.md).
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections.abc import Callable

from gpud.host.kernel.module_alias import ModuleAliases
from gpud.host.readonly import refuse_if
from gpud.model import PciFunction
from gpud.pci import pci_sort_key

# (attribute file name or "*", errno) -> meaning
MEANINGS: dict[tuple[str, int], str] = {
    ("bind", errno.ENODEV): "no such device, or the driver does not match it (vfio-pci matches only through driver_override)",
    ("bind", errno.EBUSY): "device already bound, or another endpoint of its IOMMU group is in use",
    ("bind", errno.EPERM): "the driver's probe refused the device",
    ("bind", errno.EINVAL): "the driver refused the device (denylisted, or no IOMMU group for vfio-pci)",
    ("unbind", errno.ENODEV): "device is not bound to this driver",
    ("drivers_probe", errno.ENODEV): "no such PCI device",
    ("driver_override", errno.EINVAL): "override name too long",
    ("reset", errno.EINVAL): "reset accepts only \"1\"",
    ("reset", errno.ENOTTY): "no reset method works for this device",
    ("reset", errno.EBUSY): "device in use: the driver refuses to reset it while processes hold it",
    ("unbindLock", errno.ENOENT): "GPU not bound to nvidia",
    ("remove_id", errno.ENODEV): "no such dynamic id",
    ("*", errno.ENOENT): "no such attribute (device removed, or driver not loaded)",
    ("*", errno.EACCES): "attribute cannot be opened this way (read-only, or write-only)",
    ("*", errno.EPERM): "not permitted (needs root / CAP_SYS_ADMIN)",
    ("*", errno.EINVAL): "value rejected by the kernel",
    ("*", errno.EROFS): "sysfs mounted read-only (ProtectKernelTunables?)",
}


def meaning(path: str, code: int) -> str:
    name = os.path.basename(path)
    return MEANINGS.get((name, code)) or MEANINGS.get(("*", code)) or os.strerror(code)


def describe_error(e: OSError) -> str:
    """The errno's name and what it means for that attribute (one home for the wording)."""
    if isinstance(e, SysfsError):
        return e.meaning
    if e.errno is None:
        return str(e)
    return f"{errno.errorcode.get(e.errno, e.errno)}: {meaning(e.filename or '', e.errno)}"



class _LockedReads:
    """Reads that may wait on a device lock, done in turn by one daemon thread of their own; the
    caller waits until they are all done or one has run longer than its deadline."""

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self.items = items
        self.results: dict[str, str | None | OSError] = {}
        self._began = time.monotonic()  # when the read in progress began
        self._abandoned = False  # the caller gave up waiting: the reads after the current one are not made
        self._done = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="sysfs-read", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for key, path in self.items:
            with self._done:
                if self._abandoned:  # read on a new thread, or not wanted: another device lock not taken
                    return
            try:
                value: str | None | OSError = _read(path)
            except OSError as e:
                value = e
            with self._done:  # the next read begins now: its deadline counts from here
                self.results[key] = value
                self._began = time.monotonic()
                self._done.notify_all()

    def returned(self, key: str) -> bool:
        with self._done:
            return key in self.results

    def wait(self, limit: float) -> int:
        """How many of the items were read, in order, before one took longer than `limit` seconds
        (all of them: none did). Those after it are then left unread by this thread."""
        with self._done:
            while True:
                n = len(self.results)
                if n == len(self.items):
                    return n
                left = self._began + limit - time.monotonic()
                if left <= 0:
                    self._abandoned = True
                    return n
                self._done.wait(left)

class SysfsError(OSError):
    """A sysfs write the kernel refused: `errno`, `path`, and `meaning` for a human."""

    def __init__(self, code: int, meaning: str, path: str):
        super().__init__(code, meaning, path)
        self.path = path
        self.meaning = meaning

    def __str__(self) -> str:
        name = errno.errorcode.get(self.errno or 0, str(self.errno))
        return f"{name}: {self.meaning} ({self.path})"


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _link_name(path: str) -> str | None:
    try:
        return os.path.basename(os.readlink(path))
    except (FileNotFoundError, NotADirectoryError, OSError):
        return None


_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]")


def pcie_root(address: str, sys_root: str = "/sys") -> str:
    """The PCIe root complex a function hangs under ("pci0000:15"), as Kubernetes' standard
    attribute `resource.kubernetes.io/pcieRoot` defines it (k8s.io/dynamic-resource-allocation
    deviceattribute, GetPCIeRootAttributeByPCIBusID, v0.36.3): the link bus/pci/devices/<address>
    resolves, relative to its own directory, to devices/pci<domain>:<bus>/.../<address>, and the
    root is its first component under devices/. Raises ValueError saying which rule failed."""
    if not _BDF.fullmatch(address):
        raise ValueError(f"PCI address {address!r}: not in domain:bus:device.function form (0000:3b:00.0)")
    link = os.path.join("bus", "pci", "devices", address)
    try:
        target = os.readlink(os.path.join(sys_root, link))
    except OSError as e:
        raise ValueError(f"{os.path.join(sys_root, link)}: {e.strerror or e}") from None
    if not os.path.isabs(target):
        target = os.path.normpath(os.path.join(os.path.dirname(link), target))
    parts = target.split(os.sep)
    if len(parts) < 3 or parts[0] != "devices" or not parts[1].startswith("pci"):
        raise ValueError(f"{os.path.join(sys_root, link)} -> {target}: not under devices/pci<domain>:<bus>")
    if parts[-1] != address:
        raise ValueError(f"{os.path.join(sys_root, link)} -> {target}: does not end in {address}")
    return parts[1]


class Sysfs:
    def __init__(self, root: str = "/sys", *, read_only: bool = False,
                 store: Callable[[str, bytes], int] | None = None,
                 modprobe: Callable[[str], None] | None = None,
                 dev_root: str | None = None, lock_timeout: float = 2.0,
                 aliases: ModuleAliases | None = None):
        self.root = os.path.abspath(root)
        self.aliases = aliases  # modules.alias: which VFIO driver takes a device (None: vfio-pci)
        self.read_only = read_only
        self.dev_root = dev_root or os.path.join(os.path.dirname(self.root), "dev")
        self.lock_timeout = lock_timeout
        self._store = store
        self._modprobe = modprobe
        self._override_seen: dict[str, str | None] = {}
        self._stuck_reads: dict[str, _LockedReads] = {}
        self.stuck: set[str] = set()  # addresses whose device lock did not answer (unbind in progress?)

    def _p(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def store(self) -> Callable[[str, bytes], int] | None:
        """The replacement for os.write (the simulator's kernel), or None on a real host."""
        return self._store

    # ---- reading
    def functions(self) -> list[PciFunction]:
        """All physical PCI functions, in PCI-address order. SR-IOV virtual functions (a `physfn`
        link) are left out: a vGPU GPU's VFs share its vendor and class but are not GPUs to manage."""
        try:
            names = [n for n in os.listdir(self._p("bus/pci/devices"))
                     if not n.startswith(".") and not os.path.islink(self._p("bus/pci/devices", n, "physfn"))]
        except FileNotFoundError:
            return []
        ordered = sorted(names, key=pci_sort_key)
        overrides = self.driver_overrides(ordered)  # one helper thread for them all
        return [f for f in (self._function(n, overrides[n]) for n in ordered) if f is not None]

    def function(self, address: str) -> PciFunction | None:
        return self._function(address, self.driver_override(address))

    def _function(self, address: str, driver_override: str | None) -> PciFunction | None:
        base = self._p("bus/pci/devices", address)
        vals = {k: _read(os.path.join(base, k))
                for k in ("vendor", "device", "subsystem_vendor", "subsystem_device", "class", "numa_node")}
        vendor, device, class_code = vals["vendor"], vals["device"], vals["class"]
        if vendor is None or device is None or class_code is None:
            return None  # vanished (removed) or not a PCI device
        group = _link_name(os.path.join(base, "iommu_group"))
        try:
            return PciFunction(
                address=address,
                vendor=int(vendor, 16),
                device=int(device, 16),
                subsystem_vendor=int(vals["subsystem_vendor"] or "0", 16),
                subsystem_device=int(vals["subsystem_device"] or "0", 16),
                class_code=int(class_code, 16),
                driver=_link_name(os.path.join(base, "driver")),
                driver_override=driver_override,
                iommu_group=int(group) if group is not None and group.isdigit() else None,
                numa_node=int(vals["numa_node"]) if vals["numa_node"] not in (None, "") else -1,
                vfio_variant=(self.aliases.vfio_variant(_read(os.path.join(base, "modalias")))
                              if self.aliases is not None else None),
            )
        except ValueError:
            return None

    def driver_override(self, address: str) -> str | None:
        """driver_override, or the last value seen when the device lock does not answer in time."""
        return self.driver_overrides([address])[address]

    def driver_overrides(self, addresses: list[str]) -> dict[str, str | None]:
        """driver_override of each address, read in turn on one helper thread, each read with its
        own deadline (`lock_timeout`). A read that misses it leaves its address `stuck`, reported
        with the value last seen, and the addresses after it are read on a new thread; while that
        read has not returned, the address is not read again. One thread per call, not per
        address: at 64 GPUs a thread started for each read was a quarter of a host read's Python
        work, and each start hands the interpreter's lock back and forth with the event loop."""
        out: dict[str, str | None] = {}
        todo = []
        for address in addresses:
            pending = self._stuck_reads.get(address)
            if pending is not None and not pending.returned(address):
                self.stuck.add(address)
                out[address] = self._override_seen.get(address)
            else:
                todo.append(address)
        while todo:
            reads = _LockedReads([(a, self._p("bus/pci/devices", a, "driver_override")) for a in todo])
            missed = reads.wait(self.lock_timeout)
            for address in todo[:missed]:
                self._stuck_reads.pop(address, None)
                self.stuck.discard(address)
                v = reads.results[address]
                value = None if v in (None, "", "(null)") or isinstance(v, OSError) else str(v)
                self._override_seen[address] = out[address] = value
            if missed == len(todo):
                break
            address = todo[missed]
            self._stuck_reads[address] = reads
            self.stuck.add(address)
            out[address] = self._override_seen.get(address)
            todo = todo[missed + 1:]
        return out

    def group_members(self, group: int) -> list[str]:
        try:
            names = os.listdir(self._p("kernel/iommu_groups", str(group), "devices"))
        except FileNotFoundError:
            return []
        return sorted((n for n in names if not n.startswith(".")), key=pci_sort_key)

    def drivers(self) -> list[str]:
        """Names of the PCI drivers loaded now."""
        try:
            return sorted(n for n in os.listdir(self._p("bus/pci/drivers")) if not n.startswith("."))
        except FileNotFoundError:
            return []

    def vfio_device_path(self, group: int) -> str | None:
        """/dev/vfio/<group> when it exists (the group is usable), else None."""
        path = os.path.join(self.dev_root, "vfio", str(group))
        return path if os.path.exists(path) else None

    # ---- writing
    def write(self, relpath: str, value: str) -> None:
        """Write `value` to root/relpath with exactly one write(2); SysfsError on refusal."""
        refuse_if(self.read_only, "sysfs write", relpath)
        if os.path.isabs(relpath) or ".." in relpath.split("/"):
            raise ValueError(f"sysfs path must be relative to {self.root}: {relpath!r}")
        path = self._p(relpath)
        data = value.encode()
        try:
            if self._store is not None:
                self._store(path, data)
                return
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as e:
            if isinstance(e, SysfsError) or e.errno is None:
                raise
            raise SysfsError(e.errno, meaning(path, e.errno), path) from e

    def reset(self, address: str) -> None:
        refuse_if(self.read_only, "reset", address)
        self.write(f"bus/pci/devices/{address}/reset", "1")

    def load_module(self, name: str) -> None:
        """Load module `name` (vfio-pci) where it is not loaded: on a real host through systemd's
        modprobe@ unit (gpud.host.systemd.modules: the service's sandbox loads no modules itself);
        SysfsError(EIO) saying what was tried when it is still not loaded."""
        refuse_if(self.read_only, "modprobe", name)
        if os.path.isdir(self._p("module", name.replace("-", "_"))):
            return
        try:
            if self._modprobe is not None:
                self._modprobe(name)
                return
            from gpud.host.systemd.modules import load_module

            load_module(name, sys_root=self.root)
        except SysfsError:
            raise
        except (OSError, RuntimeError) as e:
            raise SysfsError(errno.EIO, str(e), name) from e
