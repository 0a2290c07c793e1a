"""The API socket as a file: created safely at its path, and removed only while it is still ours.

The socket is a privilege boundary (gpud/api/server.py), so its file is never more open than
intended: bind() runs under a umask that makes it 0600, and only then is it given to the `gpud`
group (0660). A socket left by a dead daemon is replaced; one a live process listens on, or a path
that is not a socket, makes the server refuse to start. On close the file is unlinked only if it is
still the one this server bound (same device and inode): a newer daemon's socket at the same path
is left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat

log = logging.getLogger("gpud.api")


class ServerError(RuntimeError):
    """The server cannot start (socket path taken by a live server, not a socket, ...)."""


def _clear_stale(path: str) -> None:
    """Unlink a socket left by a dead daemon; refuse if someone still listens on it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ServerError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        log.info("removing stale socket %s", path)
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ServerError(f"cannot tell whether {path} is in use: {e}") from e
    else:
        raise ServerError(f"{path} is in use by a running process (another gpud?); refusing to start")
    finally:
        probe.close()


def bind_socket(path: str, gpud_gid: int | None) -> tuple[socket.socket, tuple[int, int]]:
    """Listening socket at `path`: 0660 root:gpud when the group exists, else 0600; and the
    (device, inode) of the file it made, which `unlink_own` compares before removing it.

    The umask makes bind() create it 0600, so there is no moment where it is more open than
    intended; group and mode are widened only afterwards.
    """
    _clear_stale(path)
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        mode = 0o600
        if gpud_gid is not None:
            try:
                os.chown(path, -1, gpud_gid)
                mode = 0o660
            except PermissionError as e:
                log.warning("cannot give %s to gid %d (%s); socket stays 0600", path, gpud_gid, e)
        os.chmod(path, mode)
        sock.listen(128)
        sock.setblocking(False)
        st = os.stat(path)
    except BaseException:
        sock.close()
        raise
    return sock, (st.st_dev, st.st_ino)


def unlink_own(path: str, identity: tuple[int, int]) -> None:
    """Remove the socket file at `path` if it is still the one `bind_socket` made (`identity`)."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == identity:
            os.unlink(path)
