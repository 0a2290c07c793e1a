"""What gpudctl escapes before a terminal sees it (gpud.cli.escape), checked for every code point
against the list its docstring gives, written here as ranges: C0 controls, DEL and C1, the
Unicode line and paragraph separators, the bidirectional embeddings, overrides and isolates, and
the backslash (doubled, so an escaped form cannot be forged). Everything else passes unchanged,
by whichever path term() takes (a printable string is not searched at all)."""

from __future__ import annotations

import sys

from gpud.cli.escape import term
from gpud.cli.view import reply

UNSAFE = {*range(0x00, 0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}


def test_every_code_point_is_escaped_exactly_when_the_list_names_it():
    wrong = [hex(cp) for cp in range(sys.maxunicode + 1)
             if (term(chr(cp)) != chr(cp)) != (cp in UNSAFE or cp == 0x5C)]
    assert wrong == []


def test_escaped_forms():
    assert term("a\\b") == "a\\\\b" and term("x\x1b[2J") == "x\\x1b[2J" and term("\u202egnp.exe") == "\\u202egnp.exe"
    assert term("l1\nl2\t") == "l1\\nl2\\t" and term("l1\nl2\x07", lines=True) == "l1\nl2\\x07"
    assert term("caf\u00e9 \u00a0 \U0001f600") == "caf\u00e9 \u00a0 \U0001f600"  # printable or not, only the list is escaped
    sent = {"name": "ok", "holders": [{"name": "p\x1b"}], "libvirt_hostdev": "<a>\n<b\x1b/>", "n": 3,
            "labels": {"k\x1b": ["v\n"]}}
    shown = reply("passthrough", sent, escape=True)
    assert shown == {"name": "ok", "holders": [{"name": "p\\x1b"}], "libvirt_hostdev": "<a>\n<b\\x1b/>", "n": 3,
                     "labels": {"k\\x1b": ["v\\n"]}}
    assert reply("passthrough", sent) == sent and reply("passthrough", sent).holders[0].name == "p\x1b"  # --json: exact
