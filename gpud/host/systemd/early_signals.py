"""SIGHUP before the event loop is ready for it.

SIGHUP's default action ends the process, and the daemon's start-up (imports, the NVML library,
reading the layout, the state files, the socket) takes a second or more before its event loop
installs the reload handler. A `systemctl reload` or a config tool's `kill -HUP` in that window
would kill gpud (rc 129). So the entry point notes SIGHUP first thing, before any slow work, and
the daemon runs one reload for it once it serves: the file is then re-read, which is what the
sender asked for.
"""

from __future__ import annotations

import signal

_pending = False


def _note(signum: int, frame: object) -> None:
    global _pending
    _pending = True


def hold_sighup() -> None:
    """Note SIGHUP from now on instead of dying of it (idempotent)."""
    if signal.getsignal(signal.SIGHUP) is not _note:
        signal.signal(signal.SIGHUP, _note)


def take_sighup() -> bool:
    """Whether a SIGHUP came while held; clears the note."""
    global _pending
    pending, _pending = _pending, False
    return pending
