"""At start: sysfs writer helpers left by an earlier gpud are ended before any write of ours.

Why: a helper blocked in an unbind keeps writing after its daemon died; were a restarted gpud to
rebind that GPU meanwhile, the two would race (a late unbind after our bind: "bound to nvidia but
NVML does not see it"). Helpers ask for SIGKILL when their parent dies (gpud.host.kernel.sysfs_writer),
but one in uninterruptible sleep dies only when its write returns, and a helper of an older gpud
has no such request. So before the first pass every `python -m gpud.host.kernel.sysfs_writer` process
writing under this daemon's sysfs root (not another simulated host's) is sent SIGKILL and waited
for; one still alive after the wait is put in the stuck-write registry for its device
(gpud.host.kernel.deadline_write), so no write for that device is made until the kernel lets it go.
"""

from __future__ import annotations

import os
import re
import signal
import time

from msgspec import Struct

from gpud.host.kernel import deadline_write

# The helper's module, and its name before host/ had folders (a helper of an older gpud).
_HELPER_MODULES = ("gpud.host.kernel.sysfs_writer", "gpud.host.kernel.sysfs_writer")
_PCI = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


class Leftover(Struct, frozen=True):
    pid: int
    relpath: str
    value: str
    pci: str | None
    ended: bool  # gone by the end of the wait


def _helpers(root: str, proc: str) -> list[tuple[int, str, str]]:
    """(pid, relpath, value) of writer helpers of `root`, not ours (any parent)."""
    found = []
    me = os.getpid()
    for name in os.listdir(proc):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(os.path.join(proc, name, "cmdline"), "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if not any(m in argv for m in _HELPER_MODULES) or "--root" not in argv:
            continue
        i = argv.index("--root")
        if i + 1 >= len(argv) or os.path.realpath(argv[i + 1]) != os.path.realpath(root):
            continue
        tail = argv[argv.index("--") + 1:] if "--" in argv else argv[-2:]
        relpath, value = (tail + ["", ""])[:2]
        found.append((int(name), relpath, value))
    return found


def _pci_of(relpath: str, value: str) -> str | None:
    for text in (value, relpath):
        m = _PCI.search(text)
        if m:
            return m.group(0)
    return None


def end_leftovers(root: str, *, timeout: float = 10.0, proc: str = "/proc") -> list[Leftover]:
    """SIGKILL every helper of `root` left from before and wait up to `timeout` s for them to go.
    Returns what was found; those not `ended` are registered as stuck writes."""
    found = _helpers(root, proc)
    for pid, _, _ in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    alive = {pid for pid, _, _ in found}
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if _running(pid, proc)}
        if alive:
            time.sleep(0.02)
    out = []
    for pid, relpath, value in found:
        pci = _pci_of(relpath, value)
        still = pid in alive and _running(pid, proc)
        out.append(Leftover(pid=pid, relpath=relpath, value=value, pci=pci, ended=not still))
        if still and pci is not None:
            deadline_write.register_foreign_stuck(pid, pci, os.path.join(root, relpath), value,
                                                  "a writer left by an earlier gpud is still blocked in the kernel")
    return out


def _running(pid: int, proc: str) -> bool:
    """Alive and not a zombie (a zombie's write is over; its parent, gone, cannot reap it)."""
    try:
        with open(os.path.join(proc, str(pid), "stat"), "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")
