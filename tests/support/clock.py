"""A clock for waits whose end a test wants without spending it."""

from __future__ import annotations


class SteppedClock:
    """gpud.engine.ports.Clock whose sleep() moves time on at once: a bounded wait runs through
    its checks and reaches its deadline in no real time. `slept`: the total it was asked to wait."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds
