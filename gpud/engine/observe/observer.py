"""The daemon's one current observation of the host, and when it is read again.

Reading the host (sysfs + every NVML query of every GPU) takes milliseconds per GPU on real
hardware and far longer on a loaded machine; done on the event loop for every `status` request it
made each request block every other client and the loop itself. So the engine keeps one
observation and re-reads the host only:

- when something changes it: the engine's own steps and passes (which re-read after each step),
  device events and holder exits (they start a pass), a layout change, NVML re-opened after a
  rebind (the pass's re-read after the bind step);
- at a bounded rate while clients ask (`poke`): holders start and stop without any event, so an
  answer is never older than `max_age` plus one read while someone is looking, but while a pass's
  GPUs are in their rounds (`busy`: the pass re-reads each GPU it changes, and the whole host at
  its end);
- when a client asks for a fresh one (`fresh`, `gpudctl status --fresh`);
- one GPU alone after the engine changed its MIG layout (`refresh_gpu`): the others did not change.

Every re-read runs in a worker thread, one at a time, as a task of its own; callers that want an
observation newer than some moment share the read that started after it. `install` (the reconciler's) takes each result
on the event loop, so the engine's state only ever changes on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec

from gpud.engine.observe.discovery import Observation, keep_unchanged, same_if_equal
from gpud.model import Gpu

log = logging.getLogger(__name__)

DEFAULT_MAX_AGE = 1.0  # seconds: how stale an answer may get while clients keep asking


class Observer:
    """`read()` reads the host (blocking, thread-safe); `install(obs)` takes a result on the loop.
    `prepare(obs)` works out, in the reading thread, what the loop will want of a read once its
    unchanged parts are the objects in force (what is kept by identity is then found kept).
    `busy()` says when a background re-read must not start (hardware steps in flight re-read
    by themselves when they finish)."""

    def __init__(self, read: Callable[[], Observation], install: Callable[[Observation], None], *,
                 max_age: float = DEFAULT_MAX_AGE, busy: Callable[[], bool] = lambda: False,
                 prepare: Callable[[Observation], None] = lambda obs: None) -> None:
        self._read = read
        self._prepare = prepare
        self._install = install
        self.max_age = max_age
        self._busy = busy
        self._running: asyncio.Task[Observation] | None = None  # the read in flight, one at a time
        self._running_since = 0.0
        self._background: asyncio.Task | None = None
        self.started = 0.0  # time.monotonic() when the observation in force began to be read
        self.wall_time = 0.0  # time.time() of the same moment, for clients
        self.reads = 0  # observations taken since start
        self._current = Observation(gpus=(), functions=())
        self._gpu_read: dict[str, float] = {}  # PCI -> start of a one-GPU read newer than self.started

    # ---- what the status answer says --------------------------------------------------------------
    def age(self) -> float:
        """Seconds since the observation in force began to be read (0 before the first)."""
        return time.monotonic() - self.started if self.started else 0.0

    # ---- reading --------------------------------------------------------------------------------
    def read_now(self) -> Observation:
        """Read on the calling thread and install: for the start-up read, before there is anything
        to serve, and for callers that are not on the loop's critical path."""
        started, wall = time.monotonic(), time.time()
        obs = self._read_kept()
        self._take(obs, started, wall)
        return obs

    async def refresh(self) -> Observation:
        """A read that starts now (or joins one already started now), off the loop."""
        return await self.fresh(time.monotonic())

    async def fresh(self, since: float) -> Observation:
        """An observation whose read began at or after `since` (time.monotonic()).

        The read is a task of its own, awaited through a shield: a caller that goes away (a client
        closing its connection) never cancels a read that a pass or other clients share."""
        while True:
            running = self._running
            if running is None:
                if self.started >= since:  # a read begun after `since` has finished
                    return self._current
                return await asyncio.shield(self._start_read())
            if self._running_since >= since:
                return await asyncio.shield(running)
            with contextlib.suppress(Exception):  # an older read: its failure is its starter's to report
                await asyncio.shield(running)

    def _start_read(self) -> asyncio.Task[Observation]:
        started, wall = time.monotonic(), time.time()
        task = asyncio.get_running_loop().create_task(self._read_and_take(started, wall), name="observe")
        task.add_done_callback(_retrieve)
        self._running, self._running_since = task, started
        return task

    async def _read_and_take(self, started: float, wall: float) -> Observation:
        try:
            obs = await asyncio.to_thread(self._read_kept)
            self._take(obs, started, wall)
            return obs
        finally:
            self._running = None  # at once, not in a later callback: fresh() reads it

    def _read_kept(self) -> Observation:
        """A read, what did not change kept as the objects in force (discovery.keep_unchanged),
        then prepared, in the worker thread."""
        obs = keep_unchanged(self._read(), self._current)
        self._prepare(obs)
        return obs

    def _take(self, obs: Observation, started: float, wall: float) -> None:
        if started < self.started:  # a read that began before the one in force: older news
            return
        newer = {pci for pci, t in self._gpu_read.items() if t > started}
        if newer:  # a GPU read alone since this read began is newer news for that GPU
            mine = {g.pci: g for g in self._current.gpus if g.pci in newer}
            obs = msgspec.structs.replace(obs, gpus=tuple(mine.get(g.pci, g) for g in obs.gpus))
        self._gpu_read = {pci: t for pci, t in self._gpu_read.items() if pci in newer}
        self.started, self.wall_time = started, wall
        self.reads += 1
        self._current = obs
        self._install(obs)

    async def refresh_gpu(self, pci: str, read_gpu: Callable[[Gpu], Gpu | None]) -> Observation:
        """The observation with GPU `pci` read again alone (`read_gpu`, off the loop), the others as
        they were: after the engine changed that GPU's MIG layout. Where the one-GPU read cannot
        answer (NVML closed or the GPU not in it) the whole host is read."""
        gpu = next((g for g in self._current.gpus if g.pci == pci), None)
        if gpu is None:
            return await self.refresh()
        started = time.monotonic()
        base = self._current
        fresh, ahead = await asyncio.to_thread(self._read_one, base, gpu, read_gpu)
        if fresh is None:
            return await self.refresh()
        # Another read taken meanwhile (the pass steps several GPUs at once, each read again in its
        # own thread) makes what was prepared stale: it is prepared again off the loop on the
        # observation now in force, rather than the layout resolved on the loop (milliseconds at
        # 64 GPUs). Each time round is another read's doing, and a pass's reads are finite.
        while self._current is not base and self._newest(pci, started):
            base = self._current
            ahead = await asyncio.to_thread(self._prepared, _with(base, fresh))
        if self._newest(pci, started):
            self._gpu_read[pci] = started
            self._current = ahead
            self._install(ahead)
        return self._current

    def _newest(self, pci: str, started: float) -> bool:
        """A read of `pci` begun at `started` is newer than what is in force for it."""
        return started > self._gpu_read.get(pci, 0.0) and started > self.started

    def _prepared(self, obs: Observation) -> Observation:
        self._prepare(obs)
        return obs

    def _read_one(self, base: Observation, gpu: Gpu, read_gpu: Callable[[Gpu], Gpu | None],
                  ) -> tuple[Gpu | None, Observation]:
        """In the worker thread: GPU `gpu` read again (kept as it was when equal), and `base` with
        it, prepared as a whole read is (`prepare`: what the loop will want of it, worked out here)."""
        fresh = _kept(read_gpu(gpu), gpu)
        if fresh is None:
            return None, base
        return fresh, self._prepared(_with(base, fresh))

    # ---- the bounded background re-read ------------------------------------------------------
    def poke(self) -> None:
        """A client looked: re-read in the background if the observation is older than `max_age`
        and nothing else is reading or changing the hardware. Never waits. The read starts here,
        not in a later callback: whoever asks for a read begun after this moment joins it."""
        if self._running is not None or self._busy():
            return
        if self._background is not None and not self._background.done():
            return
        if self.started and time.monotonic() - self.started < self.max_age:
            return
        self._background = asyncio.get_running_loop().create_task(self._background_read(self._start_read()),
                                                                  name="observer")

    @staticmethod
    async def _background_read(read: asyncio.Task[Observation]) -> None:
        try:
            await read
        except Exception:  # the next poke tries again; the pass reports hardware errors itself
            log.exception("background re-read of the host failed")


def _with(obs: Observation, gpu: Gpu) -> Observation:
    """`obs` with the GPU of `gpu`'s address replaced by it."""
    return msgspec.structs.replace(obs, gpus=tuple(gpu if g.pci == gpu.pci else g for g in obs.gpus))


def _kept(fresh: Gpu | None, gpu: Gpu) -> Gpu | None:
    return same_if_equal(fresh, gpu) if fresh is not None else None


def _retrieve(task: asyncio.Task) -> None:
    """A read's failure is raised in whoever awaits it; this keeps asyncio from also logging it
    as never retrieved when nobody is left waiting."""
    if not task.cancelled():
        task.exception()
