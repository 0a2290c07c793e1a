"""The daemon's event stream: every step, wait and failure, kept briefly and fanned out.

`gpudctl events` shows the recent history; `events -f` follows. A slow subscriber must never
stall the engine, so each subscriber has a bounded queue and loses events (with a marker) when
it falls behind.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

log = logging.getLogger("gpud.events")


class EventBus:
    def __init__(self, history: int = 500, queue_size: int = 1000) -> None:
        self._history: collections.deque[dict[str, Any]] = collections.deque(maxlen=history)
        self._subscribers: set[asyncio.Queue] = set()
        self._queue_size = queue_size

    def publish(self, kind: str, message: str, gpu: str | None = None, **data: Any) -> dict[str, Any]:
        event = {"time": time.time(), "kind": kind, "gpu": gpu, "message": message, "data": data}
        self._history.append(event)
        log.info("%s%s: %s", f"{gpu} " if gpu else "", kind, message)
        for q in list(self._subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:
                lost = {"time": event["time"], "kind": "overflow", "gpu": None,
                        "message": "subscriber too slow: events were dropped", "data": {}}
                q.get_nowait()
                q.put_nowait(lost)
        return event

    def recent(self) -> list[dict[str, Any]]:
        return list(self._history)

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(self._queue_size)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)
