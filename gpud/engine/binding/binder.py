"""Runs a BindingPlan through the sysfs adapter without ever letting the kernel hang gpud.

Writing `unbind` for a busy nvidia GPU blocks uninterruptibly (NVRM "non-zero usage count"), a
vfio-pci unbind waits while a VM holds the device, and the blocked write holds the device lock, so
even a driver_override write or read of that device can then block. Hence:

- holders of /dev/nvidia<minor>, its MIG caps and /dev/vfio/<group> are looked up first; any ->
  "waiting" with the holders named (gpud never kills; the caller decides to wait or fail), and
  nothing has been written yet;
- the caller's own NVML handle is closed through `before_unbind`, then nvidia's unbindLock is
  asked for (refused -> "waiting": a user /proc cannot show, e.g. nvidia-persistenced or DRM);
- every write runs in a helper process with a deadline (gpud.host.kernel.deadline_write); on expiry the
  outcome is "stuck" with what the kernel says (/proc/<helper>/wchan, stack, state, the last
  matching /dev/kmsg line) and the helper is abandoned to a reaper thread: the caller's thread
  returns, the event loop keeps serving, and later plans touching that device answer "stuck"
  without touching it until the write ends;
- every rebind is verified (drivers_probe succeeds even when nothing binds), and /dev/vfio/<group>
  is awaited with bounded backoff because udev creates and removes it asynchronously.
"""

from __future__ import annotations

import collections
import errno as errno_mod
import glob
import os
import re
import time
from collections.abc import Callable, Iterable
from typing import Final, Literal, TypeVar

from msgspec import Struct

from gpud.engine.ports import Clock, SystemClock
from gpud.host.kernel.deadline_write import WriteFailed, WriteStuck, stuck_writes, write_with_deadline
from gpud.host.kernel.kmsg import read_text
from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs, describe_error
from gpud.host.readonly import ReadOnlyError, refuse_if
from gpud.model import Holder
from gpud.plan import binding

BindState = Literal["converged", "waiting", "failed", "stuck"]
CONVERGED: Final = "converged"
WAITING: Final = "waiting"
FAILED: Final = "failed"
STUCK: Final = "stuck"


class BindOutcome(Struct, frozen=True):
    pci: str
    state: BindState
    message: str
    holders: tuple[Holder, ...] = ()
    done: tuple[str, ...] = ()  # the steps carried out, in order
    step: str | None = None  # the step that failed, waited or got stuck
    errno: int | None = None
    stuck_pid: int | None = None



T = TypeVar("T")


def _needs(step: binding.BindStep, value: T | None, name: str) -> T:
    """The field a step of this action must carry; a step without it is refused before any write."""
    if value is None:
        raise WriteFailed("", None, f"step {step} has no {name}")
    return value


