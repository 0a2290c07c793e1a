"""Placements and profile names read from real `nvidia-smi mig -lgipp` / `-lgip` text: an oracle that
shares no code with gpud (not gpud.profiles, not the simulator's tables)."""

from __future__ import annotations

import re
from pathlib import Path

_PLACEMENTS = re.compile(r"Profile ID\s+(\d+)\s+Placements?\s*:\s*\{([\d,]+)\}:(\d+)")
_PROFILE = re.compile(r"^\|\s+\d+\s+MIG\s+(\S+)\s+(\d+)\s+\d+/(\d+)", re.M)


def placements(lgipp: Path) -> dict[int, list[str]]:
    """profile id -> ["start:size", ...] as nvidia-smi printed them."""
    out: dict[int, list[str]] = {}
    for pid, starts, size in _PLACEMENTS.findall(lgipp.read_text()):
        out[int(pid)] = [f"{s}:{size}" for s in starts.split(",")]
    return out


def names(lgip: Path) -> dict[str, int]:
    """profile name ("1g.18gb") -> id."""
    return {name: int(pid) for name, pid, _total in _PROFILE.findall(lgip.read_text())}
