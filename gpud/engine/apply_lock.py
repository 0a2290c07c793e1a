"""The host-wide apply lock: two gpud daemons on one host (a second instance, a test run next to
the service) must never both change the GPUs. An flock on a file in the run directory, holding the
pid of the daemon that applies so the one that waits can say whom it waits for."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path


class ApplyLock:
    """Host-wide apply lock (flock): two daemons on one host must never both change it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @contextlib.asynccontextmanager
    async def held(self, on_wait: Callable[[str], None]) -> AsyncIterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                on_wait(f"another gpud (pid {holder}) is applying; waiting for {self.path}")
                await self._wait(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the flock

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
