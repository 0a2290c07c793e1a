"""What the kernel says: about a process blocked in a write (/proc/<pid>/{stat,wchan,stack} and the
last /dev/kmsg record naming the device; read-only and best effort: every part that cannot be read
is left out rather than failing the caller), and the nvidia driver's Xid reports as they are
logged (`follow`, `parse_xid`)."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import stat
from collections.abc import AsyncIterator, Iterable
from typing import NamedTuple


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


# ---- following the log: the nvidia driver's Xid reports ------------------------------------------

# NVRM's report, e.g. `NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics
# SM Warp Exception ...`: the GPU's domain:bus:device (no function), the Xid, then its words
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})\): (\d+),\s*(.*)")


class Xid(NamedTuple):
    slot: str  # "0000:cb:00", lower case: the GPU's address without its function
    code: int
    text: str


def parse_xid(text: str) -> Xid | None:
    m = _XID.search(text)
    return Xid(m.group(1).lower(), int(m.group(2)), m.group(3)) if m else None


def parse_record(raw: str) -> tuple[int, str] | None:
    """(sequence number, message) of one /dev/kmsg record: `<prio>,<seq>,<usec>,<flags>[,...];<text>`
    and continuation lines (Documentation/ABI/testing/dev-kmsg); None for anything else."""
    head, sep, text = raw.partition(";")
    fields = head.split(",")
    if not sep or len(fields) < 4 or not fields[1].isdigit():
        return None
    return int(fields[1]), text.split("\n", 1)[0]


async def follow(path: str = "/dev/kmsg") -> AsyncIterator[str]:
    """The message of every record logged from now on, as it comes, without polling. The real
    /dev/kmsg: opened non-blocking, positioned at the end (SEEK_END), read one record per read(2)
    whenever epoll says it is readable; EPIPE (the ring overwrote the next record) skips on. A
    regular file (the simulator's DIR/dev/kmsg, rewritten by rename): its directory is watched
    with inotify and the records after the last sequence number seen are handed out."""
    if stat.S_ISCHR(os.stat(path).st_mode):
        async for text in _follow_device(path):
            yield text
    else:
        async for text in _follow_file(path):
            yield text


async def _follow_device(path: str) -> AsyncIterator[str]:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    try:
        os.lseek(fd, 0, os.SEEK_END)
        loop.add_reader(fd, readable.set)
        while True:
            try:
                raw = os.read(fd, 8192)
            except BlockingIOError:
                readable.clear()
                await readable.wait()
                continue
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue
                raise
            got = parse_record(raw.decode(errors="replace"))
            if got is not None:
                yield got[1]
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def _records(path: str) -> list[tuple[int, str]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    return [r for r in map(parse_record, lines) if r is not None]


async def _follow_file(path: str) -> AsyncIterator[str]:
    from asyncinotify import Inotify, Mask

    name = os.path.basename(path)
    with Inotify() as ino:
        ino.add_watch(os.path.dirname(os.path.abspath(path)), Mask.CLOSE_WRITE | Mask.MOVED_TO | Mask.CREATE)
        last = max((seq for seq, _ in _records(path)), default=-1)  # after the watch: nothing slips by
        async for event in ino:
            if event.name is None or str(event.name) != name:
                continue
            for seq, text in _records(path):
                if seq > last:
                    last = seq
                    yield text
