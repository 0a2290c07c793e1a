"""The helper process that carries out one sysfs write for the deadline writer.

`python -m gpud.host.kernel.sysfs_writer --root ROOT [--parent PID] [--store MODULE:FACTORY ARG] RELPATH VALUE`

With `--parent` it dies with the daemon: it asks for SIGKILL when its parent dies
(prctl PR_SET_PDEATHSIG) and exits at once if the parent is already gone (it died between the
fork and the prctl), so a `kill -9` of gpud leaves no helper writing behind a restarted one.

It is started with subprocess (fork+exec of a fresh interpreter: safe from any thread of the
multithreaded daemon, unlike a bare fork) and keeps none of the daemon's fds, so a write the kernel
never finishes holds no flock of the daemon's. It does the adapter's one write(2) and nothing else.

On stdout it answers, in this order: the byte b"R" once it is about to write (the parent's deadline
counts from here, so interpreter start-up on a loaded host is never mistaken for a blocked write),
then one length-prefixed JSON message {"ok": bool, "errno": int|null, "meaning": str}. Exit status 0
means written, 1 refused (the message says why), 2 the helper itself failed.

`--store` names a replacement for os.write that can be rebuilt in this process from an importable
factory and one string argument (the simulator's kernel store: its factory and host directory);
see gpud.host.kernel.deadline_write.store_spec.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import signal
import struct
import sys
from collections.abc import Callable
from typing import Any

WRITTEN, REFUSED, HELPER_FAILED = 0, 1, 2
READY = b"R"


def load_factory(spec: str) -> Callable[[str], Any]:
    """`module:attribute` -> the attribute (a callable taking one string)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"--store must be MODULE:FACTORY, got {spec!r}")
    return getattr(importlib.import_module(module), attr)


def frame(msg: dict[str, Any]) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack("!I", len(data)) + data


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> bool:
    """SIGKILL for this process when its parent dies; False when the parent is gone already."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return os.getppid() == parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpud.host.kernel.sysfs_writer")
    parser.add_argument("--root", required=True)
    parser.add_argument("--parent", type=int, help="die with this process (the daemon)")
    parser.add_argument("--store", nargs=2, metavar=("MODULE:FACTORY", "ARG"))
    parser.add_argument("relpath")
    parser.add_argument("value")
    args = parser.parse_args(argv)
    out = sys.stdout.fileno()
    if args.parent is not None and not die_with_parent(args.parent):
        return HELPER_FAILED  # the daemon died before this helper began: nobody waits for its write
    try:
        from gpud.host.kernel.sysfs import Sysfs, describe_error
        from gpud.host.readonly import ReadOnlyError

        store = load_factory(args.store[0])(args.store[1]) if args.store else None
        sysfs = Sysfs(args.root, store=store)
    except BaseException as e:  # noqa: BLE001 - reported, not lost
        os.write(out, READY + frame({"ok": False, "errno": None,
                                     "meaning": f"sysfs writer could not start: {type(e).__name__}: {e}"}))
        return HELPER_FAILED
    os.write(out, READY)
    code = REFUSED
    try:
        sysfs.write(args.relpath, args.value)
        msg: dict[str, Any] = {"ok": True}
        code = WRITTEN
    except ReadOnlyError as e:
        msg = {"ok": False, "errno": None, "meaning": str(e)}
    except OSError as e:
        msg = {"ok": False, "errno": e.errno, "meaning": describe_error(e)}
    except BaseException as e:  # noqa: BLE001 - anything must be reported, not lost
        msg = {"ok": False, "errno": None, "meaning": f"{type(e).__name__}: {e}"}
        code = HELPER_FAILED
    os.write(out, frame(msg))
    return code


if __name__ == "__main__":
    sys.exit(main())
