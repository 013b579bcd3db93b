"""The notebook side of JupyterHub identity, without a hub: where connect() takes its key from, which
environment counts as a hub server, and that activity reports that fail are logged once and harmless.
(tests/hub/test_jupyterhub.py does the same against a real hub.)"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from openrl_jupyter import hub as hubmod
from openrl_jupyter import session as sess
from openrl_jupyter.local import free_port


class Recorder(BaseHTTPRequestHandler):
    """Answers the capabilities request connect() makes and records each request's key."""

    seen: list[tuple[str, str | None]] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        Recorder.seen.append((self.path, self.headers.get("X-API-Key")))
        body = json.dumps({"supported_models": [{"model_name": "openrl/tiny", "defaults": {}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Recorder.seen = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("OPENRL_URL", "OPENRL_TOKEN", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_ACTIVITY_URL"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    for name in list(sess.sessions()):
        sess.disconnect(name)


def test_connect_uses_the_servers_hub_token_only_for_the_configured_service(recorder, clean_env):
    clean_env.setenv("JUPYTERHUB_API_TOKEN", "hub-token-of-alice")
    clean_env.setenv("OPENRL_URL", recorder)
    s = sess.connect()
    assert (s.credential, Recorder.seen[-1][1]) == ("hub", "hub-token-of-alice")
    assert "hub-token-of-alice" not in repr(s) and "hub-token-of-alice" not in repr(s.client)

    # a URL typed on the line is not where the hub pointed: no hub token goes there
    clean_env.delenv("OPENRL_URL")
    s = sess.connect(recorder.replace("127.0.0.1", "localhost"))
    assert (s.credential, Recorder.seen[-1][1]) == ("none", None)

    # a configured key wins over the hub token
    clean_env.setenv("OPENRL_TOKEN", "tml-configured-key-0000")
    s = sess.connect(config={"url": recorder})
    assert (s.credential, Recorder.seen[-1][1]) == ("OPENRL_TOKEN", "tml-configured-key-0000")
    clean_env.delenv("OPENRL_TOKEN")
    s = sess.connect(config={"url": recorder, "token": "tml-config-key-0000"})
    assert (s.credential, Recorder.seen[-1][1]) == ("config", "tml-config-key-0000")
    s = sess.connect(config={"url": recorder})
    assert (s.credential, Recorder.seen[-1][1]) == ("hub", "hub-token-of-alice")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"JUPYTERHUB_ACTIVITY_URL": "http://hub/hub/api/users/a/activity"}, None),  # no token
        (
            {
                "JUPYTERHUB_API_TOKEN": "tok-SECRET",
                "JUPYTERHUB_ACTIVITY_URL": "http://hub/hub/api/users/a/activity",
            },
            ("http://hub/hub/api/users/a/activity", ""),
        ),
        (
            {
                "JUPYTERHUB_API_TOKEN": "tok-SECRET",
                "JUPYTERHUB_API_URL": "http://hub:8081/hub/api/",
                "JUPYTERHUB_USER": "a",
                "JUPYTERHUB_SERVER_NAME": "gpu",
            },
            ("http://hub:8081/hub/api/users/a/activity", "gpu"),
        ),
        (
            {"JUPYTERHUB_API_TOKEN": "tok-SECRET", "JUPYTERHUB_API_URL": "http://hub:8081/hub/api"},
            None,
        ),  # no user
    ],
)
def test_what_counts_as_a_hub_single_user_server(env, expected):
    found = hubmod.HubEnv.from_environ(env)
    assert (None if found is None else (found.activity_url, found.server_name)) == expected
    if found is not None:
        assert "tok-SECRET" not in repr(found)


def test_the_activity_body_is_the_single_user_extensions():
    body = hubmod.activity_body("gpu")
    assert (
        set(body) == {"last_activity", "servers"}
        and body["servers"]["gpu"]["last_activity"] == (body["last_activity"])
    )
    assert body["last_activity"].endswith("Z")
    from datetime import datetime

    from jupyterhub.utils import isoformat  # the hub's own writer parses back the same instant

    parsed = datetime.fromisoformat(body["last_activity"].replace("Z", "+00:00"))
    assert isoformat(parsed) == body["last_activity"]


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "1e9"])
def test_a_bad_activity_interval_is_a_clear_error(raw):
    with pytest.raises(ValueError, match=r"OPENRL_HUB_ACTIVITY_INTERVAL_S must be .* between 0.2 and 86400"):
        hubmod.interval_s({"OPENRL_HUB_ACTIVITY_INTERVAL_S": raw})
    assert hubmod.interval_s({}) == 60.0


def test_failed_reports_are_logged_once_and_the_reporter_ends_with_the_runs(caplog):
    dead = f"http://127.0.0.1:{free_port()}/hub/api/users/alice/activity"  # nothing listens
    active = threading.Event()
    active.set()
    reporter = hubmod.ActivityReporter(
        hubmod.HubEnv(dead, "alice", "", "secret-token"), active.is_set, interval=0.2, timeout_s=2
    )
    with caplog.at_level(logging.WARNING, logger="openrl_jupyter"):
        assert reporter.ensure() and not reporter.ensure()  # one thread at a time
        deadline = time.monotonic() + 30
        while reporter.failures < 3:
            assert time.monotonic() < deadline, reporter.failures
            time.sleep(0.05)
        active.clear()  # the runs ended: the thread ends
        while reporter.running:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    warnings = [r.getMessage() for r in caplog.records if "activity" in r.getMessage()]
    assert len(warnings) == 1 and dead in warnings[0] and "secret-token" not in warnings[0], warnings
    assert reporter.reports == 0
    active.set()
    assert reporter.ensure()  # a new run starts it again
    reporter.close()


def test_the_hub_module_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import openrl_jupyter.hub, openrl_jupyter.session, openrl_jupyter.magics\n"
        "print('ok', 'torch' in sys.modules and sys.modules['torch'] is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok False", out.stderr


def test_a_minted_keys_repr_hides_the_key():
    key = sess.MintedKey.from_reply(
        {"id": "k1", "key": "tml-very-secret-0000", "tenant": "hub:alice", "name": "sdk", "created": 1.0}
    )
    assert "very-secret" not in repr(key) and "very-secret" not in repr([key])
    assert str(key.key) == "tml-very-secret-0000"
    with pytest.raises(sess.OpenRLError, match="minted no tml- key"):
        sess.MintedKey.from_reply({"id": "k1", "key": "not-a-tinker-key"})


def test_the_token_verb_tells_misuse_and_an_api_key_user_in_one_line(server, clean_env):
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from tests.conftest import ALICE_KEY

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "openrl_jupyter")
    clean_env.delenv("TINKER_API_KEY", raising=False)
    clean_env.setenv("OPENRL_TOKEN", ALICE_KEY)

    def one_line(source: str) -> str:
        with capture_output() as out:
            result = shell.run_cell(source, store_history=False)
        text = (out.stdout + out.stderr).strip()
        assert not result.success and "Traceback" not in text and ALICE_KEY not in text, text
        assert len(text.splitlines()) == 1, text
        return text

    try:
        assert shell.run_cell(f"%openrl connect {server.url}", store_history=False).success
        # an API key cannot mint: the service asks for the JupyterHub token, nothing is exported
        assert "JupyterHub" in one_line("%openrl token --name x")
        assert "TINKER_API_KEY" not in os.environ
        assert "give the id" in one_line("%openrl token revoke")
        assert "takes no id" in one_line("%openrl token list k1")
        assert "mint|list|revoke" in one_line("%openrl token k1")
    finally:
        shell.run_line_magic("unload_ext", "openrl_jupyter")
