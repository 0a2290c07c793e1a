"""Replacements for os.write that the sysfs writer process can rebuild (child_spec), standing in
for a kernel that never finishes a reset or refuses every write with one errno."""

from __future__ import annotations

import errno
import os
import time


class NeverFinishingReset:
    """A kernel whose reset never returns (the write blocks on the device lock); anything else is
    EINVAL."""

    def __init__(self, arg: str = "") -> None:
        pass

    def __call__(self, path: str, data: bytes) -> int:
        if path.endswith("/reset"):
            time.sleep(3600)
        raise OSError(errno.EINVAL, "Invalid argument", path)

    def child_spec(self) -> tuple[str, str]:
        return f"{__name__}:NeverFinishingReset", ""


class RefusingKernel:
    """Every write fails with errno `code` (given by name, e.g. "ENOTTY")."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __call__(self, path: str, data: bytes) -> int:
        err = getattr(errno, self.code)
        raise OSError(err, os.strerror(err), path)

    def child_spec(self) -> tuple[str, str]:
        return f"{__name__}:RefusingKernel", self.code
