"""The runner's scoring pool: results and errors come back, and a slow reward never holds the process
open at exit (its workers are daemon threads; ThreadPoolExecutor's would be joined)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from openrl_jupyter.runner import DaemonPool, get_runner


def test_pool_returns_results_and_errors_and_caps_its_threads():
    pool = DaemonPool(3)
    gate = threading.Event()
    futures = [pool.submit(lambda i=i: (gate.wait(5), i * i)[1]) for i in range(8)]
    time.sleep(0.1)
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
    gate = threading.Event()
    running = pool.submit(gate.wait, 5)
    queued = pool.submit(print, "never")
    time.sleep(0.05)
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    gate.set()
    assert running.result(5) is True


def test_a_slow_reward_does_not_hold_the_process_at_exit():
    script = textwrap.dedent(
        """
        import time
        from openrl_jupyter.runner import get_runner
        get_runner().pool.submit(time.sleep, 120)
        time.sleep(0.2)
        print("leaving")
        """
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "leaving" in out.stdout
    assert time.monotonic() - t0 < 30  # not the 120 s the reward sleeps


def test_the_runner_uses_the_daemon_pool():
    assert isinstance(get_runner().pool, DaemonPool)
