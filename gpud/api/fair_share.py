"""Heavy read ops (`check`, `plan` of a sent text, `check --all-layouts`) served fairly per user.

Why: evaluating a layout text is seconds of CPU for a large file, and the gpud group may send
them. Without a share, one member looping `check --all-layouts` on a 500 KB layout fills the
queue and everyone else (root's reload included) waits behind it. So each evaluation takes a turn
from `FairShare`: at most `slots` evaluations run at once, at most one of them per uid, and the
waiting uids are served in turn (round robin), whatever number of requests each has queued.
Root's control ops (reload, apply) never take a turn: the daemon's own file is loaded apart from
these texts (gpud.engine.layout_keeper). `cost_error` bounds what one request may ask for.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator

# One request may parse at most this many bytes in all (text size x layouts evaluated): a
# 500 KiB file of 16 layouts, or any number of small ones.
MAX_REQUEST_COST = 8 * 1024 * 1024
SERVED_KEPT = 256


def cost_error(text_bytes: int, evaluations: int, limit: int = MAX_REQUEST_COST) -> str | None:
    """Why a request asking for `evaluations` parses of a `text_bytes` text is refused, or None."""
    cost = text_bytes * max(1, evaluations)
    if cost <= limit:
        return None
    return (f"checking {evaluations} layouts of a {text_bytes // 1024} KiB file would parse "
            f"{cost // (1024 * 1024)} MiB; one request may parse at most {limit // (1024 * 1024)} MiB "
            f"(check fewer layouts at once, or a smaller file)")


class FairShare:
    def __init__(self, slots: int = 2) -> None:
        self.slots = max(1, slots)
        self.running: dict[int, int] = {}  # uid -> evaluations running (0 or 1)
        self._waiting: OrderedDict[int, deque[asyncio.Future]] = OrderedDict()  # uid order = turn order
        # uids in the order their last turns began (observable by tests); bounded: one entry per
        # check kept forever grew about 1 MB an hour for one member looping checks
        self.served: deque[int] = deque(maxlen=SERVED_KEPT)

    def _busy(self) -> int:
        return sum(self.running.values())

    def _grant(self) -> None:
        """Start the next waiting uids' turns while slots are free: the first uid in turn order
        that has nothing running; it then goes to the back of the order."""
        while self._busy() < self.slots:
            uid = next((u for u in self._waiting if not self.running.get(u)), None)
            if uid is None:
                return
            queue = self._waiting.pop(uid)
            fut = queue.popleft()
            while fut.done() and queue:  # a waiter that gave up
                fut = queue.popleft()
            if queue:
                self._waiting[uid] = queue  # back of the order
            if fut.done():
                continue
            self.running[uid] = self.running.get(uid, 0) + 1
            self.served.append(uid)
            fut.set_result(None)

    @contextlib.asynccontextmanager
    async def turn(self, uid: int) -> AsyncIterator[None]:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(uid, deque()).append(fut)
        self._grant()
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():  # granted just as it was cancelled: give it back
                self._release(uid)
            else:
                fut.cancel()
            raise
        try:
            yield
        finally:
            self._release(uid)

    def _release(self, uid: int) -> None:
        self.running[uid] -= 1
        if not self.running[uid]:
            del self.running[uid]
        self._grant()
