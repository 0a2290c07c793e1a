"""Waking a pass when a process that blocks a step exits: a pidfd per holder becomes readable
when the process ends, so waiting for holders is an event on the loop, not a poll."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable

from gpud.model import Holder


class HolderWatch:
    """Watches holders' pids; `on_exit(pid)` is called once when a watched process has exited."""

    def __init__(self, on_exit: Callable[[int], None]) -> None:
        self.on_exit = on_exit
        self._fds: dict[int, int] = {}  # pid -> its pidfd

    def watch(self, holders: Iterable[Holder]) -> None:
        loop = asyncio.get_running_loop()
        for h in holders:
            if h.pid in self._fds:
                continue
            try:
                fd = os.pidfd_open(h.pid)
            except OSError:
                continue  # not a process we can see (simulated or gone): other events will wake us

            def _exited(fd: int = fd, pid: int = h.pid) -> None:
                loop.remove_reader(fd)
                os.close(fd)
                self._fds.pop(pid, None)
                self.on_exit(pid)

            self._fds[h.pid] = fd
            loop.add_reader(fd, _exited)
