"""Files gpud writes or reads as root in directories it may not own alone: the one home for it.

gpud writes the metrics textfile (a node exporter directory that often belongs to the exporter's
user), NFD's feature file, and its state files; it reads them back. As root, a plain
`open(path, "wb")` follows a symlink a user planted at the path (or at a predictable temp name)
and overwrites any file; a plain `open(path, "rb")` blocks forever on a FIFO and reads a link to
a root-only file. So, here:

* Writing: the directory is opened once and everything after is relative to that descriptor
  (a directory renamed or swapped for a link after the check changes nothing). The bytes go to a
  temp name no one can predict (random, a dotfile: NFD and node exporter skip it), created with
  O_CREAT|O_EXCL|O_NOFOLLOW (a link or any file already there makes the create fail, never
  followed), written whole, fsynced, renamed over the target with both directory descriptors,
  and the directory is fsynced. Any failure removes the temp file.
* The directory must be writable by gpud's user only. One that another user or a group can write
  is refused with the reason (`UnsafeDirectory`), unless it is sticky (chmod +t: others can then
  neither remove nor rename gpud's files) and the file at the target name, if any, is gpud's.
* Reading: O_RDONLY|O_NONBLOCK|O_NOFOLLOW relative to the directory (a FIFO opens at once and
  is refused by fstat, a link is refused unfollowed), regular files only, at most `limit` bytes
  (one more byte read means too large). `owned=True` also requires the file to be gpud's: owned
  by its user with one link (a hard link a user made to a root-only file is not gpud's file).
  These calls do blocking I/O on regular files only; callers on the event loop run them in a
  worker thread.

The kernel behaviours this relies on, with sources: docs/files-as-root.md.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY


class UnsafeDirectory(PermissionError):
    """gpud refuses to write into this directory; the message says why and what would fix it."""

    def __str__(self) -> str:
        return str(self.strerror)


class UnsafeFile(OSError):
    """What sits at the path is not a file gpud may read as its own (a link, a FIFO, a device, a
    directory, too large, someone else's); the message says which, naming the path."""

    def __str__(self) -> str:
        return str(self.strerror)


def kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def temp_name(name: str) -> str:
    """A dotfile name beside `name` that no other user can guess (128 random bits from the kernel's
    CSPRNG: what secrets.token_hex does, without secrets' import of hmac and hashlib, which map
    OpenSSL's libcrypto into the daemon: docs/internals.md, "What the daemon loads when")."""
    return f".{name}.gpud-{os.urandom(16).hex()}"


def _split(path: str) -> tuple[str, str]:
    directory, name = os.path.split(path)
    if not name or name in (".", ".."):
        raise IsADirectoryError(errno.EISDIR, "a file name is needed", path)
    return directory or ".", name


def directory_problem(st: os.stat_result, directory: str, name: str, existing: os.stat_result | None) -> str | None:
    """Why gpud must not write `name` into this directory (None: it may). Pure: `st` is the
    directory's fstat, `existing` the lstat of what is at `name` now (None: nothing)."""
    me = os.geteuid()
    others: list[str] = []
    if st.st_uid != me and st.st_mode & stat.S_IWUSR:
        others.append(f"its owner (uid {st.st_uid})")
    if st.st_mode & stat.S_IWGRP:
        others.append(f"group {st.st_gid}")
    if st.st_mode & stat.S_IWOTH:
        others.append("every user")
    if not others:
        return None
    who = " and ".join(others)
    if not st.st_mode & stat.S_ISVTX:
        return (f"{directory} is writable by {who} and not sticky: another user could replace or aim "
                f"{name}; gpud does not write there (make the directory writable by gpud's user only, "
                f"or sticky with chmod +t)")
    if existing is not None and existing.st_uid != me:
        return (f"{directory} is writable by {who}; {name} there belongs to uid {existing.st_uid}, not to "
                f"gpud's user, so gpud does not replace it (remove it)")
    return None


def _open_dir(directory: str) -> int:
    return os.open(directory, _DIR_FLAGS)


def _lstat_at(dfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked: a short write renamed in would be taken for a whole file."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, f"write wrote {n} bytes")
        view = view[n:]


def write_file(path: str, data: bytes, *, mode: int = 0o644, make_dir: bool = False,
               _name: Callable[[str], str] = temp_name) -> None:
    """Replace `path` with `data` durably and without following anything a user planted.
    Raises UnsafeDirectory (refused, nothing written) or OSError (ENOSPC and the like: the old
    file is unchanged and no temp file is left)."""
    directory, name = _split(path)
    if make_dir:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    dfd = _open_dir(directory)
    try:
        problem = directory_problem(os.fstat(dfd), directory, name, _lstat_at(dfd, name))
        if problem:
            raise UnsafeDirectory(errno.EPERM, problem)
        tmp = _name(name)
        fd = os.open(tmp, _CREATE_FLAGS, mode, dir_fd=dfd)
        try:
            try:
                write_all(fd, data)
                os.fchmod(fd, mode)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)
    finally:
        os.close(dfd)


def remove_file(path: str) -> None:
    """Unlink `path` (never what a link there points at) durably; FileNotFoundError when absent."""
    directory, name = _split(path)
    dfd = _open_dir(directory)
    try:
        os.unlink(name, dir_fd=dfd)
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_up_to(fd: int, limit: int) -> bytes:
    """At most `limit` + 1 bytes of an open file: more than `limit` means it is (or grew) too large,
    and nothing beyond is read, whatever the file's size says."""
    chunks: list[bytes] = []
    got = 0
    while got <= limit:
        chunk = os.read(fd, min(65536, limit + 1 - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_file(path: str, limit: int, *, owned: bool = False) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them. FileNotFoundError when
    nothing is there; UnsafeFile for anything else but a regular file (or one too large, or with
    `owned`, one that is not gpud's); never blocks on a special file, never follows a link."""
    directory, name = _split(path)
    dfd = _open_dir(directory)
    try:
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafeFile(errno.ELOOP, f"{path}: a symbolic link; gpud does not follow links there") from None
            if e.errno in (errno.ENXIO, errno.EOPNOTSUPP, errno.EISDIR):  # a socket, a directory opened for read
                st = _lstat_at(dfd, name)
                what = kind(st.st_mode) if st is not None else e.strerror
                raise UnsafeFile(e.errno, f"{path}: {what}, not a regular file") from None
            raise
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(errno.EINVAL, f"{path}: {kind(st.st_mode)}, not a regular file")
        if owned and (st.st_uid != os.geteuid() or st.st_nlink != 1):
            why = f"owned by uid {st.st_uid}" if st.st_uid != os.geteuid() else f"{st.st_nlink} hard links"
            raise UnsafeFile(errno.EPERM, f"{path}: not a file gpud wrote ({why})")
        if st.st_size > limit:
            raise UnsafeFile(errno.EFBIG, f"{path}: {st.st_size} bytes, more than the {limit} allowed")
        data = read_up_to(fd, limit)
        if len(data) > limit:
            raise UnsafeFile(errno.EFBIG, f"{path}: more than the {limit} bytes allowed")
        return data
    finally:
        os.close(fd)


def set_aside(path: str) -> str | None:
    """Rename what is at `path` (of any kind; a link is renamed, not followed) to a name that
    says it was set aside, so it is never read again and a person can look at it. Returns the
    new path, or None when nothing was there."""
    directory, name = _split(path)
    dfd = _open_dir(directory)
    try:
        aside = f"{name}.set-aside-{os.urandom(4).hex()}"
        try:
            os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
        except FileNotFoundError:
            return None
        os.fsync(dfd)
        return os.path.join(directory, aside)
    finally:
        os.close(dfd)
