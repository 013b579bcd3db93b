"""The laptop case: ``%openrl connect --local`` advertises its embedded service in the Jupyter runtime
folder (mode 0600, removed when it stops), and the server extension finds it there."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from openrl_jupyter import session as sessions
from tests.conftest import ALICE_KEY


def test_connect_local_is_found_by_the_panel_and_gone_when_it_stops(bare_jupyter, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(bare_jupyter.runtime_dir))  # the kernel's, as the server's
    session = sessions.connect(local=True, name="panel-discovery")
    try:
        local = session.local
        path = Path(local.discovery_path)
        assert path.parent == bare_jupyter.runtime_dir
        assert path.name == f"openrl-local-{local.process.pid}.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        key = session._token
        assert json.loads(path.read_text()) == {"url": session.url, "token": key, "pid": local.process.pid}
        with bare_jupyter.client() as http:
            health = http.get("openrl/health")
            listed = http.get("openrl/runs")
        assert health.json()["connected"] is True, health.text
        assert health.json()["url"] == session.url
        assert health.json()["source"] == "discovery"
        assert listed.status_code == 200
        assert listed.json() == {"runs": []}
        for r in (health, listed):
            assert key not in r.text and key not in json.dumps(dict(r.headers))
        assert f"openrl: service at {session.url} (from discovery, key from discovery)" in bare_jupyter.log()
    finally:
        sessions.disconnect("panel-discovery")
    assert not path.exists()  # the embedded service stopped: its file went with it
    with bare_jupyter.client() as http:
        health = http.get("openrl/health").json()
    assert health["connected"] is False
    assert health["url"] is None
    assert key not in bare_jupyter.log()


def advertise_by_hand(folder: Path, *, url: str, token: str, pid: int) -> Path:
    path = folder / f"openrl-local-{pid}.json"
    path.write_text(json.dumps({"url": url, "token": token, "pid": pid}))
    path.chmod(0o600)
    return path


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_refused_key_and_a_dead_kernels_file(bare_jupyter, server, dead_pid):
    canary = "tml-canary-" + "7" * 24
    stale = advertise_by_hand(bare_jupyter.runtime_dir, url=server.url, token=ALICE_KEY, pid=dead_pid)
    wrong = advertise_by_hand(bare_jupyter.runtime_dir, url=server.url, token=canary, pid=os.getpid())
    try:
        with bare_jupyter.client() as http:
            health = http.get("openrl/health")
            listed = http.get("openrl/runs")
    finally:
        stale.unlink()
        wrong.unlink()
    # the live file is used (the dead kernel's, with a good key, is not), and its key is refused
    assert health.json()["connected"] is False
    assert health.json()["error"].startswith(f"openrl service at {server.url}: the key was refused (HTTP 401")
    assert listed.status_code == 502
    assert listed.json()["error"].startswith(f"openrl service at {server.url}: the key was refused")
    for r in (health, listed):
        assert canary not in r.text and canary not in json.dumps(dict(r.headers))
    assert canary not in bare_jupyter.log()
