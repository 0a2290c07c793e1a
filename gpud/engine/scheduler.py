"""When reconcile passes run: one task runs them one at a time; requests for a pass (a file edit,
a udev event, a holder exiting, a client) coalesce into the next one, and each request gets a
ticket its caller can wait on until a pass that started after the request has ended."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class PassScheduler:
    def __init__(self) -> None:
        self._kick = asyncio.Event()
        self._requested = 0
        self._completed = 0
        self._done = asyncio.Condition()
        self.running = False  # a pass is in progress
        self._need = 0.0  # the pass asked for must read the host as it was at or after this moment
        self.pass_since = 0.0  # that moment for the pass running now (time.monotonic())

    def kick(self, reason: str, *, seen_since: float | None = None) -> int:
        """Ask for a pass; returns the ticket a caller can wait on with `wait_for`. The pass reads
        the host afresh, begun after this request, or after `seen_since` when the caller has just
        had it read since that moment (an apply re-reads the file against the host first)."""
        self._requested += 1
        log.debug("pass requested: %s", reason)
        self._need = max(self._need, time.monotonic() if seen_since is None else seen_since)
        self._kick.set()
        return self._requested

    async def wait_for(self, ticket: int, timeout: float | None = None) -> bool:
        """True once the pass that serves `ticket` has ended; False after `timeout` seconds."""
        async def _wait() -> None:
            async with self._done:
                await self._done.wait_for(lambda: self._completed >= ticket)

        try:
            await asyncio.wait_for(_wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def run(self, run_pass: Callable[[], Awaitable[None]], debounce: float = 0.2) -> None:
        """Run `run_pass` whenever passes were asked for, forever; a request that arrives during a
        pass is served by the next. `run_pass` handles its own errors."""
        while True:
            await self._kick.wait()
            await asyncio.sleep(debounce)  # coalesce bursts (editor saves, udev storms)
            self._kick.clear()
            target = self._requested
            self.pass_since, self._need = self._need, 0.0
            self.running = True
            try:
                await run_pass()
            finally:
                self.running = False
            async with self._done:
                self._completed = max(self._completed, target)
                self._done.notify_all()
