"""The runner's scoring pool: results and errors come back, and a slow reward never holds the process
open at exit (its workers are daemon threads; ThreadPoolExecutor's would be joined)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import pytest

from openrl_jupyter.runner import DaemonPool, get_runner


def test_pool_returns_results_and_errors_and_caps_its_threads():
    pool = DaemonPool(3)
    gate = threading.Event()
    started = threading.Semaphore(0)

    def square(i):
        started.release()
        assert gate.wait(60)
        return i * i

    futures = [pool.submit(square, i) for i in range(3)]
    for _ in range(3):
        assert started.acquire(timeout=60)  # three calls running at once: three workers
    futures += [pool.submit(square, i) for i in range(3, 8)]
    assert len(pool._threads) == 3  # never more than max_workers, however many calls wait
    assert all(t.daemon for t in pool._threads)
    gate.set()
    assert [f.result(5) for f in futures] == [i * i for i in range(8)]
    bad = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.result(5)
    pool.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)


def test_pool_serves_run_in_executor_and_cancels_queued_work():
    pool = DaemonPool(1)

    async def main():
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(pool, pow, 2, k) for k in range(5)))

    assert asyncio.run(main()) == [1, 2, 4, 8, 16]
    gate, started = threading.Event(), threading.Event()
    running = pool.submit(lambda: started.set() or gate.wait(60))
    queued = pool.submit(print, "never")
    assert started.wait(60)  # the worker holds the first call; the second is still queued
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    gate.set()
    assert running.result(5) is True


def test_a_slow_reward_does_not_hold_the_process_at_exit():
    script = textwrap.dedent(
        """
        import threading, time
        from openrl_jupyter.runner import get_runner
        started = threading.Event()
        get_runner().pool.submit(lambda: started.set() or time.sleep(120))
        assert started.wait(30)  # a worker is inside the slow reward as the process leaves
        print("leaving")
        """
    )
    # the timeout is half the 120 s the reward sleeps: a process held by its pool never exits in time
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "leaving" in out.stdout


def test_the_runner_uses_the_daemon_pool():
    assert isinstance(get_runner().pool, DaemonPool)
