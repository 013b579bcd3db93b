"""Where the server extension's service and key come from, and how service errors read (no servers)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time

import httpx
import pytest

from openrl_jupyter.local import LocalService, advertise, discovered
from openrl_jupyter.server.connection import ServiceError, Target, refused, resolve
from openrl_jupyter.server.handlers import control_body
from tests.server.conftest import service_stand_in

ENV = {"OPENRL_URL": "http://env:8000", "OPENRL_TOKEN": "tml-env", "JUPYTERHUB_API_TOKEN": "hub-tok"}


def test_configuration_then_environment_then_the_hub_token(tmp_path):
    t = resolve(url="http://cfg:1/", token="tml-cfg", runtime_dir=str(tmp_path), env=ENV)
    assert (t.url, t.token, t.source, t.credential) == ("http://cfg:1", "tml-cfg", "config", "config")
    t = resolve(url="http://cfg:1", token=None, runtime_dir=str(tmp_path), env=ENV)
    assert (t.token, t.credential) == ("tml-env", "OPENRL_TOKEN")
    t = resolve(url=None, token=None, runtime_dir=str(tmp_path), env=ENV)
    assert (t.url, t.token, t.source) == ("http://env:8000", "tml-env", "OPENRL_URL")
    hub = {k: v for k, v in ENV.items() if k != "OPENRL_TOKEN"}
    t = resolve(url=None, token=None, runtime_dir=str(tmp_path), env=hub)
    assert (t.token, t.credential) == ("hub-tok", "hub")
    assert "tml-" not in repr(t) and "hub-tok" not in repr(t)  # the key is never in a repr
    assert resolve(url=None, token=None, runtime_dir=str(tmp_path), env={}) is None


def test_the_lines_serve_prints_point_the_server_too_and_a_tinker_key_goes_only_to_its_url(tmp_path):
    printed = {"TINKER_BASE_URL": "http://127.0.0.1:8000/", "TINKER_API_KEY": "tml-printed"}
    t = resolve(url=None, token=None, runtime_dir=str(tmp_path), env=printed)
    assert (t.url, t.token, t.source, t.credential) == (
        "http://127.0.0.1:8000",
        "tml-printed",
        "TINKER_BASE_URL",
        "TINKER_API_KEY",
    )
    elsewhere = {**printed, "OPENRL_URL": "http://other:9000"}  # a hosted key is not sent elsewhere
    t = resolve(url=None, token=None, runtime_dir=str(tmp_path), env=elsewhere)
    assert (t.url, t.token, t.credential) == ("http://other:9000", None, "none")


def write(folder, name: str, body) -> None:
    (folder / name).write_text(body if isinstance(body, str) else json.dumps(body))


def test_the_newest_live_discovery_file_wins_and_never_gets_the_hub_token(tmp_path, service_pid):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write(tmp_path, "openrl-local-1.json", {"url": "http://old:1", "token": "tml-old", "pid": service_pid})
    old = time.time() - 60
    os.utime(tmp_path / "openrl-local-1.json", (old, old))
    write(tmp_path, "openrl-local-2.json", {"url": "http://new:2", "token": "tml-new", "pid": service_pid})
    write(tmp_path, "openrl-local-3.json", {"url": "http://dead:3", "token": "tml-dead", "pid": dead.pid})
    write(tmp_path, "openrl-local-4.json", "{not json")
    # a pid that is alive but not a service (the kernel died and its pid was reused): stale
    write(tmp_path, "openrl-local-5.json", {"url": "http://reused:5", "token": "tml-r", "pid": os.getpid()})
    hub_only = {"JUPYTERHUB_API_TOKEN": "hub-tok"}
    t = resolve(url=None, token=None, runtime_dir=str(tmp_path), env=hub_only)
    assert (t.url, t.token, t.source) == ("http://new:2", "tml-new", "discovery")
    (tmp_path / "openrl-local-2.json").unlink()
    assert discovered(str(tmp_path))["url"] == "http://old:1"
    (tmp_path / "openrl-local-1.json").unlink()
    assert discovered(str(tmp_path)) is None  # only dead, reused and broken ones are left


def test_advertising_a_service_clears_killed_kernels_files(tmp_path, monkeypatch, service_pid):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write(tmp_path, f"openrl-local-{dead.pid}.json", {"url": "http://dead:3", "token": "t", "pid": dead.pid})
    write(
        tmp_path,
        f"openrl-local-{service_pid}.json",
        {"url": "http://other:4", "token": "t", "pid": service_pid},
    )
    an_hour_ago = time.time() - 3600
    os.utime(tmp_path / f"openrl-local-{service_pid}.json", (an_hour_ago, an_hour_ago))
    proc = service_stand_in()
    try:
        service = LocalService(proc, "http://127.0.0.1:9", str(tmp_path), "tml-k")
        path = advertise(service)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [f"openrl-local-{proc.pid}.json", f"openrl-local-{service_pid}.json"]
        )  # the dead one is gone, the other live service's stays
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert discovered(str(tmp_path))["url"] == "http://127.0.0.1:9"  # the newest
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("status", "body", "expect_status", "expect"),
    [
        (401, {"error": "unknown key"}, 502, "the key was refused (HTTP 401: unknown key)"),
        (302, {}, 502, "redirected to /login"),
        (404, {"error": "unknown run 'x'"}, 404, "unknown run 'x'"),
        (400, {"error": "action must be one of pause, resume, stop"}, 400, "action must be one of"),
        (429, {"error": "queue full"}, 503, "busy or not ready (HTTP 429: queue full)"),
        (500, "<html>Internal</html>", 502, "the service failed (HTTP 500: <html>Internal</html>)"),
    ],
)
def test_service_errors_name_the_service(status, body, expect_status, expect):
    target = Target("http://svc:9", "tml-secret", "config", "config")
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.Response(status, content=content, headers={"location": "/login"})
    err = refused(target, response)
    assert err.status == expect_status
    assert err.message.startswith("openrl service at http://svc:9: ")
    assert expect in err.message
    assert "tml-secret" not in err.message


def test_control_bodies_are_checked_with_the_field_named():
    assert control_body(b'{"action": "stop", "reason": "done"}') == {"action": "stop", "reason": "done"}
    assert control_body(b'{"action": "pause"}') == {"action": "pause"}
    for raw, expect in [
        (b"[1]", "the body must be a JSON object"),
        (b"nope", "the body must be JSON"),
        (b'{"action": "halt"}', "action must be one of pause, resume, stop; got 'halt'"),
        (
            b'{"action": "stop", "reason": "' + b"x" * 201 + b'"}',
            "reason must be a string of 1-200 characters",
        ),
    ]:
        with pytest.raises(ServiceError) as info:
            control_body(raw)
        assert expect in info.value.message


def test_the_extension_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import openrl_jupyter\n"
        "points = openrl_jupyter._jupyter_server_extension_points()\n"
        "assert points[0]['app'].__name__ == 'OpenRLServer', points\n"
        "assert openrl_jupyter._jupyter_labextension_paths()[0]['src'] == 'labextension'\n"
        "print('ok')\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=repo)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_shipped_config_file_enables_the_extension(tmp_path):
    """jupyter-config/server-config/openrl_jupyter.json (installed into jupyter_server_config.d by the
    wheel) is what `jupyter server extension list` reads as enabled, and the extension validates."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    conf = tmp_path / "jupyter_server_config.d"
    conf.mkdir()
    shutil.copy(os.path.join(repo, "jupyter-config", "server-config", "openrl_jupyter.json"), conf)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env.update(JUPYTER_CONFIG_DIR=str(tmp_path), PYTHONPATH=repo, NO_COLOR="1")
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_server", "extension", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=repo,
    )
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)
    ours = text.split(f"Config dir: {tmp_path}", 1)[1].split("Config dir:", 1)[0]
    assert re.search(r"openrl_jupyter\s+enabled", ours), text
    assert re.search(r"openrl_jupyter \S+\s+OK", ours), text


def test_every_route_and_verb_is_authenticated():
    """jupyter_server's own check (what `allow_unauthenticated_access = False` enforces): no method of
    ours lacks @web.authenticated."""
    from jupyter_server.serverapp import ServerWebApplication

    from openrl_jupyter.server.handlers import routes

    table = routes(ext=None)
    assert len(table) == 5
    for pattern, handler, _ in table:
        assert ServerWebApplication._check_handler_auth(None, pattern, handler) == [], pattern
        assert handler.auth_resource == "openrl"