class _BindingRun:
    """One execution of one binding plan: its steps done so far and the unbindLocks it holds."""

    def __init__(self, sysfs: Sysfs, procs: Procs, plan: binding.BindingPlan, *,
                 before_unbind: Callable[[], None] | None, timeout: float, verify_timeout: float,
                 dev_root: str, check_holders: bool, kmsg: str, clock: Clock,
                 on_step: Callable[[binding.BindStep, str], None] | None) -> None:
        self.sysfs, self.procs, self.plan = sysfs, procs, plan
        self.before_unbind = before_unbind
        self.timeout, self.verify_timeout = timeout, verify_timeout
        self.dev_root = dev_root
        self.check_holders = check_holders
        self.kmsg = kmsg
        self.clock = clock
        self.on_step = on_step
        self.done: list[str] = []
        self.nvml_closed = False
        self.locked: set[str] = set()  # GPUs whose unbindLock we hold

    # ---- reading the live state (never through attributes that take the device lock) ---------
    def dev(self, pci: str, *rest: str) -> str:
        return os.path.join(self.sysfs.root, "bus", "pci", "devices", pci, *rest)

    def driver(self, pci: str) -> str | None:
        try:
            return os.path.basename(os.readlink(self.dev(pci, "driver")))
        except FileNotFoundError:
            if not os.path.exists(self.dev(pci)):
                raise WriteFailed(self.dev(pci), errno_mod.ENODEV, f"{pci} is gone from the bus") from None
            return None

    def vfio_node(self, group: int) -> str:
        """Real path of /dev/vfio/<group> under dev_root (it may not exist yet)."""
        return os.path.join(self.dev_root, "vfio", str(group))

    def holder_paths(self) -> list[str]:
        """Logical /dev paths whose holders keep an endpoint's driver from letting go."""
        paths: list[str] = []
        for pci in self.plan.endpoints:
            try:
                drv = self.driver(pci)
            except WriteFailed:
                continue
            if drv == "nvidia":
                minor = self.procs.nvidia_minor(pci)
                if minor is not None:
                    paths.append(f"/dev/nvidia{minor}")
                    paths += self.mig_cap_paths(minor)
            for cdev in glob.glob(self.dev(pci, "vfio-dev", "vfio*")):  # iommufd device cdev
                paths.append(f"/dev/vfio/devices/{os.path.basename(cdev)}")
        if self.plan.group is not None:
            paths.append(f"/dev/vfio/{self.plan.group}")
        return paths

    def mig_cap_paths(self, minor: int) -> list[str]:
        """/dev/nvidia-caps/nvidia-cap<N> of every GI/CI capability of GPU `minor`, from the
        driver's /proc/driver/nvidia-caps/mig-minors ("gpu0/gi1/access 12"), else from its
        capabilities tree ("DeviceFileMinor: N")."""
        proc_root = getattr(self.procs, "proc_root", "/proc")
        prefix = f"gpu{minor}/"
        minors: list[str] = []
        text = read_text(os.path.join(proc_root, "driver", "nvidia-caps", "mig-minors"), limit=1 << 20)
        if text:
            for line in text.splitlines():
                name, _, n = line.strip().rpartition(" ")
                if name.startswith(prefix) and n.isdigit():
                    minors.append(n)
        else:
            base = os.path.join(proc_root, "driver", "nvidia", "capabilities", f"gpu{minor}", "mig")
            for access in sorted(glob.glob(os.path.join(base, "gi*", "access"))
                                 + glob.glob(os.path.join(base, "gi*", "ci*", "access"))):
                m = re.search(r"DeviceFileMinor:\s*(\d+)", read_text(access) or "")
                if m:
                    minors.append(m.group(1))
        return [f"/dev/nvidia-caps/nvidia-cap{n}" for n in minors]

    def holders(self, *, include_self: bool) -> tuple[Holder, ...]:
        found = self.procs.holders(self.holder_paths())
        me = os.getpid()
        return tuple(sorted({h for h in found if include_self or h.pid != me}))

    # ---- steps -------------------------------------------------------------------------------
    def write(self, relpath: str, value: str, pci: str) -> None:
        refuse_if(getattr(self.sysfs, "read_only", False), f"sysfs write {value.strip()!r}", relpath)
        write_with_deadline(self.sysfs, relpath, value, pci, self.timeout, self.kmsg)

    def wait_until(self, cond: Callable[[], bool]) -> bool:
        """Bounded re-check with exponential backoff: probes and udev may finish asynchronously."""
        deadline = self.clock.monotonic() + self.verify_timeout
        delay = 0.005
        while True:
            if cond():
                return True
            if self.clock.monotonic() >= deadline:
                return cond()
            self.clock.sleep(min(delay, max(0.0, deadline - self.clock.monotonic())))
            delay = min(delay * 2, 0.25)

    def step(self, s: binding.BindStep) -> None:
        a = s.action
        if a == binding.LOAD_MODULE:
            module = _needs(s, s.module, "module")
            driver = s.driver or module
            if not os.path.isdir(os.path.join(self.sysfs.root, "bus", "pci", "drivers", driver)):
                self.sysfs.load_module(module)
                if not self.wait_until(lambda: os.path.isdir(os.path.join(self.sysfs.root, "bus", "pci", "drivers", driver))):
                    raise WriteFailed("", None, f"module {module} loaded but driver {driver} did not register")
            return
        if a in (binding.VERIFY_VFIO_NODE, binding.VERIFY_NO_VFIO_NODE):
            group = _needs(s, s.group, "group")
            node = self.vfio_node(group)
            if a == binding.VERIFY_VFIO_NODE and not self.wait_until(lambda: os.path.exists(node)):
                raise WriteFailed(node, None, f"{node} did not appear within {self.verify_timeout:g}s (udev?)")
            if a == binding.VERIFY_NO_VFIO_NODE and not self.wait_until(lambda: not os.path.exists(node)):
                raise WriteFailed(node, None, f"{node} is still there: another device of group {group} is on vfio-pci")
            return
        pci = _needs(s, s.pci, "pci")
        if a == binding.SET_OVERRIDE:
            self.write(f"bus/pci/devices/{pci}/driver_override", _needs(s, s.driver, "driver"), pci)
        elif a == binding.CLEAR_OVERRIDE:
            self.write(f"bus/pci/devices/{pci}/driver_override", "\n", pci)
        elif a == binding.UNBIND:
            self.unbind(pci)
        elif a == binding.PROBE:
            self.write("bus/pci/drivers_probe", pci, pci)
        elif a == binding.VERIFY_DRIVER:
            if not self.wait_until(lambda: self.driver(pci) == s.driver):
                raise WriteFailed(self.dev(pci, "driver"), None,
                                  f"{pci} is on {self.driver(pci) or 'no driver'} after probe, expected {s.driver}")
        elif a == binding.VERIFY_NATIVE:
            if not self.wait_until(lambda: self.driver(pci) is not None and not binding.is_vfio(self.driver(pci))):
                raise WriteFailed(self.dev(pci, "driver"), None,
                                  f"{pci} is on {self.driver(pci) or 'no driver'} after probe, expected its native driver")
        elif a == binding.VERIFY_RELEASED:
            if not self.wait_until(lambda: not binding.is_vfio(self.driver(pci))):
                raise WriteFailed(self.dev(pci, "driver"), None, f"{pci} is still on {self.driver(pci)}")
        else:
            raise WriteFailed("", None, f"unknown step {a!r}")

    def preflight(self) -> None:
        """Everything that can say "not now" runs before the first write, so a waiting outcome
        leaves the host as it was: other holders, our own NVML handle, nvidia's unbindLock."""
        unbinds = [s.pci for s in self.plan.steps if s.action == binding.UNBIND and s.pci is not None]
        if not unbinds:
            return
        if self.check_holders:
            others = self.holders(include_self=False)
            if others:
                raise _Waiting(others, _holders_text(others))
        nv = [p for p in unbinds if self.driver(p) == "nvidia"]
        if not nv:
            return
        if self.before_unbind is not None:
            self.before_unbind()
            self.nvml_closed = True
        if self.check_holders:
            mine = [h for h in self.holders(include_self=True) if h.pid == os.getpid()]
            if mine:
                raise _Failed(f"gpud itself still holds {', '.join(sorted({h.device for h in mine}))} "
                              f"after closing its NVML handle")
        for p in nv:
            self.take_lock(p)

    def take_lock(self, pci: str) -> None:
        if not self.check_holders or pci in self.locked or not self.has_unbind_lock(pci):
            return
        if not self.procs.take_unbind_lock(pci):
            for q in self.locked:
                self.procs.release_unbind_lock(q)
            self.locked.clear()
            raise _Waiting((), f"{pci}: nvidia refuses its unbindLock (usage count not zero: a user /proc does "
                               f"not show, e.g. nvidia-persistenced in another namespace, nvidia_drm modeset "
                               f"or a kernel client)")
        self.locked.add(pci)

    def unbind(self, pci: str) -> None:
        live = self.driver(pci)
        if live is None:
            return  # already unbound (by hand, or a race): nothing to do
        if self.check_holders:  # again: someone may have opened it since the preflight
            others = self.holders(include_self=False)
            if others:
                raise _Waiting(others, f"{pci}: " + _holders_text(others))
        if live == "nvidia":
            if self.before_unbind is not None and not self.nvml_closed:
                self.before_unbind()
                self.nvml_closed = True
            self.take_lock(pci)
        try:
            self.write(f"bus/pci/drivers/{live}/unbind", pci, pci)
        except WriteFailed as e:
            if e.errno == errno_mod.ENODEV and self.driver(pci) is None:
                return  # it left on its own between the read and the write
            if pci in self.locked:
                self.procs.release_unbind_lock(pci)  # still bound: do not leave new opens refused
                self.locked.discard(pci)
            raise
        self.locked.discard(pci)

    def release_locks(self) -> None:
        for p in sorted(self.locked):
            try:
                self.procs.release_unbind_lock(p)
            except OSError:
                pass
        self.locked.clear()

    def has_unbind_lock(self, pci: str) -> bool:
        proc_root = getattr(self.procs, "proc_root", "/proc")
        return os.path.exists(os.path.join(proc_root, "driver", "nvidia", "gpus", pci, "unbindLock"))


