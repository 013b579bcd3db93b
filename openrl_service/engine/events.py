"""The notebook API's event bus: run events (created, step metrics, control, finished...) fan out to
every open SSE stream of the run's tenant, beside the telemetry ticks (``GET /openrl/v1/events``).
Every event carries ``schema`` (EVENTS_SCHEMA_VERSION) and ``type`` ("run" or "tick").
"""

from __future__ import annotations

import asyncio
import threading
import time

EVENTS_SCHEMA_VERSION = 2  # 2: ticks add memory, queue_wait_s and tokens_per_s


class EventBus:
    """Run events fan out to every open SSE stream of the tenant (bounded queues; slow readers drop)."""

    def __init__(self) -> None:
        self._subs: list[tuple[str, asyncio.Queue, asyncio.AbstractEventLoop]] = []
        self._lock = threading.Lock()

    def subscribe(self, tenant: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=1000)
        with self._lock:
            self._subs.append((tenant, q, asyncio.get_running_loop()))
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        with self._lock:
            self._subs = [s for s in self._subs if s[1] is not q]

    def publish(self, tenant: str, event: dict) -> None:
        """Thread-safe: callable from the worker thread or the event loop."""
        event = {"schema": EVENTS_SCHEMA_VERSION, "type": "run", "time": time.time(), **event}
        with self._lock:
            subs = [s for s in self._subs if s[0] == tenant]
        for _, q, loop in subs:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_offer, q, event)


def _offer(q: asyncio.Queue, event: dict) -> None:
    if q.full():
        q.get_nowait()  # drop the oldest: a stalled reader must not hold memory
    q.put_nowait(event)
