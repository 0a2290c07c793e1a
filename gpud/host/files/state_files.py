"""gpud's own files in its state directory (gpu-index.json, boot.json, vgpu-record.json,
vgpu-names.json, reboot-request.json): read strictly, written safely, set aside when wrong.

Why: gpud acts on these files as root at start and after every pass. A FIFO at one of them would
block the read forever (start hangs, or the loop after start), a directory would fail every pass
with a traceback, and a file that is not in gpud's format could be taken for a real record (a
garbage reboot marker read as "a reboot happened"). So every state file is read through
`gpud.host.files.safe_file` (a regular file gpud owns, no link followed, at most `MAX_BYTES`), decoded
strictly by its owner, and anything else is renamed aside (`NAME.set-aside-XXXXXXXX`, kept for a
person to look at) and never acted on; `Problems` keeps what was said, for status and events.
Writes go through safe_file (an unpredictable temp name, fsync, rename; a full disk leaves the
old file and no temp file).
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable
from typing import TypeVar

from gpud.host.files import safe_file

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_BYTES = 1 << 20  # the largest state file (a vGPU record of 8 GPUs x 48 vGPUs) is under 64 KiB


class BadStateFile(ValueError):
    """A state file's bytes are not in gpud's format (raised by the decoders)."""


class Problems:
    """What went wrong with state files since start: logged, given to `on_problem` (an event),
    and kept (last per file) for status."""

    def __init__(self, on_problem: Callable[[str], object] | None = None) -> None:
        self.on_problem = on_problem
        self.by_file: dict[str, str] = {}

    def say(self, path: str, message: str) -> None:
        self.by_file[path] = message
        log.error("%s", message)
        if self.on_problem is not None:
            self.on_problem(message)

    def clear(self, path: str) -> None:
        self.by_file.pop(path, None)

    def list(self) -> list[str]:
        return [self.by_file[p] for p in sorted(self.by_file)]


def load(path: str, decode: Callable[[bytes], T], problems: Problems | None = None, *,
         limit: int = MAX_BYTES, what: str = "state file") -> T | None:
    """The decoded file, or None when there is none or it was set aside (then `problems` was told
    why). `decode` raises ValueError (BadStateFile, msgspec's errors are ValueErrors) for bytes
    not in the format."""
    try:
        data = safe_file.read_file(path, limit, owned=True)
    except FileNotFoundError:
        return None
    except safe_file.UnsafeFile as e:
        why = str(e)
    except OSError as e:
        why = f"{path}: {e.strerror}"
    else:
        try:
            return decode(data)
        except (ValueError, KeyError, TypeError) as e:
            why = f"{path}: not a {what} in gpud's format ({e})"
    try:
        aside = safe_file.set_aside(path)
        where = f"set aside as {os.path.basename(aside)}" if aside else "gone meanwhile"
    except OSError as e:
        where = f"could not be set aside ({e.strerror})"
    message = f"{why}; {where}, not used"
    if problems is not None:
        problems.say(path, message)
    else:
        log.error("%s", message)
    return None


def set_aside_before(path: str) -> list[str]:
    """Names of files set aside from `path` that are still there (an operator removes them)."""
    return sorted(os.path.basename(p) for p in glob.glob(glob.escape(path) + ".set-aside-*"))


def save(path: str, data: bytes, *, mode: int = 0o644) -> None:
    """Replace `path` durably (OSError: not written, the old file and no temp file left)."""
    safe_file.write_file(path, data, mode=mode, make_dir=True)


def remove(path: str) -> None:
    """Remove `path` (FileNotFoundError when absent); a link there is removed, not followed."""
    safe_file.remove_file(path)
