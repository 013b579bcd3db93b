"""One data world: ``openrl-service serve``, the notebook's ``connect(local=True)`` and the CLI default to
one folder per model under one data home, so a notebook joins the service a terminal started and the
Tinker CLI lists what the notebook saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openrl_common.datadirs import data_home, local_data_dir, lock_holder, model_data_dir
from openrl_jupyter import session as sess
from openrl_jupyter.local import free_port
from openrl_service import config as cfg
from tests._support.clientenv import client_env

TINKER_CLI = Path(sys.executable).parent / "tinker"


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A user whose data home is empty and who has not moved the notebook's folder."""
    monkeypatch.delenv("OPENRL_LOCAL_DATA_DIR", raising=False)
    monkeypatch.delenv("OPENRL_DATA_DIR", raising=False)
    monkeypatch.setenv("OPENRL_DATA_HOME", str(tmp_path / "openrl"))
    return tmp_path / "openrl"


def test_serve_the_notebook_and_the_cli_default_to_the_same_folder_per_model(home, monkeypatch):
    assert data_home() == str(home)
    assert (
        cfg.from_env({}).data_dir
        == Path(local_data_dir())
        == Path(local_data_dir("openrl/tiny"))
        == home / "tiny"
    )
    smol = cfg.from_env({}, model="smollm2").data_dir
    assert smol == Path(local_data_dir("smollm2")) == Path(model_data_dir(["smollm2"]))
    assert smol.parent == home and smol.name.startswith("smollm2-") and smol != home / "tiny"
    assert cfg.from_env({"OPENRL_MODELS": "tiny,smollm2"}).data_dir not in (home / "tiny", smol)
    assert cfg.from_env({"OPENRL_DATA_DIR": "/srv/x"}).data_dir == Path("/srv/x")  # given: as given
    monkeypatch.delenv("OPENRL_DATA_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", "/xdg")
    assert local_data_dir() == "/xdg/openrl/tiny"


def test_a_notebook_joins_the_service_a_terminal_started_and_the_tinker_cli_lists_its_checkpoint(
    home, tmp_path
):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "OPENRL_LOCAL_DATA_DIR"}
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    serve = subprocess.Popen(
        [sys.executable, "-m", "openrl_service.cli", "serve", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while lock_holder(home / "tiny") is None:  # it holds its folder: a kernel may join from now on
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "serve did not take its folder"
            time.sleep(0.05)
        session = sess.connect(local=True, name="world")
        try:
            assert session.local.process.pid == serve.pid  # joined, not a second service
            assert session.url.endswith(f":{port}")
            warm = session.sft(
                [("2+2=", "4"), ("1+1=", "2")], steps=2, batch=2, name="from-notebook", progress=False
            )
        finally:
            sess.disconnect("world")
        assert serve.poll() is None  # the kernel's disconnect leaves the terminal's service running
        key = (home / "tiny" / "api-key").read_text().strip()
        proc = subprocess.run(
            [str(TINKER_CLI), "-f", "json", "checkpoint", "list", "--limit", "0"],
            env=client_env(
                f"http://127.0.0.1:{port}", key, tmp_path / "hf", TINKER_BASE_URL=f"http://127.0.0.1:{port}"
            ),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert warm.checkpoint in json.dumps(json.loads(proc.stdout)), proc.stdout[-2000:]
    finally:
        serve.terminate()
        serve.wait(60)
        log.close()
