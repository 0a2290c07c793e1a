"""The qualification report: one line per check, grouped, and a verdict a person reads at a glance.

Each check says what was found (`reason`) and what gpud does about it (`action`), so an operator
knows before roll-out which of gpud's paths this host allows and which it will refuse or leave to
them. `--json` is the same report as msgspec encodes it.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct

Status = Literal["ok", "warn", "fail", "unknown"]
MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "unknown": "??"}


class Check(Struct, frozen=True, omit_defaults=True):
    group: str  # "driver", "host", "services", "GPU 0 0000:3b:00.0", "exercise 0000:3b:00.0"
    name: str
    status: Status
    reason: str  # what was found, one line
    action: str = ""  # what gpud does about it
    expected: str | None = None  # --mutate: what gpud's planner / the simulator predicted
    observed: str | None = None  # --mutate: what the hardware answered


class Verdict(Struct, frozen=True):
    status: Status
    summary: str


class Report(Struct, frozen=True):
    mode: Literal["read-only", "mutate"]
    host: str
    started: str
    finished: str
    checks: list[Check]
    verdict: Verdict
    counts: dict[str, int]


def verdict(checks: list[Check], mode: str) -> Verdict:
    """fail if any check failed; else warn when something needs the operator; unknowns are named."""
    by = {s: [c for c in checks if c.status == s] for s in ("ok", "warn", "fail", "unknown")}
    if by["fail"]:
        names = "; ".join(f"{c.group}: {c.name}" for c in by["fail"][:4])
        more = f" and {len(by['fail']) - 4} more" if len(by["fail"]) > 4 else ""
        return Verdict("fail", f"gpud cannot do everything it needs on this host: {names}{more}")
    if by["warn"] or by["unknown"]:
        parts = []
        if by["warn"]:
            parts.append(f"{len(by['warn'])} warning{'s' if len(by['warn']) != 1 else ''} to read")
        if by["unknown"]:
            parts.append(f"{len(by['unknown'])} check{'s' if len(by['unknown']) != 1 else ''} could not be answered")
        return Verdict("warn", f"gpud can run here; {', '.join(parts)}")
    what = "every hardware path behaved as gpud predicts" if mode == "mutate" else "gpud has what it needs"
    return Verdict("ok", what)


def counts(checks: list[Check]) -> dict[str, int]:
    return {s: sum(1 for c in checks if c.status == s) for s in ("ok", "warn", "fail", "unknown")}


def render_text(report: Report) -> str:
    lines = [f"gpud qualify ({report.mode}) on {report.host}, {report.started}", ""]
    group = None
    width = max((len(c.name) for c in report.checks), default=10)
    for c in report.checks:
        if c.group != group:
            if group is not None:
                lines.append("")
            lines.append(c.group)
            group = c.group
        lines.append(f"  {MARK[c.status]:<4} {c.name:<{width}}  {c.reason}")
        if c.status != "ok" and (c.expected is not None or c.observed is not None):
            lines.append(f"       {'':<{width}}  expected: {c.expected}; observed: {c.observed}")
        if c.action and c.status != "ok":
            lines.append(f"       {'':<{width}}  -> {c.action}")
    n = report.counts
    lines += ["", f"{n['ok']} ok, {n['warn']} warn, {n['fail']} fail, {n['unknown']} unknown",
              f"verdict: {report.verdict.status.upper()}: {report.verdict.summary}"]
    return "\n".join(lines) + "\n"


def to_json(report: Report) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"