class _Waiting(Exception):
    def __init__(self, holders: tuple[Holder, ...], message: str) -> None:
        super().__init__(message)
        self.holders, self.message = holders, message


class _Failed(Exception):
    pass


def _holders_text(holders: Iterable[Holder]) -> str:
    by_dev = collections.defaultdict(list)
    for h in holders:
        by_dev[h.device].append(f"{h.pid} ({h.name})")
    return "; ".join(f"{dev} held by {', '.join(who)}" for dev, who in sorted(by_dev.items()))


def execute(
    sysfs: Sysfs,
    procs: Procs,
    plan: binding.BindingPlan,
    *,
    before_unbind: Callable[[], None] | None = None,
    timeout: float = 30.0,
    verify_timeout: float = 10.0,
    dev_root: str | None = None,
    check_holders: bool = True,
    kmsg: str = "/dev/kmsg",
    clock: Clock | None = None,
    on_step: Callable[[binding.BindStep, str], None] | None = None,
) -> BindOutcome:
    """Carry out `plan`; returns converged / waiting(holders) / failed(reason) / stuck(reason).
    Blocks the calling thread at most about `timeout` per write plus `verify_timeout` per check:
    call it from a worker thread (the reconciler's `_in_worker`) so an event loop keeps serving.
    `check_holders=False` skips the holders scan and the unbindLock (tests: provoke a blocked
    unbind on purpose)."""
    dev_root = dev_root or getattr(procs, "dev_root", None) or getattr(sysfs, "dev_root", None) or "/dev"
    pci = plan.pci
    if plan.infeasible:
        return BindOutcome(pci, FAILED, plan.infeasible)
    stuck_now = {sw.pci: sw for sw in stuck_writes()}
    blocked = [stuck_now[p] for p in plan.endpoints if p in stuck_now]
    if blocked:
        sw = blocked[0]
        return BindOutcome(pci, STUCK, f"an earlier write of {sw.value!r} to {sw.path} (pid {sw.pid}, "
                                       f"{time.monotonic() - sw.started:.0f}s ago) is still blocked in the kernel: "
                                       f"{sw.reason}; not touching the device until it returns",
                           step="unbind", stuck_pid=sw.pid)
    if not plan.steps:
        return BindOutcome(pci, CONVERGED, "already in place")
    run = _BindingRun(sysfs, procs, plan, before_unbind=before_unbind, timeout=timeout, verify_timeout=verify_timeout,
               dev_root=dev_root, check_holders=check_holders, kmsg=kmsg, clock=clock or SystemClock(), on_step=on_step)
    pre = binding.BindStep("preflight", pci=pci)
    for s in (pre, *plan.steps):
        try:
            if s is pre:
                run.preflight()
                continue
            run.step(s)
        except _Waiting as e:
            run.release_locks()
            return BindOutcome(pci, WAITING, e.message, holders=e.holders, done=tuple(run.done), step=str(s))
        except WriteStuck as e:
            return BindOutcome(pci, STUCK, f"{s}: write to {e.path} still blocked after {timeout:g}s "
                                           f"(pid {e.pid} left to finish): {e.reason}",
                               done=tuple(run.done), step=str(s), stuck_pid=e.pid)
        except WriteFailed as e:
            run.release_locks()
            what = f"{s}: {e.meaning}" + (f" [errno {e.errno}]" if e.errno is not None else "")
            return BindOutcome(pci, FAILED, what, done=tuple(run.done), step=str(s), errno=e.errno)
        except _Failed as e:
            run.release_locks()
            return BindOutcome(pci, FAILED, f"{s}: {e}", done=tuple(run.done), step=str(s))
        except ReadOnlyError as e:
            run.release_locks()
            return BindOutcome(pci, FAILED, str(e), done=tuple(run.done), step=str(s))
        except OSError as e:  # load_module, holders scan
            run.release_locks()  # an unbindLock left taken would refuse every new open of the GPU
            return BindOutcome(pci, FAILED, f"{s}: {describe_error(e)}",
                               done=tuple(run.done), step=str(s), errno=e.errno)
        except Exception as e:  # noqa: BLE001 - e.g. before_unbind (closing our NVML session) failed
            run.release_locks()
            return BindOutcome(pci, FAILED, f"{s}: {type(e).__name__}: {e}", done=tuple(run.done), step=str(s))
        run.done.append(str(s))
        if on_step is not None:
            on_step(s, "done")
    verified = [s.driver for s in plan.steps if s.action == binding.VERIFY_DRIVER and s.pci == pci and s.driver]
    target = (verified[-1] if verified else "vfio-pci") if plan.target == binding.VFIO \
        else (plan.native_driver or "native drivers")
    return BindOutcome(pci, CONVERGED, f"{len(plan.endpoints)} endpoint(s) on {target}", done=tuple(run.done))

