"""Who is inside gpud's NVML session right now, so that the session can be re-opened safely.

Why: real NVML enumerates GPUs once, at nvmlInit (docs/hardware/nvml-enumeration.md). When the
set of GPUs bound to nvidia changes (a rebind from vfio-pci, a hot-add, a driver reload) gpud must
shut NVML down and initialise it again to see the new GPU. Other worker threads may be in the
middle of an NVML read or a MIG step on another GPU at that moment; a call landing between the
nvmlShutdown and the nvmlInit would fail with UNINITIALIZED. `SessionUsers` counts the threads
inside a session use (re-entrant per thread) and lets one re-open run only once they have left,
holding new users back meanwhile.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

REOPEN_WAIT_S = 30.0  # a re-open gives up (the next read tries again) rather than wait longer


class SessionUsers:
    def __init__(self) -> None:
        self._count = 0
        self._reopening = False
        self._changed = threading.Condition()
        self._depth = threading.local()

    def _mine(self) -> int:
        return getattr(self._depth, "n", 0)

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """One public NVML operation (a read of the GPUs, one MIG step)."""
        depth = self._mine()
        with self._changed:
            if depth == 0:  # a nested use of this thread never waits for a re-open it would block
                self._changed.wait_for(lambda: not self._reopening)
            self._count += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            with self._changed:
                self._count -= 1
                self._changed.notify_all()

    def reopen(self, close_and_open: Callable[[], None], timeout: float = REOPEN_WAIT_S) -> bool:
        """Run `close_and_open` once no other thread uses the session. False when another re-open
        is already under way or the others did not leave in `timeout` (nothing was done)."""
        mine = self._mine()
        with self._changed:
            if self._reopening:
                return False
            self._reopening = True
            try:
                if not self._changed.wait_for(lambda: self._count <= mine, timeout=timeout):
                    return False
            finally:
                if self._count > mine:
                    self._reopening = False
                    self._changed.notify_all()
        try:
            close_and_open()
            return True
        finally:
            with self._changed:
                self._reopening = False
                self._changed.notify_all()
