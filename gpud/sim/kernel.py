"""The simulated kernel: write semantics of DIR/sys attributes, and hardware events.

`Store(host_dir)` is the `store(abs_path, data)` callable the sysfs adapter writes through on the
simulator. It reproduces what drivers/base/{bus,dd}.c and drivers/pci/pci-{driver,sysfs}.c do for
each attribute, with the same errno values (docs/hardware/driver-binding.md), including the part
that makes driver rebinding dangerous: an `unbind` of a busy nvidia GPU (or of a vfio-pci device a
VM holds) does not fail, it *blocks* until the holders are gone. Every state change happens under
the host lock, re-renders the tree, and emits the uevents the kernel would, after the state is
saved (a listener that re-reads on the event then sees the new state).

Choices where the kernel depends on the driver:
- `<dev>/reset` on an nvidia-bound GPU with holders fails with EBUSY (the driver refuses to reset a
  GPU with clients, as `nvidia-smi --gpu-reset` does); otherwise it applies a pending MIG mode
  through `gpud.sim.gpu_rules.reset_gpu`.
- vfio-pci probe of a device without an IOMMU group fails with EINVAL (no noiommu mode); of a PF
  with SR-IOV VFs enabled, EBUSY ("Cannot bind to PF with SR-IOV enabled", vfio_pci_probe).
- nvidia probe of an NVIDIA function the simulator has no GPU record for fails with EPERM.
- `new_id` grabs every unbound matching device at once (the trap it is), but the id is not
  remembered, so `remove_id` always answers ENODEV.
- A `hang` persists until `unhang` (a wedged device stays wedged): every unbind of it blocks; a
  blocked writer resumes when the mark is cleared.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable

import gpud.sim.uevents as uevents
import gpud.sim.vgpu as vgpu
from gpud.sim.gpu_rules import reset_gpu
from gpud.sim.kstrto import kstrtou, sysfs_error
from gpud.sim.state import SimFunction, SimState, count_reset, locked
from gpud.sim.sysfs_tree import (
    NVIDIA,
    PCI_ROOT,
    VFIO_DRIVERS,
    driver_of_module,
    gpu_holders,
    loaded_drivers,
    module_name,
    render,
    session_holders,
    vfio_groups,
    vfio_holders,
)
from gpud.sim.uevents import UEVENT_ACTIONS, Uevent

PAGE_SIZE = 4096
def _name(data: bytes) -> str:
    """A device name as bus_find_device_by_name compares it (sysfs_streq: one trailing \\n ignored)."""
    s = data.decode("utf-8", "surrogateescape")
    return s[:-1] if s.endswith("\n") else s


def matches(f: SimFunction, drv: str) -> bool:
    """driver_match_device for PCI: driver_override decides alone when set; vfio-pci has no ids."""
    if f.driver_override:
        return f.driver_override == drv
    return drv not in VFIO_DRIVERS and f.native_driver == drv


def _attach(st: SimState, f: SimFunction, drv: str, path: str, events: list[Uevent]) -> None:
    """really_probe: bind `f` (known unbound and matching) to `drv`, or raise the probe's errno."""
    if f.driver is not None:
        raise sysfs_error(errno.EBUSY, path)
    if drv not in VFIO_DRIVERS and f.iommu_group is not None and f.iommu_group in vfio_groups(st) \
            and vfio_holders(st, f.iommu_group):
        raise sysfs_error(errno.EBUSY, path)  # DMA ownership: the group is owned by a user (VM)
    if drv in VFIO_DRIVERS and f.iommu_group is None:
        raise sysfs_error(errno.EINVAL, path)
    if drv in VFIO_DRIVERS and any(v.physfn == f.address for v in st.functions.values()):
        # vfio_pci_probe: "Cannot bind to PF with SR-IOV enabled" (drivers/vfio/pci/vfio_pci.c)
        raise sysfs_error(errno.EBUSY, path)
    if drv == NVIDIA:
        gpu = st.gpus.get(f.address)
        if gpu is None:
            raise sysfs_error(errno.EPERM, path)
        taken = {g.minor for a, g in st.gpus.items()
                 if a != f.address and st.functions.get(a) is not None
                 and st.functions[a].driver == NVIDIA and st.functions[a].present}
        if gpu.minor in taken:  # minors can change across a rebind
            gpu.minor = min(set(range(len(st.gpus) + 1)) - taken)
        f.nvidia_probes += 1
        gpu.gis.clear()  # a new probe starts without GPU instances; MIG mode is the GPU's and stays
    f.driver = drv
    f.binds += 1
    events.append(Uevent("bind", "pci", f.address, drv))


