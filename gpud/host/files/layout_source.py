"""Reading the layout file without trusting what sits at its path.

The daemon reads `/etc/gpud/layout.yaml` as root, so whatever is at that path is read with root's
rights: a FIFO would block the read until someone writes to it, `/dev/zero` would never end, a
50 MB file would take minutes to parse on the event loop, and a link to a secret file would put
its lines into status errors that every member of group `gpud` can read. So:

- only a regular file is read: the path is stat'ed (following links, as configuration management
  often links the file) and anything else is refused *before* it is opened, so no device is ever
  opened; the open itself is O_NONBLOCK and the descriptor is checked again (fstat), in case the
  path changed in between;
- its size is checked before reading and the read stops one byte past the limit, so a file that
  grows while it is read is refused too;
- the text may be quoted in errors only when the file is owned by the daemon's user (root) and the
  path does not lead through a link into another directory tree (`quotable`); otherwise errors
  name lines but no text.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from gpud.host.files.safe_file import kind, read_up_to

# A layout is a few KB; a 12,000-entry stress file is under 500 KB. Above this the file is refused.
# Half the socket's frame limit, so a `check` of any acceptable text fits in one request frame
# (gpud.wire.protocol.MAX_LAYOUT_TEXT is the same number; a test keeps them equal).
MAX_LAYOUT_BYTES = 512 * 1024


class LayoutUnreadable(Exception):
    """The layout cannot be read (missing, not a regular file, too large, not UTF-8, an OS error):
    `message` says which, naming the path."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.missing = missing


@dataclass(frozen=True)
class LayoutSource:
    text: str
    quotable: bool  # may its text appear in errors that non-root readers of status see?
    unquoted_because: str = ""  # why not, when not
    hooks_refused: str = ""  # why the file's hooks may not run as gpud's user (root), when they may not


def _writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def hooks_refused(path: str, st: os.stat_result, uid: int | None = None) -> str:
    """Why hooks named in the file at `path` (whose opened descriptor's stat is `st`) may not run
    as `uid` (gpud's user, root), or "" when they may: the file and every directory above it, as
    written and as links resolve, are owned by that user and writable by no group or other user.
    A sticky directory (`/tmp`) may be writable by others: none of them can rename or remove an
    entry gpud's user owns there (sticky(7)'s rule, as gpud.host.files.safe_file also takes it)."""
    uid = os.geteuid() if uid is None else uid
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by gpud's user (uid {uid})"
    if _writable_by_others(st):
        return f"{path} is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):04o})"
    seen: set[str] = set()
    for start in (os.path.dirname(os.path.abspath(path)), os.path.dirname(os.path.realpath(path))):
        d = start
        while d not in seen:
            seen.add(d)
            try:
                dst = os.lstat(d)
            except OSError as e:
                return f"{d}: {e.strerror}"
            if stat.S_ISLNK(dst.st_mode):  # a link in the path: what it names is checked too
                target = os.path.realpath(d)
                try:
                    dst = os.stat(target)
                except OSError as e:
                    return f"{d}: {e.strerror}"
            if dst.st_uid != uid:
                return f"directory {d} (above {path}) is owned by uid {dst.st_uid}, not by gpud's user (uid {uid})"
            if _writable_by_others(dst) and not dst.st_mode & stat.S_ISVTX:
                return (f"directory {d} (above {path}) is writable by its group or by others "
                        f"(mode {stat.S_IMODE(dst.st_mode):04o})")
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
    return ""


def size_error(where: str, size: int, limit: int = MAX_LAYOUT_BYTES) -> str:
    return (f"{where}: the layout is {size} bytes; a layout may be at most {limit} bytes "
            f"({limit // 1024} KiB)")


def check_text_size(text: str, where: str, limit: int = MAX_LAYOUT_BYTES) -> str | None:
    """The error for a layout text (e.g. sent with `check`) over the limit, else None."""
    size = len(text.encode("utf-8", "surrogatepass"))
    return size_error(where, size, limit) if size > limit else None


def _quotable(path: str, st: os.stat_result) -> tuple[bool, str]:
    if st.st_uid != os.geteuid():
        return False, f"{path} is owned by uid {st.st_uid}, not by gpud's user"
    real = os.path.realpath(path)
    home = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    if os.path.commonpath([real, home]) != home:
        return False, f"{path} is a link into another directory tree"
    return True, ""


def read_layout(path: str, limit: int = MAX_LAYOUT_BYTES) -> LayoutSource:
    """The layout's text, or LayoutUnreadable; never blocks on a special file, never reads more
    than `limit` + 1 bytes."""
    try:
        before = os.stat(path)
    except FileNotFoundError:
        raise LayoutUnreadable(f"{path}: file not found", missing=True) from None
    except OSError as e:
        raise LayoutUnreadable(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(before.st_mode):
        raise LayoutUnreadable(f"{path}: {kind(before.st_mode)}, not a regular file; the layout must be a regular file")
    if before.st_size > limit:
        raise LayoutUnreadable(size_error(path, before.st_size, limit))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise LayoutUnreadable(f"{path}: {e.strerror}", missing=isinstance(e, FileNotFoundError)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the stat and the open
            raise LayoutUnreadable(f"{path}: {kind(st.st_mode)}, not a regular file; the layout must be a regular file")
        data = read_up_to(fd, limit)
        if len(data) > limit:  # it grew while being read
            raise LayoutUnreadable(size_error(path, max(len(data), os.fstat(fd).st_size), limit))
    except OSError as e:
        raise LayoutUnreadable(f"{path}: {e.strerror}") from None
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LayoutUnreadable(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    quotable, why = _quotable(path, st)
    return LayoutSource(text=text, quotable=quotable, unquoted_because=why, hooks_refused=hooks_refused(path, st))
