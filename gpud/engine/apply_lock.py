"""The host-wide apply lock: two gpud daemons on one host (a second instance, a test run next to
the service) must never both change the GPUs. An flock on a file in gpud's own run directory,
holding a record of the daemon that applies so the one that waits can say whom it waits for.

The lock is a privilege boundary too: a local user who could create, open or aim it could stop
every apply (holding it forever), make root write where they choose (a symlink at the path) or put
their words into status. So the file must live in a directory only the daemon's user can write
(`/run/gpud`, not the world-writable `/run/lock`), it is opened without following links and
without blocking on a FIFO, and it is used only when it is a regular file owned by the daemon's
user, mode 0600 (a 0644 file of an older gpud is narrowed). The holder shown while waiting comes
only from a record in gpud's own format (`gpud pid=<n>`); anything else is reported as unknown,
never quoted.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

# What gpud writes into the lock file, and the only text it will read back from it.
_RECORD = re.compile(rb"gpud pid=([1-9][0-9]{0,9})\n")


# A directory the lock creates (gpud's run directory, /run/gpud by default) is writable by its
# owner only, which is what _check_directory demands; readable and searchable by all, because the
# control socket lives there too and group gpud must reach it (the unit's RuntimeDirectoryMode,
# gpud.socket's DirectoryMode, tmpfiles.d and the socket server all make it 0755).
DIRECTORY_MODE = 0o755


class ApplyLockRefused(RuntimeError):
    """The lock file or its directory is not safe to use; no apply runs until it is fixed."""


class ApplyLockBusy(RuntimeError):
    """Another process holds the lock now (a try that does not wait)."""


def holder_record(pid: int) -> bytes:
    return f"gpud pid={pid}\n".encode()


def _check_directory(directory: Path, euid: int) -> None:
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ApplyLockRefused(f"apply lock directory {directory} is not a directory (a link or another file); "
                               f"refusing to use it")
    if st.st_uid != euid or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ApplyLockRefused(
            f"apply lock directory {directory} is writable by others (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}); it must be owned by uid {euid} and writable only by it")


def open_lock_file(path: Path) -> int:
    """Open (creating it 0600 if absent) the lock file safely; ApplyLockRefused when it is not ours."""
    euid = os.geteuid()
    if not path.parent.exists():
        path.parent.mkdir(mode=DIRECTORY_MODE, parents=True)
    _check_directory(path.parent, euid)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:  # ELOOP: a symlink at the path; ENXIO/EWOULDBLOCK: a FIFO nobody reads ...
        raise ApplyLockRefused(f"cannot open the apply lock {path}: {e.strerror} (a link or a special "
                               f"file there is refused)") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ApplyLockRefused(f"apply lock {path} is not a regular file; refusing to use it")
        if st.st_uid != euid:
            raise ApplyLockRefused(f"apply lock {path} is owned by uid {st.st_uid}, not {euid}; "
                                   f"refusing to use it (remove it)")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)  # an older gpud made it 0644: nobody else may open it, even to read
    except BaseException:
        os.close(fd)
        raise
    return fd


def describe_holder(fd: int) -> str:
    """Who holds the lock, from gpud's own record only."""
    data = os.pread(fd, 64, 0)
    found = _RECORD.fullmatch(data)
    return f"another gpud (pid {int(found.group(1))})" if found else "another process (unrecognised lock record)"


def _record_holder(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder_record(os.getpid()), 0)


class ApplyLock:
    """Host-wide apply lock (flock): two daemons on one host must never both change it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @contextlib.asynccontextmanager
    async def held(self, on_wait: Callable[[str], object]) -> AsyncIterator[None]:
        fd = open_lock_file(self.path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                on_wait(f"{describe_holder(fd)} is applying; waiting for {self.path}")
                await self._wait(fd)
            _record_holder(fd)
            yield
        finally:
            os.close(fd)  # releases the flock

    @contextlib.contextmanager
    def held_now(self) -> Iterator[None]:
        """The lock at once or not at all, for a one-off run that must not queue behind a daemon
        (`gpud qualify --mutate`): ApplyLockBusy, naming the holder, when another process holds it."""
        fd = open_lock_file(self.path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ApplyLockBusy(f"{describe_holder(fd)} holds {self.path}") from None
            _record_holder(fd)
            yield
        finally:
            os.close(fd)

    @staticmethod
    async def _wait(fd: int, interval: float = 0.5) -> None:
        """Retry the lock (not the hardware) until the other daemon's apply ends; unlike a thread
        parked in flock(), this can be cancelled when gpud stops."""
        while True:
            await asyncio.sleep(interval)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                continue
