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
import queue
import sys
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


class DaemonPool(concurrent.futures.Executor):
    """A thread pool whose workers are daemon threads, started on demand up to ``max_workers``.

    ``ThreadPoolExecutor`` joins its workers at interpreter exit, so a script (or a kernel shutting
    down) would wait for a slow reward function to return before exiting. Reward calls do not outlive
    the run that asked for them, so this pool's workers never hold the process."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "openrl-reward"):
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new reward calls after shutdown")
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._work.put((future, fn, args, kwargs))
            if self._idle == 0 and len(self._threads) < self._max:
                t = threading.Thread(
                    target=self._worker, name=f"{self._prefix}_{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
            else:
                self._idle -= 1 if self._idle else 0
            return future

    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                    future.set_exception(e)
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._work.put(None)
        if wait:
            for t in threads:
                t.join()


class Runner:
    """A daemon thread running an asyncio loop, plus the scoring thread pool."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pool = DaemonPool(SCORING_THREADS, thread_name_prefix="openrl-reward")
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


class CellOutput:
    """The output area of the cell that started something, for messages sent later from any thread.

        out = CellOutput.capture()    # on the kernel thread, while the cell runs
        out.show(obj)                 # later, from the runner thread: obj appears under that cell

    In a kernel the display is published with the captured cell's parent header (ipykernel 7's
    ``set_thread_parent``, for this thread only), so JupyterLab appends it to that cell's output even
    while another cell runs; the runner never calls ``set_parent`` (that would move the running
    cell's own output). Outside a kernel (a script, a detached job's worker) the text goes to stderr.
    """

    def __init__(self, shell: Any = None, parent: dict | None = None) -> None:
        self._shell = shell
        self._parent = parent
        self._shown: set[Any] = set()

    @classmethod
    def capture(cls) -> CellOutput:
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:
            shell = None
        if shell is None or not hasattr(shell, "kernel") or not hasattr(shell, "get_parent"):
            return cls()
        if _runner is not None and _runner.on_runner_thread():
            return cls()  # started by a listener on the runner: no cell of its own, so stderr
        return cls(shell, dict(shell.get_parent() or {}))

    def show(self, obj: Any, *, once: Any = None) -> None:
        """Display ``obj`` (its mime bundle) under the captured cell; never raises. With ``once``, a
        key: nothing when something was already shown with it."""
        if once is not None:
            if once in self._shown:
                return
            self._shown.add(once)
        try:
            if self._shell is None:
                text = obj.text() if hasattr(obj, "text") else str(obj)
                print(text, file=sys.stderr, flush=True)
                return
            from IPython.display import display

            route = getattr(self._shell, "set_thread_parent", None)
            reset = getattr(self._shell, "reset_thread_parent", None)
            tokens = route(self._parent) if route is not None and reset is not None and self._parent else None
            try:
                display(obj)
            finally:
                if tokens is not None:
                    reset(tokens)
        except Exception:  # noqa: BLE001 - a message that cannot be shown must not stop a run
            traceback.print_exc()


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
