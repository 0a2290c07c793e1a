"""The simulated host's systemd unit manager and logind: what `gpud --sim` stops, starts, restarts
and asks to reboot, so that no host effect of a simulated host ever reaches the real machine's
system bus.

The state lives in DIR/services.json beside the GPU state, under its own lock (DIR/services.lock):
- `units`: unit name -> ActiveState ("active", "inactive", "failed"); a unit not listed is not
  installed, as LoadUnit's LoadState "not-found" says on a real host. A fresh host has none, so a
  CDI refresh finds no `nvidia-cdi-refresh.service` and a drain stops nothing, until
  `gpud-sim unit DIR add NAME` installs one;
- `calls`: how often each D-Bus method was called ("systemd1.StopUnit", "login1.Reboot", ...),
  shown by `gpud-sim stats`;
- `reboots`: the reasons logind was asked to reboot for. The simulated logind only records the
  request: the operator (or a test) reboots the host with `gpud-sim reboot DIR`, as the real
  machine would go down after the call returned (logind's Reboot replies before shutting down).

A job on a simulated unit always ends "done" at once: a real StopUnit of an installed unit ends
"done" unless the unit's own stop fails, which nothing here models (unknown, the kinder rule).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec

SERVICES_FILE = "services.json"
LOCK_FILE = "services.lock"
STATES = ("active", "inactive", "failed")
# systemd.unit(5): a unit name is at most 255 bytes of [A-Za-z0-9:_.\\@-] with a type suffix
UNIT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:-_.\\@")
UNIT_SUFFIXES = (".service", ".socket", ".target", ".device", ".mount", ".automount", ".swap", ".timer",
                 ".path", ".slice", ".scope")


class Services(msgspec.Struct):
    units: dict[str, str] = msgspec.field(default_factory=dict)
    calls: dict[str, int] = msgspec.field(default_factory=dict)
    reboots: list[str] = msgspec.field(default_factory=list)


class UnitError(ValueError):
    """A unit name systemd would refuse (org.freedesktop.systemd1.InvalidName)."""


def check_unit_name(name: str) -> str:
    if not name or len(name) > 255 or not set(name) <= UNIT_CHARS or not name.endswith(UNIT_SUFFIXES):
        raise UnitError(f"{name!r} is not a unit name (systemd.unit(5): [A-Za-z0-9:_.\\@-], at most 255 "
                        f"bytes, ending in a unit type such as .service)")
    return name


@contextlib.contextmanager
def locked(host_dir: str | os.PathLike, *, write: bool = True) -> Iterator[Services]:
    """Hold the services lock; yields the state and saves it (atomically) on a clean exit when `write`."""
    d = Path(host_dir)
    if not d.is_dir():
        raise FileNotFoundError(2, "No such directory", str(d))
    fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
        path = d / SERVICES_FILE
        try:
            state = msgspec.json.decode(path.read_bytes(), type=Services)
        except FileNotFoundError:
            state = Services()
        yield state
        if write:
            tmp = path.with_name(f".{SERVICES_FILE}.{os.getpid()}")
            tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state)))
            os.replace(tmp, path)
    finally:
        os.close(fd)


def _count(state: Services, method: str) -> None:
    state.calls[method] = state.calls.get(method, 0) + 1


def install(host_dir: str | os.PathLike, unit: str, active: bool = True) -> None:
    """Install a unit on the simulated host (`gpud-sim unit DIR add NAME [--inactive]`)."""
    check_unit_name(unit)
    with locked(host_dir) as st:
        st.units[unit] = "active" if active else "inactive"


def remove(host_dir: str | os.PathLike, unit: str) -> None:
    with locked(host_dir) as st:
        if st.units.pop(unit, None) is None:
            raise LookupError(f"no unit {unit} on the simulated host")


def unit_state(host_dir: str | os.PathLike, unit: str) -> tuple[str, str]:
    """(LoadState, ActiveState), as systemd1's LoadUnit and the Unit properties answer them."""
    with locked(host_dir) as st:
        _count(st, "systemd1.LoadUnit")
        state = st.units.get(unit)
    return ("loaded", state) if state is not None else ("not-found", "inactive")


def job(host_dir: str | os.PathLike, verb: str, unit: str) -> str:
    """Run StopUnit / StartUnit / RestartUnit on a simulated unit; returns the job's result as
    JobRemoved carries it. A unit that is not installed refuses the call, as systemd does
    (org.freedesktop.systemd1.NoSuchUnit)."""
    if verb not in ("StopUnit", "StartUnit", "RestartUnit"):
        raise ValueError(f"the simulated unit manager has no method {verb}")
    with locked(host_dir) as st:
        _count(st, f"systemd1.{verb}")
        if unit not in st.units:
            raise LookupError(f"Unit {unit} not found.")
        st.units[unit] = "inactive" if verb == "StopUnit" else "active"
    return "done"


def reboot_requested(host_dir: str | os.PathLike, reason: str) -> None:
    """login1.Manager.Reboot: recorded, not done (the module docstring says why)."""
    with locked(host_dir) as st:
        _count(st, "login1.Reboot")
        st.reboots.append(reason)


def read(host_dir: str | os.PathLike) -> Services:
    with locked(host_dir, write=False) as st:
        return st
