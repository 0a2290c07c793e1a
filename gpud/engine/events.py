"""The daemon's event stream: every step, wait and failure, kept briefly and fanned out.

`gpudctl events` shows the recent history; `events -f` follows. A slow subscriber must never
stall the engine, so each subscriber gets one bounded `EventQueue` and loses events (with one
marker that counts them) when it falls behind. The API server sends from that same queue, so
there is one bound and one overflow marker between the engine and a client.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import msgspec

log = logging.getLogger("gpud.events")


class _Dropped:
    """Stands where events were lost, counting them."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 1


def overflow_event(dropped: int) -> dict[str, Any]:
    """The event a subscriber reads where `dropped` events were lost (the same shape as published ones)."""
    return {"time": time.time(), "kind": "overflow", "gpu": None,
            "message": f"{dropped} events dropped: this client reads too slowly", "data": {"dropped": dropped}}


class EventQueue:
    """Bounded FIFO of events for one subscriber: put never blocks; when full, events are
    dropped and one marker in their place says how many, so the reader learns of the gap."""

    def __init__(self, size: int) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._size = max(1, size)
        self._ready = asyncio.Event()
        self.closed = False
        self.dropped = 0

    def put(self, item: Any) -> None:
        if len(self._items) >= self._size:
            self.dropped += 1
            if self._items and isinstance(self._items[-1], _Dropped):
                self._items[-1].count += 1
            else:
                self._items.append(_Dropped())  # one over the bound, at most
        else:
            self._items.append(item)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def get(self) -> Any:
        """Next item (a gap becomes an `overflow_event`); None once closed and empty."""
        while not self._items:
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, _Dropped):
            return overflow_event(item.count)
        return item


def event_fields(record: msgspec.Struct) -> dict[str, Any]:
    """A plan step (or any record) as event data: its fields that are set, in plain types."""
    return {k: v for k, v in msgspec.to_builtins(record).items() if v is not None}


class EventBus:
    def __init__(self, history: int = 500, queue_size: int = 1000) -> None:
        self._history: collections.deque[dict[str, Any]] = collections.deque(maxlen=history)
        self._subscribers: set[EventQueue] = set()
        self._queue_size = queue_size

    def publish(self, kind: str, message: str, gpu: str | None = None, **data: Any) -> dict[str, Any]:
        event = {"time": time.time(), "kind": kind, "gpu": gpu, "message": message, "data": data}
        self._history.append(event)
        log.info("%s%s: %s", f"{gpu} " if gpu else "", kind, message)
        for queue in list(self._subscribers):
            queue.put(event)
        return event

    def recent(self) -> list[dict[str, Any]]:
        return list(self._history)

    def subscribe(self) -> EventQueue:
        queue = EventQueue(self._queue_size)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: EventQueue) -> None:
        self._subscribers.discard(queue)
        queue.close()
