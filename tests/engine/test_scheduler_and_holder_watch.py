"""Pass scheduling (tickets, coalescing) and the pidfd holder watch, each on its own: no timing
assumptions, every wait is on an event with a generous bound only against a hang."""

from __future__ import annotations

import asyncio
import subprocess

from gpud.engine.observe.holder_watch import HolderWatch
from gpud.engine.scheduler import PassScheduler
from gpud.model import Holder


async def test_requests_during_a_pass_coalesce_into_the_next_one():
    scheduler = PassScheduler()
    started, release = asyncio.Event(), asyncio.Event()
    passes: list[int] = []

    async def run_pass() -> None:
        passes.append(len(passes) + 1)
        started.set()
        await release.wait()

    task = asyncio.create_task(scheduler.run(run_pass, debounce=0))
    try:
        first = scheduler.kick("file changed")
        await asyncio.wait_for(started.wait(), 10)
        started.clear()
        later = [scheduler.kick(f"udev event {i}") for i in range(3)]  # all during pass 1
        assert later == [first + 1, first + 2, first + 3]
        assert not await scheduler.wait_for(first, timeout=0)  # pass 1 still running
        release.set()
        assert await scheduler.wait_for(first, timeout=10)
        assert await scheduler.wait_for(later[-1], timeout=10)
        assert passes == [1, 2]  # three requests, one more pass
    finally:
        task.cancel()


async def test_a_watched_holder_exiting_calls_back_once_with_its_pid():
    exited: asyncio.Queue[int] = asyncio.Queue()
    watch = HolderWatch(exited.put_nowait)
    child = subprocess.Popen(["sleep", "600"])
    try:
        holder = Holder(pid=child.pid, name="sleep", device="/dev/nvidia0")
        watch.watch([holder])
        watch.watch([holder])  # a second watch of the same pid is not a second callback
        child.kill()
        child.wait()
        assert await asyncio.wait_for(exited.get(), 10) == child.pid
        watch.watch([Holder(pid=child.pid, name="sleep", device="/dev/nvidia0")])  # gone: nothing to watch
        await asyncio.sleep(0)
        assert exited.empty()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


async def test_an_exited_holder_still_listed_is_reported_once():
    """A process that exited but is not reaped yet (a zombie) keeps its pid and /proc entry, and
    NVML can list it until then: every pass would watch it again, and its pidfd is readable at once.
    The kernel's own record says it exited; the watch must announce that exit only once."""
    exited: asyncio.Queue[int] = asyncio.Queue()
    watch = HolderWatch(exited.put_nowait)
    child = subprocess.Popen(["sleep", "600"])
    try:
        holder = Holder(pid=child.pid, name="sleep", device="/dev/nvidia0")
        watch.watch([holder])
        child.kill()  # not reaped: a zombie until child.wait()
        assert await asyncio.wait_for(exited.get(), 10) == child.pid
        with open(f"/proc/{child.pid}/stat") as f:
            assert f.read().split(") ")[1][0] == "Z"  # the kernel: still there, as a zombie
        for _ in range(3):  # three more passes still see it
            watch.watch([holder])
            for _ in range(5):  # a readable pidfd is served within the next loop iterations
                await asyncio.sleep(0)
        assert exited.empty()
    finally:
        child.kill()
        child.wait()