def _probe(st: SimState, f: SimFunction, events: list[Uevent]) -> None:
    """device_attach: bind override (or native driver) if loaded; failures just leave it unbound."""
    if f.driver is not None:
        return
    drv = f.driver_override or f.native_driver
    if drv and drv in loaded_drivers(st) and matches(f, drv):
        try:
            _attach(st, f, drv, "", events)
        except OSError:
            pass


def _find(st: SimState, name: str) -> SimFunction | None:
    f = st.functions.get(name)
    return f if f is not None and f.present else None


def _blocked(st: SimState, f: SimFunction, drv: str) -> bool:
    """Would the driver's remove() wait right now?"""
    if f.address in st.hangs:
        return True
    if drv == NVIDIA:
        return bool(gpu_holders(st, f.address) or session_holders(st, f.address))
    if drv in VFIO_DRIVERS:
        return f.iommu_group in vfio_groups(st) and bool(vfio_holders(st, f.iommu_group))
    return False


def _detach(st: SimState, f: SimFunction, events: list[Uevent]) -> None:
    f.driver = None
    events.append(Uevent("unbind", "pci", f.address))


class Store:
    """store(abs_path, data) -> len(data), with the kernel's semantics for DIR/sys (and the nvidia
    driver's /proc unbindLock). Raises OSError(errno, strerror, path) as the write(2) would."""

    def __init__(self, host_dir: str | os.PathLike, *, poll_interval: float = 0.02,
                 on_block: Callable[[str], None] | None = None):
        self.dir = os.path.abspath(host_dir)
        self.poll_interval = poll_interval
        self.on_block = on_block  # called with the address each time an unbind finds itself waiting

    # ---- plumbing
    def _change(self, fn: Callable[[SimState, list[Uevent]], object]) -> object:
        """Run `fn` on the locked state; re-render; emit its events once the state is saved."""
        events: list[Uevent] = []
        with locked(self.dir) as st:
            groups = vfio_groups(st)
            result = fn(st, events)
            after = vfio_groups(st)
            vfio = [Uevent("remove", "vfio", str(g)) for g in sorted(groups - after)]
            vfio += [Uevent("add", "vfio", str(g)) for g in sorted(after - groups)]
            events[:0] = vfio
            render(self.dir, st)
        for e in events:
            uevents.emit(self.dir, e.action, e.subsystem, e.address, e.driver)
        return result

    def _route(self, abs_path: str) -> tuple[str, list[str], str]:
        real = os.path.realpath(abs_path)
        rel = os.path.relpath(real, os.path.realpath(self.dir))
        parts = rel.split(os.sep)
        if not os.path.lexists(real):
            raise sysfs_error(errno.ENOENT, abs_path)
        if os.path.isdir(real):
            raise sysfs_error(errno.EISDIR, abs_path)
        return parts[0], parts[1:], real

    def __call__(self, abs_path: str | os.PathLike, data: bytes) -> int:
        abs_path = os.fspath(abs_path)
        if isinstance(data, str):
            data = data.encode()
        top, p, _ = self._route(abs_path)
        if top == "sys":
            if p == ["bus", "pci", "drivers_probe"]:
                self._drivers_probe(_name(data), abs_path)
            elif p == ["bus", "pci", "rescan"]:
                if kstrtou(data, abs_path):
                    self.rescan()
            elif len(p) == 5 and p[:3] == ["bus", "pci", "drivers"]:
                drv, attr = p[3], p[4]
                if attr == "bind":
                    self._bind(drv, _name(data), abs_path)
                elif attr == "unbind":
                    self._unbind(drv, _name(data), abs_path)
                elif attr == "new_id":
                    self._new_id(drv, data, abs_path)
                elif attr == "remove_id":
                    _ids(data, abs_path)
                    raise sysfs_error(errno.ENODEV, abs_path)
                else:
                    raise sysfs_error(errno.EACCES, abs_path)
            elif len(p) == 4 and p[:2] == PCI_ROOT.split("/") and p[3] == "sriov_numvfs":
                self._change(lambda st, events: vgpu.sriov_numvfs(st, p[2], data, abs_path, events))
            elif len(p) == 4 and p[:2] == PCI_ROOT.split("/"):
                self._device_attr(p[2], p[3], data, abs_path)
            elif p[:2] == PCI_ROOT.split("/") and p[3:] == ["nvidia", "current_vgpu_type"]:
                self._change(lambda st, events: vgpu.current_vgpu_type(st, p[2], data, abs_path, events))
            elif p[:2] == PCI_ROOT.split("/") and len(p) == 6 and p[3] == "mdev_supported_types" and p[5] == "create":
                self._change(lambda st, events: vgpu.mdev_create(st, p[2], p[4], data, abs_path, events))
            elif p[:2] == PCI_ROOT.split("/") and len(p) == 5 and p[4] == "remove":
                vgpu.mdev_remove(self, p[3], data, abs_path)
            else:
                raise sysfs_error(errno.EACCES, abs_path)
        elif top == "proc" and len(p) == 5 and p[:3] == ["driver", "nvidia", "gpus"] and p[4] == "unbindLock":
            self._unbind_lock(p[3], data, abs_path)
        else:
            raise sysfs_error(errno.EACCES, abs_path)
        return len(data)

    # ---- per-device attributes
    def _device_attr(self, addr: str, attr: str, data: bytes, path: str) -> None:
        if attr == "driver_override":
            if len(data) >= PAGE_SIZE:
                raise sysfs_error(errno.EINVAL, path)
            value = _name(data) or None

            def set_override(st: SimState, events: list[Uevent]) -> None:
                f = _find(st, addr)
                if f is None:
                    raise sysfs_error(errno.ENOENT, path)
                f.driver_override = value  # no event, no rebind

            self._change(set_override)
        elif attr == "remove":
            if kstrtou(data, path):
                self.remove(addr, path)
        elif attr == "rescan":
            if kstrtou(data, path):
                self.rescan()
        elif attr == "reset":
            if kstrtou(data, path) != 1:
                raise sysfs_error(errno.EINVAL, path)
            self._reset(addr, path)
        elif attr in ("enable", "d3cold_allowed"):
            kstrtou(data, path)  # accepted, not modelled
        elif attr == "uevent":
            action = _name(data).split(" ")[0]
            if action not in UEVENT_ACTIONS:
                raise sysfs_error(errno.EINVAL, path)
            with locked(self.dir, write=False) as st:
                f = _find(st, addr)
                drv = f.driver if f else None
            uevents.emit(self.dir, action, "pci", addr, drv, synthetic=True)
        else:
            raise sysfs_error(errno.EACCES, path)

    def _reset(self, addr: str, path: str) -> None:
        def reset(st: SimState, events: list[Uevent]) -> None:
            f = _find(st, addr)
            if f is None:
                raise sysfs_error(errno.ENOENT, path)
            if f.driver == NVIDIA and gpu_holders(st, addr):
                raise sysfs_error(errno.EBUSY, path)
            if addr in st.gpus:
                reset_gpu(st, addr)
            count_reset(st, addr, "sysfs")

        self._change(reset)

    # ---- driver attributes
    def _bind(self, drv: str, name: str, path: str) -> None:
        def bind(st: SimState, events: list[Uevent]) -> None:
            if drv not in loaded_drivers(st):
                raise sysfs_error(errno.ENOENT, path)
            f = _find(st, name)
            if f is None or not matches(f, drv):
                raise sysfs_error(errno.ENODEV, path)
            _attach(st, f, drv, path, events)

        self._change(bind)

    def _unbind(self, drv: str, name: str, path: str) -> None:
        """unbind_store: ENODEV unless bound to `drv`; then wait as long as the driver's remove()
        would (holders, hang), re-reading the state under the lock between checks."""
        first = True
        while True:
            with locked(self.dir, write=False) as st:
                f = _find(st, name)
                bound = f is not None and f.driver == drv
                if not bound:
                    if first:
                        raise sysfs_error(errno.ENODEV, path)
                    return  # someone else unbound it meanwhile: the kernel's detach is a no-op
                assert f is not None
                blocked = _blocked(st, f, drv)
            if not blocked:
                def unbind(st: SimState, events: list[Uevent]) -> bool:
                    f = _find(st, name)
                    if f is None or f.driver != drv:
                        return True
                    if _blocked(st, f, drv):
                        return False
                    _detach(st, f, events)
                    return True

                if self._change(unbind):
                    return
            first = False
            if self.on_block is not None:
                self.on_block(name)
            time.sleep(self.poll_interval)

    def _new_id(self, drv: str, data: bytes, path: str) -> None:
        vendor, device = _ids(data, path)

        def new_id(st: SimState, events: list[Uevent]) -> None:
            for a in sorted(st.functions):
                f = st.functions[a]
                if f.present and f.driver is None and f.vendor == vendor and f.device == device \
                        and f.driver_override in (None, drv):
                    try:
                        _attach(st, f, drv, path, events)
                    except OSError:
                        pass

        self._change(new_id)

    def _drivers_probe(self, name: str, path: str) -> None:
        def probe(st: SimState, events: list[Uevent]) -> None:
            f = _find(st, name)
            if f is None:
                raise sysfs_error(errno.ENODEV, path)
            _probe(st, f, events)

        self._change(probe)

    def _unbind_lock(self, addr: str, data: bytes, path: str) -> None:
        want = kstrtou(data, path)

        def take(st: SimState, events: list[Uevent]) -> None:
            f = _find(st, addr)
            if f is None or f.driver != NVIDIA:
                raise sysfs_error(errno.ENOENT, path)
            granted = want == 1 and not gpu_holders(st, addr) and not session_holders(st, addr)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as fh:
                fh.write(b"1\n" if granted else b"0\n")
            os.replace(tmp, path)

        self._change(take)

    # ---- bus-wide operations (also used by plug/unplug)
    def rescan(self) -> None:
        """Re-add removed functions (driver_override forgotten) and probe them."""
        def rescan(st: SimState, events: list[Uevent]) -> None:
            for a in sorted(st.functions):
                f = st.functions[a]
                if not f.present:
                    f.present, f.driver, f.driver_override = True, None, None
                    events.append(Uevent("add", "pci", a))
                    _probe(st, f, events)

        self._change(rescan)

    def remove(self, addr: str, path: str = "") -> None:
        """<dev>/remove: the driver is unbound first (which may block), then the device is gone."""
        with locked(self.dir, write=False) as st:
            f = _find(st, addr)
            drv = f.driver if f else None
        if drv:
            self._unbind(drv, addr, path)

        def remove(st: SimState, events: list[Uevent]) -> None:
            f = _find(st, addr)
            if f is None:
                return
            if f.driver:
                _detach(st, f, events)
            f.present, f.driver_override = False, None
            events.append(Uevent("remove", "pci", addr))

        self._change(remove)


