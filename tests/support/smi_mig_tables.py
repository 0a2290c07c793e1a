"""A reader of `nvidia-smi mig -lgip` and `-lgipp` tables (real captures, or gpudctl's output in
the same format) that shares no code with gpud: a mistake in gpud's tables cannot cancel out
against the same mistake in a test."""

from __future__ import annotations

import re

# A number, or `?` where gpudctl prints a value no source gives (nvidia-smi itself never does).
_N = r"(?:\d+|\?)"
_FIRST = re.compile(rf"^\|\s*\d+\s+MIG\s+(?P<name>\S+)\s+(?P<id>{_N})\s+(?P<free>{_N})/(?P<total>{_N})\s+"
                    rf"(?P<gib>\d+\.\d\d|\?)\s+(?P<p2p>Yes|No|\?)\s+(?P<sm>{_N})\s+(?P<dec>{_N})\s+(?P<enc>{_N})\s*\|$")
_SECOND = re.compile(rf"^\|\s+(?P<ce>{_N})\s+(?P<jpeg>{_N})\s+(?P<ofa>{_N})\s*\|$")
PLACEMENT_LINE = re.compile(r"^GPU\s+\d+\s+Profile ID\s+(\d+)\s+Placements?\s*:\s*\{([\d,]+)\}:(\d+)\s*$")


def _value(key: str, v: str) -> object:
    return v if key in ("name", "gib", "p2p") or v == "?" else int(v)


def read_lgip(text: str) -> list[dict]:
    """Every profile row, in listed order, with the fields of its two table lines (a second line
    cut off in the source leaves ce/jpeg/ofa out)."""
    rows: list[dict] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        first = _FIRST.match(line)
        if first is None:
            continue
        row = {k: _value(k, v) for k, v in first.groupdict().items()}
        second = _SECOND.match(lines[i + 1]) if i + 1 < len(lines) else None
        if second is not None:
            row.update({k: int(v) if v != "?" else v for k, v in second.groupdict().items()})
        else:
            assert i + 1 == len(lines), f"second line of {first['name']}: {lines[i + 1]!r}"
        rows.append(row)
    return rows


def by_id(rows: list[dict]) -> dict[int, dict]:
    out = {r["id"]: r for r in rows}
    assert len(out) == len(rows), "a profile id listed twice"
    return out


def read_lgipp(text: str) -> dict[int, list[tuple[int, int]]]:
    """Profile id -> [(start, size)] in the listed order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for line in text.splitlines():
        m = PLACEMENT_LINE.match(line)
        assert m is not None, f"not a placement line: {line!r}"
        out[int(m[1])] = [(int(s), int(m[3])) for s in m[2].split(",")]
    return out


def lgip_by_id(text: str) -> dict[int, dict]:
    """Profile id -> its row, for a table that lists each profile once."""
    return by_id(read_lgip(text))
