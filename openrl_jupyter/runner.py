"""The background runner: one daemon thread with its own asyncio loop, shared by every run of a kernel.

Cells never block on training: they hand coroutines to the runner (``submit``) and get a
``concurrent.futures.Future`` back. All network I/O of runs (sampling, train steps, the event
stream) happens on this loop; reward functions run in the runner's scoring thread pool (or, when
``async def``, on this loop), never on the kernel's own loop, so the kernel stays free and one
run's slow reward does not stall the others' requests.

The thread starts lazily and stops deterministically at interpreter exit (``atexit``) or when
the runner is garbage-collected (``weakref.finalize``), as IPython's ``%%script --bg`` does.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
import traceback
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

SCORING_THREADS = max(4, min(16, (os.cpu_count() or 2) * 2))


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, pool) -> None:
    if not loop.is_closed() and thread.is_alive():

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(5)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    pool.shutdown(wait=False, cancel_futures=True)


class Runner:
    """A daemon thread running an asyncio loop, plus the scoring thread pool."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pool = concurrent.futures.ThreadPoolExecutor(SCORING_THREADS, thread_name_prefix="openrl-reward")
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="openrl-runner", daemon=True)
        self.thread.start()
        self._ready.wait()
        self._finalizer = weakref.finalize(self, _shutdown, self.loop, self.thread, self.pool)
        atexit.register(self._finalizer)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Schedule a coroutine on the runner loop; thread-safe. Returns a concurrent Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the runner thread soon; thread-safe."""
        self.loop.call_soon_threadsafe(fn, *args)

    def call_later(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the runner thread after ``delay_s`` seconds; thread-safe."""
        self.loop.call_soon_threadsafe(self.loop.call_later, max(0.0, delay_s), fn, *args)

    def on_runner_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def stop(self) -> None:
        self._finalizer()


def notify(listeners: list[Callable[[dict], Any]], event: dict) -> None:
    """Call each listener with ``event``; one that raises is reported and does not stop the others."""
    for fn in listeners:
        try:
            fn(event)
        except Exception:  # noqa: BLE001 - a broken listener must not stop a run or starve the others
            traceback.print_exc()


_runner: Runner | None = None
_runner_lock = threading.Lock()


def get_runner() -> Runner:
    """The process's runner, started on first use (and again if it was stopped)."""
    global _runner
    with _runner_lock:
        if _runner is None or not _runner.alive:
            _runner = Runner()
        return _runner
