"""Strings from outside, made safe for a terminal before gpudctl shows them.

Why: a reply carries strings gpud does not choose: process names (`comm`, which any user who can
open /dev/nvidia* sets with prctl), paths, layout and hook names, label values, NVML's strings,
error texts quoting a layout. Printed raw to root's terminal, a newline forges a line and an
escape sequence rewrites or hides what follows. So every string of a reply (and of an event, and
of an error) is escaped before rendering: C0 and C1 control characters, DEL and the Unicode line
separators and bidirectional overrides become visible `\\n`, `\\x1b`, `\\u202e` forms, and a
backslash is doubled so the escaped form cannot be forged either. `--json` prints the reply
exactly as gpud sent it (JSON escapes control characters itself).

Replies are escaped as gpud.cli.view reads the decoded maps (`reply(..., escape=True)`): every
string, map keys too, with `term`; a field of MULTILINE keeps its newlines.
"""

from __future__ import annotations

import re

# C0 (but not printable space), DEL, C1; line/paragraph separators; bidi embeddings/overrides/isolates.
# Every one of them but the backslash is a character str.isprintable() refuses (Cc, Zl, Zp, Cf), so
# a printable string without a backslash needs no look at all: the pattern is compiled only for a
# string that might need escaping (most replies have none, and compiling is paid per run).
_UNSAFE = "[\\\\\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _one(m: re.Match[str]) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


# Fields gpud composes as several lines from values it checked (the libvirt <hostdev> XML, made
# from a PCI address): their newlines are kept, anything else is escaped. Named by their key in a
# reply's map.
MULTILINE = frozenset({"libvirt_hostdev"})


def term(text: str, *, lines: bool = False) -> str:
    """`text` with nothing a terminal would act on (`lines`: newlines kept)."""
    if text.isprintable() and "\\" not in text:
        return text
    unsafe = re.compile(_UNSAFE)  # re's cache keeps it
    if not unsafe.search(text):
        return text
    if lines:
        return "\n".join(unsafe.sub(_one, part) for part in text.split("\n"))
    return unsafe.sub(_one, text)
