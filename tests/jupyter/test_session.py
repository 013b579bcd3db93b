"""connect(): where the URL and key come from, named sessions, and the embedded local service."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from openrl_jupyter import AuthenticationError, ServiceUnavailable
from openrl_jupyter import session as sess
from openrl_jupyter.credentials import same_service
from tests.conftest import ALICE_KEY, BOB_KEY, free_port


@pytest.fixture(autouse=True)
def clean_sessions(monkeypatch):
    for var in ("OPENRL_URL", "OPENRL_TOKEN", "TINKER_BASE_URL", "TINKER_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    yield
    for name in list(sess.sessions()):
        sess.disconnect(name)


def test_precedence_arguments_then_env_then_config(server, monkeypatch):
    with pytest.raises(sess.UsageError, match="OPENRL_URL"):
        sess.connect()
    s = sess.connect(config={"url": server.url, "token": ALICE_KEY})
    assert s.url == server.url and s.model == "openrl/tiny"
    monkeypatch.setenv("OPENRL_URL", server.url)
    monkeypatch.setenv("OPENRL_TOKEN", BOB_KEY)
    run = sess.connect(config={"url": "http://127.0.0.1:1", "token": "tml-ignored"}).client.create_run(
        name="env"
    )
    assert run["run_id"] in [r["run_id"] for r in sess.get_session().client.list_runs()]
    monkeypatch.setenv("OPENRL_URL", f"http://127.0.0.1:{free_port()}")  # the argument wins over the env
    assert sess.connect(server.url, token=ALICE_KEY).client.capabilities()[0]["model_name"] == "openrl/tiny"


def test_the_lines_serve_prints_for_the_sdk_connect_the_notebook_too(server, monkeypatch):
    """`openrl-service serve` prints TINKER_BASE_URL and TINKER_API_KEY; a notebook with them set
    connects without OPENRL_*; OPENRL_TOKEN still wins; a TINKER_API_KEY meant for another service
    (hosted Tinker's) is never sent to this one."""
    monkeypatch.setenv("TINKER_BASE_URL", server.url + "/")
    monkeypatch.setenv("TINKER_API_KEY", ALICE_KEY)
    s = sess.connect()
    assert s.url.rstrip("/") == server.url and s.credential == "TINKER_API_KEY"
    assert s.client.create_run(name="via-tinker-env")["run_id"]
    monkeypatch.setenv("OPENRL_TOKEN", BOB_KEY)
    assert sess.connect().credential == "OPENRL_TOKEN"
    monkeypatch.delenv("OPENRL_TOKEN")
    monkeypatch.setenv("TINKER_BASE_URL", "https://tinker.example.com/services/tinker-prod")
    with pytest.raises(AuthenticationError) as refused:  # the (valid here) key was not sent
        sess.connect(server.url)
    assert ALICE_KEY not in str(refused.value) and "missing API key" in str(refused.value)
    assert same_service("http://Host:80/", "http://host") and not same_service("http://h:1", "http://h:2")


def test_named_sessions(server):
    a = sess.connect(server.url, token=ALICE_KEY, name="a")
    sess.connect(server.url, token=BOB_KEY, name="b")
    with pytest.raises(sess.UsageError, match="several sessions"):
        sess.get_session()
    assert sess.get_session("a") is a
    assert ALICE_KEY not in repr(a) and ALICE_KEY not in repr(sess.sessions())
    with pytest.raises(sess.UsageError, match="no session named 'c'"):
        sess.get_session("c")


def test_local_service_starts_with_a_fresh_key_kept_off_its_command_line():
    s = sess.connect(local=True)
    try:
        assert s.model == "openrl/tiny" and s.url.startswith("http://127.0.0.1:")
        key = s.client._token
        assert key.startswith("tml-") and key not in repr(s)
        cmdline = Path(f"/proc/{s.local.process.pid}/cmdline").read_bytes().decode()
        assert key not in cmdline and "--exit-with-parent" in cmdline
        run = s.client.create_run(name="local")
        assert s.client.sample(run["run_id"], ["hi"], max_tokens=3)["samples"]
    finally:
        proc = s.local.process
        sess.disconnect()
    assert proc.poll() is not None  # disconnect stops the embedded service


def test_local_service_exits_when_its_parent_dies(tmp_path):
    script = textwrap.dedent(
        """
        import os, signal, sys
        from openrl_jupyter import session
        s = session.connect(local=True)
        print(s.local.process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the kernel dies without cleanup
        """
    )
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    child = int(parent.stdout.strip())
    deadline = time.monotonic() + 60  # hang guard
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split()[2] == "Z":  # exited, waiting to be reaped by init
                break
        time.sleep(0.2)
    else:
        os.kill(child, 9)
        pytest.fail("the embedded service outlived its parent")


def test_local_without_the_service_extra_names_the_extra():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from openrl_jupyter import session\n"
        "try:\n    session.connect(local=True)\nexcept session.UsageError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "openrl-jupyter[service]" in out.stdout, out.stderr


def test_unreachable_url_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServiceUnavailable, match="cannot reach the openrl service"):
        sess.connect(url, token=ALICE_KEY)
    assert sess.sessions() == {}
