"""A sysfs write that cannot hang its caller: it runs in a helper process with a deadline.

Writing `unbind` for a busy nvidia GPU blocks uninterruptibly, a vfio-pci unbind waits while a VM
holds the device, and a reset waits on the device lock such a write holds. So every such write is
carried out by `gpud.host.kernel.sysfs_writer`, started with subprocess (fork+exec, safe from the worker
thread of a multithreaded daemon, which a bare os.fork is not). When the deadline passes first the
write is "stuck": the helper is abandoned to a reaper thread (a process in D state cannot be
killed), recorded in a process-wide registry with what the kernel says about it, and later writes
for that device are refused without touching it until the kernel lets the helper finish.

No helper outlives the daemon, even one killed with SIGKILL: each helper asks the kernel for
SIGKILL when its parent dies (PR_SET_PDEATHSIG, in gpud.host.kernel.sysfs_writer). The kernel sends it
when the *thread* that forked the helper ends, so every helper is started by one spawner thread
that lives as long as the daemon; a worker thread that finishes never takes its helper with it.
A helper in uninterruptible sleep dies when its write returns; a restarted daemon waits for such
leftovers first (gpud.host.kernel.writer_leftovers).

A replacement for os.write (the simulator's kernel) must be rebuildable in the helper: it offers
`child_spec() -> ("module:factory", "argument")`, and the helper calls factory(argument).
"""

from __future__ import annotations

import errno
import json
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from msgspec import Struct

from gpud.host.kernel.kmsg import kernel_reason
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.kernel.sysfs_writer import READY
from gpud.host.readonly import refuse_if

# How long the helper may take to start (interpreter and imports) before its write begins. Not the
# write's deadline: a loaded host must never make a quick write look blocked.
START_LIMIT = 60.0


class WriteFailed(Exception):
    """The kernel (or a verification of what it did) refused: `errno` may be None."""

    def __init__(self, path: str, err: int | None, meaning: str) -> None:
        super().__init__(meaning)
        self.path, self.errno, self.meaning = path, err, meaning


class WriteStuck(Exception):
    """The write did not return within its deadline; its helper `pid` was left to finish."""

    def __init__(self, pid: int, path: str, reason: str) -> None:
        super().__init__(reason)
        self.pid, self.path, self.reason = pid, path, reason


class StuckWrite(Struct):
    pid: int
    pci: str
    path: str
    value: str
    started: float  # time.monotonic()
    reason: str
    exit_status: int | None = None  # set by the reaper when the write finally returned


# pci -> the abandoned write still blocked in the kernel. Module-wide: one kernel, one registry.
_stuck: dict[str, StuckWrite] = {}
_stuck_lock = threading.Lock()


def stuck_writes() -> list[StuckWrite]:
    with _stuck_lock:
        return list(_stuck.values())


def stuck_write_for(pci: str) -> StuckWrite | None:
    with _stuck_lock:
        return _stuck.get(pci)


