"""The service's event stream (``GET /openrl/v1/events``) as a feed that dashboards subscribe to.

One SSE connection per session, read on the runner loop, fans each event (telemetry ticks and run
events) out to its subscribers. It starts with the first subscriber, reconnects (tenacity, as the
client's retries) with backoff (0.5 s doubling up to ``max_backoff_s``, from the last event) when the connection drops or the service refuses it — a 401 too:
after a key rotation the client factory may hand out a client with the new key, and a dashboard must
not freeze for good — and stops only when the session closes. ``last_error`` says why it is not
connected (None once events flow again).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

import tenacity

from openrl_jupyter._exceptions import AuthenticationError
from openrl_jupyter.runner import get_runner, notify


class EventFeed:
    def __init__(self, client_factory: Callable, *, max_backoff_s: float = 10.0):
        self._client_factory = client_factory
        self._subscribers: list[Callable[[dict], None]] = []
        self._lock = threading.Lock()
        self._task_future = None
        self._closed = False
        self.max_backoff_s = max_backoff_s
        self.last_error: str | None = None
        self.last_tick: dict | None = None
        self._failures = 0  # connection attempts since the last event arrived

    def subscribe(self, fn: Callable[[dict], None]) -> Callable[[], None]:
        """Deliver every event to ``fn`` (called on the runner thread); returns the unsubscribe."""
        with self._lock:
            self._subscribers.append(fn)
            if self._task_future is None and not self._closed:
                self._task_future = get_runner().submit(self._pump())

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._subscribers:
                    self._subscribers.remove(fn)

        return unsubscribe

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fut, self._task_future = self._task_future, None
        if fut is not None:
            fut.cancel()

    def _deliver(self, event: dict) -> None:
        if event.get("type") == "tick":
            self.last_tick = event
        with self._lock:
            subscribers = list(self._subscribers)
        notify(subscribers, event)

    async def _pump(self) -> None:
        """Read the stream; reconnect (tenacity) until the feed is closed."""
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(Exception),  # not CancelledError: close() ends it
            wait=self._wait,
            stop=lambda _state: self._closed,
            before_sleep=self._note,
            sleep=asyncio.sleep,
        )
        with contextlib.suppress(tenacity.RetryError):
            async for attempt in retrying:
                with attempt:
                    await self._read()

    async def _read(self) -> None:
        """One connection's events, delivered; an error (or the stream's end) is raised for a retry."""
        async for event in self._client_factory().events():
            self._failures = 0
            self.last_error = None
            self._deliver(event)
            if self._closed:
                return
        if not self._closed:
            raise ConnectionError("the service closed the event stream")

    def _wait(self, state: tenacity.RetryCallState) -> float:
        """0.5 s doubling up to ``max_backoff_s``, counted from the last event that arrived."""
        self._failures += 1
        return min(self.max_backoff_s, 0.5 * 2 ** (self._failures - 1))

    def _note(self, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, AuthenticationError):  # a rotated key: the factory may give the new one
            self.last_error = (
                f"the service refused the key (401): {exc}; reconnecting every "
                f"{self.max_backoff_s:g} s at most until it takes one"
            )
        elif exc is not None:
            self.last_error = str(exc) or type(exc).__name__
