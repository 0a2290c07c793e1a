"""The simulated NVML library's call counters, shared by every process of one simulated host.

Why not in state.json: a read-only NVML call changes nothing on the host, and rewriting the whole
state file to count it made every call cost a file write that grows with the host (1.8 ms a call on
64 GPUs). The counters live in two small files next to it instead:

- `DIR/calls.names`: the counted C symbols, one a line, append-only (a slot's index is its line);
- `DIR/calls.counts`: little-endian u64s, slot 0 the state file's save generation, slot i+1 the
  count of name i. A process maps it and adds in place, under the host lock (DIR/state.lock), so
  the counts are exact across processes, as `gpud-sim stats` and the tests read them.

The save generation (bumped by every `gpud.sim.state.save`, under the same lock) lets a process
keep its decoded copy of state.json while nobody saved since (gpud.sim.state.StateCache).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

NAMES_FILE = "calls.names"
COUNTS_FILE = "calls.counts"
_U64 = struct.Struct("<Q")


def read(host_dir: str | os.PathLike) -> dict[str, int]:
    """The counts by name, read without the lock (each slot is one aligned 8-byte word)."""
    d = Path(host_dir)
    try:
        names = (d / NAMES_FILE).read_text().split()
        raw = (d / COUNTS_FILE).read_bytes()
    except FileNotFoundError:
        return {}
    out = {}
    for i, name in enumerate(names):
        off = 8 * (i + 1)
        if off + 8 <= len(raw):
            n = _U64.unpack_from(raw, off)[0]
            if n:
                out[name] = n
    return out


def generation(host_dir: str | os.PathLike) -> int:
    try:
        with open(Path(host_dir) / COUNTS_FILE, "rb") as f:
            raw = f.read(8)
    except FileNotFoundError:
        return 0
    return _U64.unpack(raw)[0] if len(raw) == 8 else 0


class Counters:
    """One process's map of the counters file. Every method runs under the host's exclusive lock."""

    def __init__(self, host_dir: str | os.PathLike):
        self.dir = Path(host_dir)
        self._index: dict[str, int] = {}
        self._map: mmap.mmap | None = None
        self._size = 0

    def _remap(self) -> None:
        names_path, counts_path = self.dir / NAMES_FILE, self.dir / COUNTS_FILE
        try:
            names = names_path.read_text().split()
        except FileNotFoundError:
            names = []
        self._index = {n: i + 1 for i, n in enumerate(names)}
        fd = os.open(counts_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            need = 8 * (len(names) + 1)
            size = os.fstat(fd).st_size
            if size < need:
                os.ftruncate(fd, need)
                size = need
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(fd, size)
            self._size = size
        finally:
            os.close(fd)

    def _slot(self, name: str) -> int:
        slot = self._index.get(name)
        if slot is None or self._map is None:
            self._remap()  # another process may have added names since
            slot = self._index.get(name)
            if slot is None:
                with open(self.dir / NAMES_FILE, "a") as f:
                    f.write(name + "\n")
                self._remap()
                slot = self._index[name]
        return slot

    def bump(self, name: str) -> None:
        slot = self._slot(name)
        assert self._map is not None
        off = 8 * slot
        _U64.pack_into(self._map, off, _U64.unpack_from(self._map, off)[0] + 1)

    def generation(self) -> int:
        if self._map is None:
            self._remap()
        assert self._map is not None
        return _U64.unpack_from(self._map, 0)[0]


def bump_generation(host_dir: str | os.PathLike) -> int:
    """After a save of state.json (under the lock): the new generation."""
    path = Path(host_dir) / COUNTS_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        raw = os.pread(fd, 8, 0)
        gen = (_U64.unpack(raw)[0] if len(raw) == 8 else 0) + 1
        os.pwrite(fd, _U64.pack(gen), 0)
        return gen
    finally:
        os.close(fd)
