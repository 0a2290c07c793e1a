"""What the kernel says about a process blocked in a write: /proc/<pid>/{stat,wchan,stack} and the
last /dev/kmsg record naming the device. Read-only and best effort: every part that cannot be read
(no root, a kernel without /proc/<pid>/stack) is left out rather than failing the caller."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable


def read_text(path: str, limit: int = 4096) -> str | None:
    """At most `limit` bytes of a small kernel file, stripped; None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace").strip()
    except OSError:
        return None


def kernel_reason(pid: int, needles: Iterable[str], *, kmsg: str = "/dev/kmsg") -> str:
    """A blocked writer's state, wait channel, stack and the last kernel log line naming the
    device (or NVRM), joined into one sentence for an operator."""
    parts = []
    stat = read_text(f"/proc/{pid}/stat")
    if stat and ")" in stat:
        state = stat.rsplit(")", 1)[1].split()[0]
        parts.append(f"state {state}" + (" (uninterruptible)" if state == "D" else ""))
    wchan = read_text(f"/proc/{pid}/wchan")
    if wchan and wchan != "0":
        parts.append(f"wchan {wchan}")
    stack = read_text(f"/proc/{pid}/stack")
    if stack:
        frames = [re.sub(r"^\[<[0-9a-f]+>\]\s*", "", ln).split("+")[0] for ln in stack.splitlines()[:6]]
        parts.append("stack " + " < ".join(f for f in frames if f))
    line = last_kmsg_line(needles, kmsg=kmsg)
    if line:
        parts.append(f"kernel: {line}")
    return "; ".join(parts) or "no kernel detail readable"


def last_kmsg_line(needles: Iterable[str], *, kmsg: str = "/dev/kmsg", max_records: int = 50000) -> str | None:
    """The text of the last /dev/kmsg record containing any of `needles`. /dev/kmsg hands out
    one record per read(2) and EPIPE when the ring overwrote the record being read."""
    needles = [n for n in needles if n]
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    last = None
    try:
        for _ in range(max_records):
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.EPIPE:  # overwritten while reading: go on with the next
                    continue
                break
            if not rec:
                break
            text = rec.decode(errors="replace").split(";", 1)[-1].split("\n", 1)[0]
            if any(n in text for n in needles):
                last = text
    finally:
        os.close(fd)
    return last
