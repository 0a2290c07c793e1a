"""The daemon's one current observation of the host, and when it is read again.

Reading the host (sysfs + every NVML query of every GPU) takes milliseconds per GPU on real
hardware and far longer on a loaded machine; done on the event loop for every `status` request it
made each request block every other client and the loop itself. So the engine keeps one
observation and re-reads the host only:

- when something changes it: the engine's own steps and passes (which re-read after each step),
  device events and holder exits (they start a pass), a layout change, NVML re-opened after a
  rebind (the pass's re-read after the bind step);
- at a bounded rate while clients ask (`poke`): holders start and stop without any event, so an
  answer is never older than `max_age` plus one read while someone is looking;
- when a client asks for a fresh one (`fresh`, `gpudctl status --fresh`).

Every re-read runs in a worker thread, one at a time; callers that want an observation newer than
some moment share the read that started after it. `install` (the reconciler's) takes each result
on the event loop, so the engine's state only ever changes on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gpud.engine.observe import Observation

log = logging.getLogger(__name__)

DEFAULT_MAX_AGE = 1.0  # seconds: how stale an answer may get while clients keep asking


class Observer:
    """`read()` reads the host (blocking, thread-safe); `install(obs)` takes a result on the loop.
    `busy()` says when a background re-read must not start (hardware steps in flight re-read
    by themselves when they finish)."""

    def __init__(self, read: Callable[[], Observation], install: Callable[[Observation], None], *,
                 max_age: float = DEFAULT_MAX_AGE, busy: Callable[[], bool] = lambda: False) -> None:
        self._read = read
        self._install = install
        self.max_age = max_age
        self._busy = busy
        self._lock = asyncio.Lock()
        self._running: asyncio.Future[Observation] | None = None
        self._running_since = 0.0
        self._background: asyncio.Task | None = None
        self.started = 0.0  # time.monotonic() when the observation in force began to be read
        self.wall_time = 0.0  # time.time() of the same moment, for clients
        self.reads = 0  # observations taken since start
        self._current = Observation(gpus=(), functions=())

    # ---- what the status answer says --------------------------------------------------------------
    def age(self) -> float:
        """Seconds since the observation in force began to be read (0 before the first)."""
        return time.monotonic() - self.started if self.started else 0.0

    # ---- reading --------------------------------------------------------------------------------
    def read_now(self) -> Observation:
        """Read on the calling thread and install: for the start-up read, before there is anything
        to serve, and for callers that are not on the loop's critical path."""
        started, wall = time.monotonic(), time.time()
        obs = self._read()
        self._take(obs, started, wall)
        return obs

    async def refresh(self) -> Observation:
        """A read that starts now (or joins one already started now), off the loop."""
        return await self.fresh(time.monotonic())

    async def fresh(self, since: float) -> Observation:
        """An observation whose read began at or after `since` (time.monotonic())."""
        running = self._running
        if running is not None and self._running_since >= since:
            return await asyncio.shield(running)
        if self.started >= since:
            return self._current
        async with self._lock:  # reads start only under the lock: none is running now
            if self.started >= since:  # someone else's read, begun after `since`, finished meanwhile
                return self._current
            return await self._read_in_worker()

    async def _read_in_worker(self) -> Observation:
        """Under self._lock: one read in a worker thread."""
        loop = asyncio.get_running_loop()
        started, wall = time.monotonic(), time.time()
        future: asyncio.Future[Observation] = loop.create_future()
        self._running, self._running_since = future, started
        try:
            obs = await asyncio.to_thread(self._read)
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: the waiters that share it get it raised
            raise
        finally:
            self._running = None
        self._take(obs, started, wall)
        future.set_result(obs)
        return obs

    def _take(self, obs: Observation, started: float, wall: float) -> None:
        if started < self.started:  # a read that began before the one in force: older news
            return
        self.started, self.wall_time = started, wall
        self.reads += 1
        self._current = obs
        self._install(obs)

    # ---- the bounded background re-read ------------------------------------------------------
    def poke(self) -> None:
        """A client looked: re-read in the background if the observation is older than `max_age`
        and nothing else is reading or changing the hardware. Never waits."""
        if self._running is not None or self._lock.locked() or self._busy():
            return
        if self._background is not None and not self._background.done():
            return
        if self.started and time.monotonic() - self.started < self.max_age:
            return
        self._background = asyncio.get_running_loop().create_task(self._background_read(), name="observer")

    async def _background_read(self) -> None:
        try:
            await self.refresh()
        except Exception:  # the next poke tries again; the pass reports hardware errors itself
            log.exception("background re-read of the host failed")
