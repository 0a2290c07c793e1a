"""How late the daemon's event loop runs: a probe task that asks to wake every `interval` and
records how much later than asked it woke.

Every client and every event source shares the one loop, so its lateness is the latency floor of
every answer; a read of the host or a hardware step done on the loop by mistake shows up here at
once. The samples of the current window are kept (bounded) for the `stats` op.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

INTERVAL = 0.01  # seconds between wake-ups: 100 cheap wake-ups a second
KEEP = 60_000  # samples per window at most (10 minutes at INTERVAL)


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-len(sorted_values) * p // 100))  # ceil(n * p / 100), at least the first
    return sorted_values[int(rank) - 1]


class LoopLagProbe:
    def __init__(self, interval: float = INTERVAL, keep: int = KEEP) -> None:
        self.interval = interval
        self.samples: deque[float] = deque(maxlen=keep)  # seconds late, per wake-up
        self.window_start = time.monotonic()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self.samples.append(max(0.0, loop.time() - asked))

    def summary(self) -> tuple[int, float, float, float]:
        """(samples, p50, p99, max) of the window, in milliseconds."""
        values = sorted(self.samples)
        ms = 1000.0
        return (len(values), percentile(values, 50) * ms, percentile(values, 99) * ms,
                (values[-1] if values else 0.0) * ms)

    def reset(self) -> None:
        self.samples.clear()
        self.window_start = time.monotonic()
