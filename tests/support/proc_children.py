"""Processes by parent and command line, read from /proc: pgrep and ps are procps', which a minimal
Debian 12 does not have (scripts/fresh-check). Standard library only: runnable as a script in a
container too (`python3 proc_children.py PPID|any NEEDLE` prints "pid ppid nice" per process).
"""

from __future__ import annotations

import os
import sys


def processes(needle: str, proc_root: str = "/proc") -> list[tuple[int, int, int]]:
    """(pid, parent pid, nice) of each process whose command line contains `needle`, but this one."""
    out = []
    for entry in os.listdir(proc_root):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"{proc_root}/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"{proc_root}/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if needle in cmdline:
            out.append((int(entry), int(fields[1]), int(fields[16])))  # stat(5): ppid, nice
    return sorted(out)


def children(ppid: int, needle: str) -> list[int]:
    """The pids of `ppid`'s children whose command line contains `needle`."""
    return [pid for pid, parent, _ in processes(needle) if parent == ppid]


if __name__ == "__main__":
    for pid, parent, nice in processes(sys.argv[2]):
        if sys.argv[1] == "any" or parent == int(sys.argv[1]):
            print(pid, parent, nice)