def _ids(data: bytes, path: str) -> tuple[int, int]:
    parts = _name(data).split()
    try:
        if len(parts) < 2:
            raise ValueError
        return int(parts[0], 16), int(parts[1], 16)
    except ValueError:
        raise sysfs_error(errno.EINVAL, path) from None


# ---- hardware-side actions (gpud-sim)
def modprobe(host_dir: str | os.PathLike, name: str) -> None:
    """Load a module: its driver directory appears and it claims unbound devices that match."""
    mod = module_name(name)
    drv = driver_of_module(mod)

    def load(st: SimState, events: list[Uevent]) -> None:
        if mod in {module_name(m) for m in st.loaded_modules}:
            return
        st.loaded_modules.append(mod)
        events.append(Uevent("add", "module", mod))
        events.append(Uevent("add", "drivers", drv))
        for a in sorted(st.functions):
            f = st.functions[a]
            if f.present and f.driver is None and matches(f, drv):
                try:
                    _attach(st, f, drv, "", events)
                except OSError:
                    pass

    Store(host_dir)._change(load)


def _slot(st: SimState, pci: str) -> list[SimFunction]:
    if pci not in st.functions:
        raise LookupError(f"no PCI function {pci} on the simulated host")
    slot = pci.rsplit(".", 1)[0]
    return [st.functions[a] for a in sorted(st.functions) if a.rsplit(".", 1)[0] == slot]


