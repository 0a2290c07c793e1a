"""What gpud uses of Python 3.11 where it runs on 3.10 (Ubuntu 22.04's python3): `asyncio.timeout`
comes from async-timeout there, the package it was taken into the standard library from (a
dependency on Python < 3.11 only), and exception notes are added where the interpreter has them."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pragma: no cover - exercised by the 3.10 check (README: Package)
    import asyncio
    import asyncio.exceptions

    from async_timeout import timeout

    # 3.11 made asyncio.TimeoutError the builtin TimeoutError, and gpud catches the builtin. asyncio
    # (wait_for) and async-timeout look the name up when they raise, so on 3.10 they raise the
    # builtin too once both names are it: the 3.11 behaviour, for the whole process.
    asyncio.TimeoutError = asyncio.exceptions.TimeoutError = TimeoutError  # type: ignore[misc]

__all__ = ["add_note", "timeout"]


def add_note(exc: BaseException, note: str) -> None:
    """`exc.add_note(note)` (3.11); on 3.10 the note goes into the exception's args instead."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover
        exc.args = (*exc.args, note)
