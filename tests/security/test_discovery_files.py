"""Discovery files (``<jupyter runtime dir>/openrl-local-<pid>.json``) name an embedded service's URL and
key; a kernel, the next kernel (detached runs) and the lab panel trust what they say. A file planted by
another account (a runtime dir shared between users, or made group/world writable) would point them at
a service that account runs — one that would receive the user's prompts, rewards' inputs and key. Only
this user's own, private files are read."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys

import pytest

from openrl_common.datadirs import DISCOVERY_PREFIX, LOCK_NAME
from openrl_jupyter.local import discovered, find_detached, running_on


@pytest.fixture
def service_pid():
    """A live process that looks like a service to the discovery code (its command line names it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; print(flush=True); time.sleep(600)", "openrl_service"],
        stdout=subprocess.PIPE,
    )
    proc.stdout.readline()  # it runs (exec done: its command line is its own)
    yield proc.pid
    proc.kill()
    proc.wait()


def _plant(folder, pid: int, **extra) -> str:
    path = folder / f"{DISCOVERY_PREFIX}{pid}.json"
    path.write_text(json.dumps({"url": "http://127.0.0.1:1", "token": "tml-planted", "pid": pid, **extra}))
    path.chmod(0o600)
    return str(path)


def _foreign(path: str, monkeypatch) -> None:
    """Make ``path`` another account's: chown it when we may, else make this process another uid."""
    if os.getuid() == 0:
        os.chown(path, 12345, 12345)
    else:
        mine = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: mine + 1)


def test_a_discovery_file_of_another_account_is_not_trusted(tmp_path, monkeypatch, service_pid):
    path = _plant(tmp_path, service_pid)
    assert discovered(str(tmp_path))["url"] == "http://127.0.0.1:1"  # ours: read
    _foreign(path, monkeypatch)
    assert discovered(str(tmp_path)) is None


def test_a_detached_services_file_of_another_account_is_not_trusted(tmp_path, monkeypatch, service_pid):
    path = _plant(tmp_path, service_pid, detached=True, data_dir=str(tmp_path))
    assert find_detached(str(tmp_path)) is not None
    _foreign(path, monkeypatch)
    assert find_detached(str(tmp_path)) is None


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_a_discovery_file_others_may_write_is_not_trusted(tmp_path, mode, service_pid):
    path = _plant(tmp_path, service_pid, detached=True)
    assert discovered(str(tmp_path)) is not None
    os.chmod(path, mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    assert discovered(str(tmp_path)) is None and find_detached(str(tmp_path)) is None


def test_a_discovery_file_that_is_a_link_is_not_trusted(tmp_path, service_pid):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = _plant(elsewhere, service_pid)
    os.symlink(real, tmp_path / f"{DISCOVERY_PREFIX}{service_pid}.json")
    assert discovered(str(elsewhere)) is not None
    assert discovered(str(tmp_path)) is None


def _plant_lock(folder, pid: int, url: str = "http://127.0.0.1:1") -> str:
    """A data folder as a running embedded service leaves it: its lock (pid, host, url) and its key."""
    lock = folder / LOCK_NAME
    lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "since": "now", "url": url}))
    lock.chmod(0o644)  # as serve writes it
    key = folder / "api-key"
    key.write_text("tml-mine\n")
    key.chmod(0o600)
    return str(lock)


def test_a_kernel_joins_an_embedded_service_only_by_a_lock_of_its_own_account(
    tmp_path, monkeypatch, service_pid
):
    """Attack: another account plants a lock file in (or makes one writable in) the folder a kernel's
    --local joins by, naming its own service: the kernel must not send its key there."""
    lock = _plant_lock(tmp_path, service_pid)
    found = running_on(tmp_path)
    assert found is not None and found.url == "http://127.0.0.1:1" and found.key == "tml-mine"  # ours
    os.chmod(lock, 0o666)
    assert running_on(tmp_path) is None
    os.chmod(lock, 0o644)
    _foreign(lock, monkeypatch)
    assert running_on(tmp_path) is None


@pytest.mark.parametrize(
    "url", ["http://10.0.0.7:8000", "https://evil.example:443", "http://127.0.0.1.evil:80"]
)
def test_a_kernel_sends_its_key_only_to_a_loopback_service_named_by_the_lock(tmp_path, url, service_pid):
    _plant_lock(tmp_path, service_pid, url=url)
    assert running_on(tmp_path) is None


def test_a_lock_of_a_dead_process_names_nothing(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _plant_lock(tmp_path, dead.pid)
    assert running_on(tmp_path) is None