def unplug(host_dir: str | os.PathLike, pci: str) -> None:
    """Surprise hot removal of the card holding `pci`: drivers detached without waiting."""
    def out(st: SimState, events: list[Uevent]) -> None:
        slot = _slot(st, pci)
        pfs = {f.address for f in slot}
        # the VFs go with their PF wherever their slot (pci_stop_and_remove_bus_device removes a
        # PF's VFs first: drivers/pci/remove.c, drivers/pci/iov.c)
        vfs = [f for a, f in sorted(st.functions.items()) if f.physfn in pfs and a not in pfs]
        for f in [*vfs, *slot]:
            if f.present:
                if f.driver:
                    _detach(st, f, events)
                f.present, f.driver_override = False, None
                events.append(Uevent("remove", "pci", f.address))

    Store(host_dir)._change(out)


KMSG_RING = 1000  # records kept; the real ring is bounded by bytes (CONFIG_LOG_BUF_SHIFT)


def xid(host_dir: str | os.PathLike, pci: str, code: int, text: str = "") -> str:
    """The nvidia driver reporting an Xid for the GPU at `pci`: one kernel log record in NVRM's
    form, `NVRM: Xid (PCI:0000:18:00): 79, pid=..., name=..., <text>` (the PCI function left out,
    as the driver prints it; NVIDIA's Xid documentation and dmesg captures in the wild). Only
    the log: what the error does to the GPU is for other commands (`unplug` for a GPU that fell
    off the bus). Returns the record."""
    def log(st: SimState, events: list[Uevent]) -> str:
        f = st.functions.get(pci)
        if f is None or not f.present or f.driver != "nvidia" or pci not in st.gpus:
            raise LookupError(f"{pci}: no GPU on the nvidia driver there; the driver logs Xids only for its GPUs")
        seq = int(st.kmsg[-1].split(",", 2)[1]) + 1 if st.kmsg else 0
        usec = int(time.monotonic() * 1_000_000)
        record = (f"3,{seq},{usec},-;NVRM: Xid (PCI:{pci.rsplit('.', 1)[0]}): {code}, pid='<unknown>', "
                  f"name=<unknown>, {text or 'simulated'}")
        st.kmsg = [*st.kmsg, record][-KMSG_RING:]
        return record

    return str(Store(host_dir)._change(log))


def plug(host_dir: str | os.PathLike, pci: str) -> None:
    """Hot add of the card holding `pci`: add events, then native drivers probe."""
    def add(st: SimState, events: list[Uevent]) -> None:
        for f in _slot(st, pci):
            if not f.present:
                f.present, f.driver, f.driver_override = True, None, None
                events.append(Uevent("add", "pci", f.address))
                _probe(st, f, events)

    Store(host_dir)._change(add)


def hang(host_dir: str | os.PathLike, pci: str) -> None:
    """Wedge the device: every unbind of it blocks until `unhang`."""
    def mark(st: SimState, events: list[Uevent]) -> None:
        if pci not in st.functions:
            raise LookupError(f"no PCI function {pci} on the simulated host")
        if pci not in st.hangs:
            st.hangs.append(pci)

    Store(host_dir)._change(mark)


def unhang(host_dir: str | os.PathLike, pci: str) -> None:
    def clear(st: SimState, events: list[Uevent]) -> None:
        if pci in st.hangs:
            st.hangs.remove(pci)

    Store(host_dir)._change(clear)

