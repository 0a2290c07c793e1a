"""Per-GPU work side by side (gpud.engine.gpu_tasks): the bound, the NVML session gate, the shared drain.
Assertions are on the order things happened (a log), never on durations."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable

from gpud.engine.gpu_tasks import NvmlSessionGate, SharedDrain, for_each_gpu


def test_at_most_limit_gpus_run_at_once_and_all_run():
    async def main():
        running, peak, done = 0, 0, list[str]()
        release = asyncio.Event()

        async def work(pci):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            if len(done) == 0 and running == 3:
                release.set()
            await release.wait()
            running -= 1
            done.append(pci)

        await for_each_gpu([f"gpu{i}" for i in range(7)], work, limit=3)
        return peak, done

    peak, done = asyncio.run(main())
    assert peak == 3 and sorted(done) == [f"gpu{i}" for i in range(7)]


def test_one_blocked_gpu_does_not_hold_up_the_others():
    async def main():
        log = []
        never = asyncio.Event()

        async def work(pci):
            if pci == "a":
                log.append("a blocked")
                await never.wait()
            log.append(f"{pci} done")
            if pci == "c":
                never.set()

        await for_each_gpu(["a", "b", "c"], work)
        return log

    log = asyncio.run(main())
    assert log.index("b done") < log.index("a done") and log.index("c done") < log.index("a done")


def test_nvml_work_and_unbinds_exclude_each_other_while_each_kind_runs_together():
    async def main():
        gate = NvmlSessionGate()
        log = []
        unbinds_may_end = asyncio.Event()

        async def unbind(name):
            async with gate.hold("closed"):
                log.append(f"{name} in")
                await unbinds_may_end.wait()
                log.append(f"{name} out")

        async def mig(name):
            async with gate.hold("open"):
                log.append(f"{name} in")
                await asyncio.sleep(0)
                log.append(f"{name} out")

        async def opener():
            while log.count("u1 in") + log.count("u2 in") < 2:
                await asyncio.sleep(0)
            unbinds_may_end.set()

        await asyncio.gather(unbind("u1"), unbind("u2"), mig("m1"), opener())
        return log

    log = asyncio.run(main())
    assert log[:2] == ["u1 in", "u2 in"]  # two unbinds side by side
    assert log.index("m1 in") > max(log.index("u1 out"), log.index("u2 out"))  # MIG work waited for both


class RecordingDrainer:
    def __init__(self, log: list[tuple]) -> None:
        self.log = log

    @contextlib.asynccontextmanager
    async def drained(self, units: Iterable[str]) -> AsyncIterator[list[str]]:
        self.log.append(("stop", tuple(units)))
        yield list(units)
        self.log.append(("start", tuple(units)))


def test_drained_units_stay_stopped_until_the_last_gpu_is_done():
    async def main():
        log: list[tuple] = []
        drain, drainer = SharedDrain(), RecordingDrainer(log)
        first_done = asyncio.Event()

        async def gpu(name, wait):
            async with drain.drained(drainer, ["nvidia-dcgm.service"]):
                log.append((name, "in"))
                if wait:
                    await first_done.wait()
                else:
                    await asyncio.sleep(0)
                    first_done.set()
                log.append((name, "out"))

        await asyncio.gather(gpu("slow", True), gpu("fast", False))
        return log

    log = asyncio.run(main())
    assert [e for e in log if e[0] in ("stop", "start")] == [("stop", ("nvidia-dcgm.service",)),
                                                            ("start", ("nvidia-dcgm.service",))]
    assert log[-1][0] == "start" and log.index(("slow", "out")) < len(log) - 1
