"""One process owns a data dir: a second `openrl-service serve` on it exits at once, naming the holder;
the lock dies with its holder, `kill -9` included."""

from __future__ import annotations

import json
import signal
import socket
import subprocess

import pytest

from openrl_service.storage.lock import LOCK_NAME, DataDirInUse, DataDirLock
from tests._support.serve import cli, finish, start, wait_ready

SECOND_START_GUARD_S = 120  # a hang guard: the refusal comes before the model loads


def test_a_second_serve_on_the_same_data_dir_exits_naming_the_holder(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    data.mkdir()
    first = start(data, tiny_model_dir, "--no-auth")
    try:
        wait_ready(first)
        argv, env = cli("serve", "--no-auth", "--port", "1", "--data-dir", str(data))
        second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=SECOND_START_GUARD_S)
        assert second.returncode == 3, second.stderr
        message = second.stderr
        assert f"data dir {data} is in use" in message
        assert f"pid {first.proc.pid}" in message
        assert f"on host {socket.gethostname()}" in message
        assert "since 20" in message  # an ISO date
        assert first.url in message
        assert "--data-dir" in message  # the remedy
        assert first.proc.poll() is None  # the holder is untouched and still serves
        # the same port too (bound first, now): the holder is named, not just "address in use"
        port = first.url.rsplit(":", 1)[1]
        argv, env = cli("serve", "--no-auth", "--port", port, "--data-dir", str(data))
        same = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=SECOND_START_GUARD_S)
        assert same.returncode == 3 and f"pid {first.proc.pid}" in same.stderr, same.stderr
        assert json.loads((data / LOCK_NAME).read_text())["pid"] == first.proc.pid

        # kill -9: no cleanup runs, yet the kernel drops the lock with the process.
        first.proc.send_signal(signal.SIGKILL)
        assert finish(first) == -signal.SIGKILL
        again = start(data, tiny_model_dir, "--no-auth")
        try:
            wait_ready(again)
            assert json.loads((data / LOCK_NAME).read_text())["pid"] == again.proc.pid
        finally:
            again.proc.terminate()
            assert finish(again) == 0, again.stderr
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
        finish(first)


def test_the_lock_is_held_until_released(tmp_path):
    held = DataDirLock.acquire(tmp_path, url="http://127.0.0.1:9")
    with pytest.raises(DataDirInUse) as refused:
        DataDirLock.acquire(tmp_path)
    assert refused.value.holder["url"] == "http://127.0.0.1:9"
    assert "stop that one first" in str(refused.value)
    held.release()
    DataDirLock.acquire(tmp_path).release()  # free again
