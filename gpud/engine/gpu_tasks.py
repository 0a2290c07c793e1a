"""Independent GPUs proceed independently: the per-GPU work of a pass runs side by side, bounded.

Why: converging GPUs one after another would let one GPU's slow step (an unbind the kernel takes
30 s to give up on, a reset, a wait for a driver) delay every GPU after it, so up to
`PARALLEL_GPUS` GPUs run at once. Two things GPUs do share, and this module
holds what keeps them consistent:

- **gpud's NVML session** (`NvmlSessionGate`): nvmlInit opens every GPU, so while a GPU is being
  unbound from nvidia gpud must have NVML closed, or its own handle is what the unbind waits for.
  MIG steps need NVML open. So NVML work ("open") and unbinds from nvidia ("closed") exclude each
  other, while any number of either kind run together: two rebinds proceed side by side, and MIG
  work on another GPU waits only until the unbinds in flight end (each bounded by the unbind
  timeout).
- **drained units** (`SharedDrain`): `policy.drain-units` are stopped when the first GPU's
  disruptive step starts and started again when the last one ends, never while another GPU's
  step still needs them stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Literal

from gpud.engine.ports import UnitStopper

PARALLEL_GPUS = 4  # GPUs converging at once in one pass

SessionUse = Literal["open", "closed"]


async def for_each_gpu(pcis: Sequence[str], work: Callable[[str], Awaitable[None]],
                       limit: int = PARALLEL_GPUS) -> None:
    """`work(pci)` for every GPU, at most `limit` at a time, started in the order given. Each
    GPU's work keeps its own safety net (the caller's); an exception here still lets the others
    finish before it is raised."""
    slots = asyncio.Semaphore(max(1, limit))

    async def one(pci: str) -> None:
        async with slots:
            await work(pci)

    results = await asyncio.gather(*(one(p) for p in pcis), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


class NvmlSessionGate:
    """Holders of one use ("open": NVML work; "closed": unbinds from nvidia) run together; the
    other use waits until they are all done."""

    def __init__(self) -> None:
        self._use: SessionUse | None = None
        self._holders = 0
        self._changed = asyncio.Condition()

    @property
    def use(self) -> SessionUse | None:
        return self._use

    @contextlib.asynccontextmanager
    async def hold(self, use: SessionUse) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: self._holders == 0 or self._use == use)
            self._use = use
            self._holders += 1
        try:
            yield
        finally:
            async with self._changed:
                self._holders -= 1
                if self._holders == 0:
                    self._use = None
                self._changed.notify_all()


class SharedDrain:
    """One drain for every GPU whose disruptive step runs at the same time."""

    def __init__(self) -> None:
        self._users = 0
        self._stack: contextlib.AsyncExitStack | None = None
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def drained(self, drainer: UnitStopper, units: list[str]) -> AsyncIterator[None]:
        async with self._lock:
            if self._users == 0:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(drainer.drained(units))
                self._stack = stack
            self._users += 1
        try:
            yield
        finally:
            async with self._lock:
                self._users -= 1
                if self._users == 0 and self._stack is not None:
                    stack, self._stack = self._stack, None
                    await stack.aclose()  # the units start again once the last step is done
