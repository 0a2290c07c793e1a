"""The kernel's parsing of numbers written to sysfs attributes (lib/kstrtox.c), one home for every
simulated attribute that takes one (driver attributes, SR-IOV, vendor VFIO, mdev), and the errno a
refused write returns (an OSError with the attribute's path, as open()/write() raise it)."""

from __future__ import annotations

import errno
import os


def sysfs_error(code: int, path: str) -> OSError:
    return OSError(code, os.strerror(code), path)


def kstrtou(data: bytes, path: str, bits: int = 64) -> int:
    """kstrtou16/kstrtouint/kstrtoul(buf, 0): decimal or a base prefix, one trailing newline
    allowed, nothing else (EINVAL); a value that does not fit in `bits` is ERANGE."""
    text = data.decode("utf-8", "surrogateescape")
    text = text[:-1] if text.endswith("\n") else text
    try:
        if not text or text != text.strip():
            raise ValueError
        value = int(text, 0)
    except ValueError:
        raise sysfs_error(errno.EINVAL, path) from None
    if value < 0:
        raise sysfs_error(errno.EINVAL, path)
    if value >= 1 << bits:
        raise sysfs_error(errno.ERANGE, path)
    return value
