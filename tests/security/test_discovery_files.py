"""Discovery files (``<jupyter runtime dir>/openrl-local-<pid>.json``) name an embedded service's URL and
key; a kernel, the next kernel (detached runs) and the lab panel trust what they say. A file planted by
another account (a runtime dir shared between users, or made group/world writable) would point them at
a service that account runs — one that would receive the user's prompts, rewards' inputs and key. Only
this user's own, private files are read."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from openrl_jupyter.local import DISCOVERY_PREFIX, discovered, find_detached


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