def end_stuck_writes(timeout: float = 5.0) -> list[StuckWrite]:
    """When gpud stops: SIGKILL every abandoned helper (our own children) and wait up to `timeout`
    for their reapers, so none outlives the daemon. A helper in uninterruptible sleep dies only
    when the kernel lets its write return; those still alive are returned (and logged by the caller)."""
    for sw in stuck_writes():
        try:
            os.kill(sw.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while stuck_writes() and time.monotonic() < deadline:
        time.sleep(0.02)
    return stuck_writes()


def _reap(sw: StuckWrite, helper: subprocess.Popen) -> None:
    """Waits for an abandoned helper in its own daemon thread: when the kernel lets the write
    return it exits and must not stay a zombie; then the device may be touched again."""
    status = helper.wait()
    if helper.stdout is not None:
        helper.stdout.close()
    with _stuck_lock:
        sw.exit_status = status
        if _stuck.get(sw.pci) is sw:
            del _stuck[sw.pci]


def register_foreign_stuck(pid: int, pci: str, path: str, value: str, reason: str) -> StuckWrite:
    """A helper that is not our child (left by an earlier daemon) still blocked in the kernel:
    writes for `pci` are refused until it is gone (watched from /proc: it cannot be waited for)."""
    sw = StuckWrite(pid=pid, pci=pci, path=path, value=value, started=time.monotonic(), reason=reason)
    with _stuck_lock:
        _stuck[pci] = sw

    def watch() -> None:
        while os.path.exists(f"/proc/{pid}"):
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                        break
            except (OSError, IndexError):
                break
            time.sleep(0.5)
        with _stuck_lock:
            if _stuck.get(pci) is sw:
                del _stuck[pci]
    threading.Thread(target=watch, name=f"gpud-watch-{pid}", daemon=True).start()
    return sw


def store_spec(sysfs: Sysfs) -> list[str]:
    """The helper's --store arguments for the adapter's replacement of os.write, if any."""
    store = getattr(sysfs, "store", None)
    if store is None:
        return []
    child_spec = getattr(store, "child_spec", None)
    if child_spec is None:
        raise TypeError(f"{store!r} replaces os.write but cannot be rebuilt in the sysfs writer process: "
                        f"give it child_spec() -> ('module:factory', 'argument')")
    factory, arg = child_spec()
    return ["--store", factory, str(arg)]


class _Spawner:
    """Starts every helper from one long-lived thread (the parent-death signal follows the thread
    that forked: see the module's docstring)."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, argv: list[str]) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="gpud-writer-spawner", daemon=True)
                self._thread.start()
        answer: queue.SimpleQueue = queue.SimpleQueue()
        self._requests.put((argv, answer))
        ok, value = answer.get()
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            argv, answer = self._requests.get()
            try:
                answer.put((True, subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                   close_fds=True)))
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                answer.put((False, e))


_spawner = _Spawner()


def _read_answer(fd: int, start_limit: float, timeout: float) -> tuple[bool, bytes | None]:
    """Reads the helper's stdout: its READY byte within `start_limit` seconds, then its framed
    answer within `timeout` seconds of READY. Returns (ready seen, the message or None when a
    deadline passed). A helper that dies without answering yields a message saying so."""
    buf = b""
    deadline = time.monotonic() + start_limit
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        body = buf[1:]
        if len(body) >= 4 and len(body) >= 4 + struct.unpack("!I", body[:4])[0]:
            return True, body[4 : 4 + struct.unpack("!I", body[:4])[0]]
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return bool(buf), None
        chunk = os.read(fd, 65536)
        if not chunk:  # the helper died without answering (killed, or crashed before its write)
            return True, json.dumps({"ok": False, "errno": None, "meaning": "the writer process died"}).encode()
        if not buf:
            if chunk[:1] != READY:
                return True, json.dumps({"ok": False, "errno": None,
                                         "meaning": f"the writer process answered {chunk[:40]!r}"}).encode()
            deadline = time.monotonic() + timeout  # the write begins now
        buf += chunk


def write_with_deadline(sysfs: Sysfs, relpath: str, value: str, pci: str, timeout: float, kmsg: str = "/dev/kmsg") -> None:
    """One sysfs write of `value` to sysfs.root/relpath by the helper process. Returns when it is
    written; WriteFailed with the errno and meaning when refused; WriteStuck when it is still
    blocked `timeout` seconds after it began (the helper is then in the stuck registry)."""
    path = os.path.join(sysfs.root, relpath)
    argv = [sys.executable, "-m", "gpud.host.kernel.sysfs_writer", "--root", sysfs.root, "--parent", str(os.getpid()),
            *store_spec(sysfs), "--", relpath, value]
    helper = _spawner.popen(argv)
    assert helper.stdout is not None  # stdout=PIPE
    fd = helper.stdout.fileno()
    ready, data = _read_answer(fd, max(START_LIMIT, timeout), timeout)
    if data is None:
        reason = kernel_reason(helper.pid, [pci, "NVRM"], kmsg=kmsg)
        if not ready:
            reason = f"the writer process did not start within {max(START_LIMIT, timeout):g}s; {reason}"
        sw = StuckWrite(pid=helper.pid, pci=pci, path=path, value=value.strip(), started=time.monotonic(),
                        reason=reason)
        with _stuck_lock:
            _stuck[pci] = sw
        threading.Thread(target=_reap, args=(sw, helper), name=f"gpud-reap-{helper.pid}", daemon=True).start()
        raise WriteStuck(helper.pid, path, reason)
    helper.stdout.close()
    helper.wait()  # it exits right after writing its answer
    msg = json.loads(data)
    if not msg["ok"]:
        raise WriteFailed(path, msg["errno"], msg["meaning"])


class DeadlineSysfs:
    """The sysfs adapter with `reset` done like an unbind: by the helper, with a deadline. A reset
    waits on the device lock, which a stuck unbind holds; a reset stuck in the kernel must not
    hang the pass (a watchdog would not see it: the event loop stays healthy)."""

    def __init__(self, sysfs: Sysfs, timeout: float, kmsg: str = "/dev/kmsg") -> None:
        self._sysfs, self._timeout, self._kmsg = sysfs, timeout, kmsg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sysfs, name)

    def reset(self, address: str) -> None:
        refuse_if(getattr(self._sysfs, "read_only", False), "reset", address)
        earlier = stuck_write_for(address)
        if earlier is not None:
            raise TimeoutError(errno.ETIMEDOUT, f"an earlier write to {earlier.path} is still blocked: "
                                                f"{earlier.reason}")
        try:
            write_with_deadline(self._sysfs, f"bus/pci/devices/{address}/reset", "1", address, self._timeout,
                                self._kmsg)
        except WriteStuck as e:
            raise TimeoutError(errno.ETIMEDOUT, f"reset still blocked after {self._timeout:g}s "
                                                f"(pid {e.pid} left to finish): {e.reason}") from e
        except WriteFailed as e:
            raise OSError(e.errno, e.meaning, e.path) from e
