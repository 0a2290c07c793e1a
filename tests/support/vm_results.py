"""The test VM's results, read by every module that judges a phase of its one boot."""

from __future__ import annotations


def phase(guest, name):
    p = guest["phases"].get(name)
    assert p is not None, f"phase {name} did not run"
    assert "error" not in p, f"phase {name}: {p['error']}\n{p.get('trace', '')}"
    return p
