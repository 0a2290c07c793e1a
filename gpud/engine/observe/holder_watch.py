"""Waking a pass when a process that blocks a step exits: a pidfd per holder becomes readable
when the process ends, so waiting for holders is an event on the loop, not a poll.

A process is reported once. After it exits, NVML or /proc can go on naming it for a while (a
zombie nobody has reaped yet still has its /proc entry and fds listed as gone only once reaped),
and every pass that still sees it would watch it again; its pidfd is readable at once, so without
memory the same exit would be announced on every pass. A process is known by its pid and its start
time (field 22 of /proc/<pid>/stat), so a new process that reuses the pid is watched again.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Callable, Iterable

from gpud.model import Holder

_REMEMBERED = 4096  # exited processes remembered; pids are recycled long before this matters


def process_key(pid: int, proc_root: str = "/proc") -> tuple[int, int | None]:
    """(pid, start time in clock ticks since boot), or (pid, None) when /proc does not say."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return (pid, None)
    # comm (field 2) may hold spaces and parentheses: the fields after it follow the last ")"
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return (pid, int(fields[19]))  # field 22 overall: starttime
    except (IndexError, ValueError):
        return (pid, None)


class HolderWatch:
    """Watches holders' pids; `on_exit(pid)` is called once when a watched process has exited."""

    def __init__(self, on_exit: Callable[[int], None], *, proc_root: str = "/proc") -> None:
        self.on_exit = on_exit
        self.proc_root = proc_root
        self._fds: dict[int, int] = {}  # pid -> its pidfd
        self._exited: collections.OrderedDict[tuple[int, int | None], None] = collections.OrderedDict()

    def watch(self, holders: Iterable[Holder]) -> None:
        loop = asyncio.get_running_loop()
        for h in holders:
            if h.pid in self._fds:
                continue
            key = process_key(h.pid, self.proc_root)
            if key in self._exited:
                continue  # already reported; still listed until it is reaped
            try:
                fd = os.pidfd_open(h.pid)
            except OSError:
                continue  # not a process we can see (simulated or gone): other events will wake us

            def _exited(fd: int = fd, pid: int = h.pid, key: tuple[int, int | None] = key) -> None:
                loop.remove_reader(fd)
                os.close(fd)
                self._fds.pop(pid, None)
                self._exited[key] = None
                while len(self._exited) > _REMEMBERED:
                    self._exited.popitem(last=False)
                self.on_exit(pid)

            self._fds[h.pid] = fd
            loop.add_reader(fd, _exited)
