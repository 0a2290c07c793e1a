"""Durable whole-file replacement: readers (udevd, gpud after a crash or reboot) see the old file
or the new one, never half of one, and a power loss after the call keeps the change."""

from __future__ import annotations

import os
import tempfile


def replace_file(path: str, data: bytes, *, mode: int = 0o644) -> None:
    """Write `data` to a temp file in the same directory, fsync it, rename it over `path`, fsync
    the directory."""
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gpud-", dir=d)
    try:
        _write_all(fd, data)
        os.fchmod(fd, mode)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(d)


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (a signal, a full disk mid-way, some filesystems):
    a short write fsynced and renamed in would be a truncated file taken for a whole one."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(f"write wrote {n} bytes")
        view = view[n:]


def remove_file(path: str) -> None:
    """Unlink `path` durably; FileNotFoundError when it is not there."""
    os.unlink(path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
