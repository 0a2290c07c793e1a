"""The observer's contract: reads off the loop, one at a time, shared by whoever waits for a read
begun after a moment; a caller going away never cancels a shared read; an older read never
replaces a newer observation; the background re-read is bounded."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from gpud.engine.observe.discovery import Observation
from gpud.engine.observe.observer import Observer


class Host:
    """Each read returns a new Observation (told apart by identity) and can be held mid-read."""

    def __init__(self) -> None:
        self.reads: list[Observation] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)
        self.threads: set[str] = set()

    def read(self) -> Observation:
        self.threads.add(threading.current_thread().name)
        self.entered.release()
        assert self.gate.wait(30)
        obs = Observation(gpus=(), functions=())
        self.reads.append(obs)
        return obs


def _observer(host: Host, installed: list, **kw) -> Observer:
    return Observer(host.read, installed.append, **kw)


async def _entered(host: Host) -> None:
    assert await asyncio.to_thread(host.entered.acquire, True, 30)


async def test_reads_run_off_the_loop_and_concurrent_callers_share_one():
    host, installed = Host(), list[Any]()
    obs = _observer(host, installed)
    host.gate.clear()
    since = time.monotonic()  # five requests that arrived together
    callers = [asyncio.create_task(obs.fresh(since)) for _ in range(5)]
    await _entered(host)
    host.gate.set()
    results = await asyncio.gather(*callers)
    assert len(host.reads) == 1 and all(r is host.reads[0] for r in results)
    assert installed == host.reads and obs.reads == 1
    assert threading.main_thread().name not in host.threads


async def test_a_read_begun_before_the_request_is_not_taken_as_fresh():
    host, installed = Host(), list[Any]()
    obs = _observer(host, installed)
    host.gate.clear()
    first = asyncio.create_task(obs.refresh())
    await _entered(host)
    second = asyncio.create_task(obs.refresh())  # asked while the first read is under way
    await asyncio.sleep(0)
    host.gate.set()
    a, b = await asyncio.gather(first, second)
    assert a is host.reads[0] and b is host.reads[1] and len(host.reads) == 2
    assert installed == host.reads


async def test_a_cancelled_caller_does_not_cancel_the_shared_read():
    host, installed = Host(), list[Any]()
    obs = _observer(host, installed)
    host.gate.clear()
    leaving = asyncio.create_task(obs.refresh())
    await _entered(host)
    staying = asyncio.create_task(obs.fresh(0.0))
    await asyncio.sleep(0)
    leaving.cancel()
    host.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert await staying is host.reads[0] and installed == host.reads


async def test_an_older_read_finishing_late_never_replaces_a_newer_observation():
    host, installed = Host(), list[Any]()
    obs = _observer(host, installed)
    host.gate.clear()
    slow = asyncio.create_task(obs.refresh())
    await _entered(host)

    def read_now_elsewhere() -> Observation:  # a read begun later, finished first
        result = Observation(gpus=(), functions=())
        obs._take(result, time.monotonic(), 0.0)
        return result

    newer = read_now_elsewhere()
    host.gate.set()
    older = await slow
    assert older is not newer and installed == [newer]
    assert obs._current is newer


async def test_background_reread_is_bounded_by_max_age_and_waits_for_hardware_steps():
    host, installed = Host(), list[Any]()
    busy = [False]
    obs = _observer(host, installed, max_age=3600, busy=lambda: busy[0])
    await obs.refresh()
    for _ in range(3):
        obs.poke()
        await asyncio.sleep(0)
    assert len(host.reads) == 1  # younger than max_age: nothing read
    obs.max_age = 0.0
    busy[0] = True
    obs.poke()
    await asyncio.sleep(0)
    assert obs._running is None and len(host.reads) == 1  # a step is in flight: it re-reads itself
    busy[0] = False
    obs.poke()
    assert obs._background is not None
    await obs._background
    assert len(host.reads) == 2 and installed[-1] is host.reads[-1]
    assert 0.0 <= obs.age() < 3600
