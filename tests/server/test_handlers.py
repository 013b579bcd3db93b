"""The server extension's routes against a real jupyter server and a real openrl service: auth and
XSRF, the relays (health, runs, one run, events) for the configured tenant, errors that name the
service, and a canary key that never reaches the browser or the log."""

from __future__ import annotations

import json
import time
from urllib.parse import quote

import httpx
import pytest

from tests.conftest import ALICE_KEY, BOB_KEY

ROUTES = ["openrl/health", "openrl/runs", "openrl/runs/some-run", "openrl/events"]
CONTROL = "openrl/runs/some-run/control"


@pytest.fixture(scope="module")
def runs(server):
    """One run of alice's (with two metrics rows) and one of bob's, made on the service directly."""
    made = {}
    for who, key in (("alice", ALICE_KEY), ("bob", BOB_KEY)):
        with server.client(key) as http:
            r = http.post("/openrl/v1/runs", json={"name": f"panel-{who}", "rank": 4})
            assert r.status_code == 201, r.text
            made[who] = r.json()["run_id"]
    with server.client(ALICE_KEY) as http:
        for step, reward in ((1, 0.25), (2, 0.75)):
            r = http.post(
                f"/openrl/v1/runs/{made['alice']}/metrics", json={"step": step, "reward_mean": reward}
            )
            assert r.status_code == 201, r.text
    yield made
    for who, key in (("alice", ALICE_KEY), ("bob", BOB_KEY)):
        with server.client(key) as http:
            http.delete(f"/openrl/v1/runs/{made[who]}")


class Seen:
    """Everything the browser got back: bodies and headers, to scan for the key."""

    def __init__(self):
        self.chunks: list[str] = []

    def add(self, response: httpx.Response, body: str | None = None) -> httpx.Response:
        self.chunks.append(json.dumps(dict(response.headers)))
        self.chunks.append(response.text if body is None else body)
        return response

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.chunks)

    def contains(self, secret: str) -> bool:
        return any(secret in c for c in self.chunks)


@pytest.fixture(scope="module")
def seen():
    return Seen()


def read_events(http: httpx.Client, path: str, n: int) -> tuple[httpx.Response, list[dict], str]:
    """The first ``n`` events of an SSE stream: (response, [{"event", "data"}], raw text)."""
    events, raw, current = [], [], {}
    with http.stream("GET", path) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            raw.append(line)
            if line.startswith("event:"):
                current["event"] = line[6:].strip()
            elif line.startswith("data:"):
                current["data"] = json.loads(line[5:])
            elif not line and current:
                events.append(current)
                current = {}
                if len(events) >= n:
                    break
    return response, events, "\n".join(raw)


def test_every_route_refuses_a_request_without_the_servers_token(alice_jupyter):
    with alice_jupyter.client(auth=False) as anon:
        for path in ROUTES:
            assert anon.get(path).status_code == 403, path
            r = anon.get(path, headers={"Authorization": "token not-the-token"})
            assert r.status_code == 403, path
        r = anon.post(CONTROL, json={"action": "stop"})
        assert r.status_code == 403
        assert ALICE_KEY not in r.text
    # started with allow_unauthenticated_access=False: jupyter_server lists unauthenticated endpoints
    assert "registered for /user/alice/openrl" not in alice_jupyter.log()


def test_a_cookie_authenticated_post_needs_the_xsrf_token(alice_jupyter, runs, server):
    with alice_jupyter.client() as http:  # a token-authenticated request sets the login cookie
        assert http.get("openrl/health").status_code == 200
        cookies = httpx.Cookies(http.cookies)
    with alice_jupyter.client(auth=False, cookies=cookies) as browser:
        assert browser.get("openrl/runs").status_code == 200  # the cookie alone authenticates reads
        r = browser.post(f"openrl/runs/{runs['alice']}/control", json={"action": "stop"})
        assert r.status_code == 403, r.text
        assert "xsrf" in r.text.lower()
        browser.get("lab")  # a page sets the _xsrf cookie, as in a browser
        xsrf = browser.cookies.get("_xsrf")
        assert xsrf, "the lab page set no _xsrf cookie"
        r = browser.post(
            f"openrl/runs/{runs['alice']}/control",
            json={"action": "explode"},
            headers={"X-XSRFToken": xsrf},
        )
        assert r.status_code == 400, r.text  # past auth and XSRF: the handler checked the body
        assert r.json() == {"error": "action must be one of pause, resume, stop; got 'explode'"}


def test_health_reports_the_configured_service(alice_jupyter, server, seen):
    with alice_jupyter.client() as http:
        health = seen.add(http.get("openrl/health")).json()
    assert health["connected"] is True, health
    assert health["error"] is None
    assert health["url"] == server.url
    assert health["source"] == "OPENRL_URL"
    assert health["model"] == "openrl/tiny"
    assert health["models"] == ["openrl/tiny"]
    assert health["health"] == "ready"
    assert 0.0 <= health["device"]["utilization"] <= 1.0
    assert health["device"]["label"] == "engine busy"  # no GPU here: never called GPU utilisation
    assert health["refresh_s"] == 2.0


def test_runs_are_the_configured_tenants(alice_jupyter, server, runs, seen):
    with alice_jupyter.client() as http:
        listed = seen.add(http.get("openrl/runs")).json()["runs"]
    with server.client(ALICE_KEY) as direct:
        own = direct.get("/openrl/v1/runs", params={"include": "all"}).json()["runs"]
    ids = {r["run_id"] for r in listed}
    assert runs["alice"] in ids
    assert runs["bob"] not in ids  # bob's run is another tenant's
    assert ids == {r["run_id"] for r in own}
    mine = next(r for r in listed if r["run_id"] == runs["alice"])
    assert mine["name"] == "panel-alice"
    assert mine["base_model"] == "openrl/tiny"


def test_one_run_with_its_metrics_history(alice_jupyter, runs, server, seen):
    with alice_jupyter.client() as http:
        r = seen.add(http.get(f"openrl/runs/{runs['alice']}"))
        assert r.status_code == 200, r.text
        detail = r.json()
        other = seen.add(http.get(f"openrl/runs/{runs['bob']}"))
        encoded = http.get("openrl/runs/" + quote(runs["alice"], safe=""))  # ":" as %3A, as a browser may
    assert detail["run"]["run_id"] == runs["alice"]
    assert detail["run"]["name"] == "panel-alice"
    assert [(m["step"], m["reward_mean"]) for m in detail["metrics"]] == [(1, 0.25), (2, 0.75)]
    assert detail["samples"] == []
    assert ":" in runs["alice"]  # the service's ids (s…:train:0) reach the route encoded or not
    assert encoded.status_code == 200, encoded.text
    assert encoded.json()["run"]["run_id"] == runs["alice"]
    assert encoded.json()["metrics"] == detail["metrics"]
    assert other.status_code == 404  # another tenant's run is not found, as on the service
    assert other.json()["error"].startswith(f"openrl service at {server.url}: ")


def test_the_event_stream_is_relayed_and_closed_with_the_browser(alice_jupyter, seen):
    closed = "openrl: event stream from"
    before = alice_jupyter.log().count(closed)
    with alice_jupyter.client() as http:
        response, events, raw = read_events(http, "openrl/events", 2)
    seen.add(response, raw)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert [e["event"] for e in events] == ["tick", "tick"]
    tick = events[0]["data"]
    assert tick["type"] == "tick"
    assert tick["utilisation"]["label"] == "engine busy"
    assert events[1]["data"]["time"] > tick["time"]  # live ticks, not a replay
    deadline = time.monotonic() + 20  # the relay notices at its next write (the service ticks each second)
    while alice_jupyter.log().count(closed) == before:
        assert time.monotonic() < deadline, "the relay kept the service's stream open after the browser left"
        time.sleep(0.2)


def test_the_key_reaches_neither_the_browser_nor_the_log(alice_jupyter, server, runs, seen):
    with alice_jupyter.client() as http:
        for path in ("openrl/health", "openrl/runs", f"openrl/runs/{runs['alice']}", "lab", "api/me"):
            r = seen.add(http.get(path))
            assert r.status_code == 200, (path, r.status_code)
        seen.add(http.post(f"openrl/runs/{runs['alice']}/control", json={"action": "nope"}))
    assert seen.size > 2000  # the scan read real bodies: health, runs, metrics, events, the lab page
    assert not seen.contains(ALICE_KEY)
    log = alice_jupyter.log()
    assert f"openrl: service at {server.url} (from OPENRL_URL, key from OPENRL_TOKEN)" in log
    assert ALICE_KEY not in log


def test_config_beats_the_environment_and_a_dead_service_is_named(bad_jupyter, dead_port):
    where = f"openrl service at http://127.0.0.1:{dead_port}"
    with bad_jupyter.client() as http:
        health = http.get("openrl/health")
        listed = http.get("openrl/runs")
        one = http.get("openrl/runs/r1")
        events = http.get("openrl/events")
        control = http.post("openrl/runs/r1/control", json={"action": "pause"})
    assert health.status_code == 200
    assert health.json()["connected"] is False
    assert health.json()["url"] == f"http://127.0.0.1:{dead_port}"  # c.OpenRLServer.url, not $OPENRL_URL
    assert health.json()["error"].startswith(f"{where}: cannot connect")
    for r in (listed, one, events, control):
        assert r.status_code == 503, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"].startswith(f"{where}: cannot connect")
        assert "Traceback" not in r.text
    assert ALICE_KEY not in bad_jupyter.log()


def test_without_a_service_the_panel_is_told_how_to_connect(bare_jupyter):
    with bare_jupyter.client() as http:
        health = http.get("openrl/health")
        listed = http.get("openrl/runs")
    assert health.status_code == 200
    assert health.json()["connected"] is False
    assert health.json()["url"] is None
    assert "%openrl connect --local" in health.json()["error"]
    assert "OPENRL_URL" in health.json()["error"]
    assert listed.status_code == 503
    assert "%openrl connect --local" in listed.json()["error"]


def test_the_panels_polling_does_not_keep_an_idle_server_alive(alice_jupyter, runs):
    """JupyterHub's idle culler reads the server's last activity: a panel left open that polls must not
    count as the user working; pressing pause / resume / stop does."""
    with alice_jupyter.client() as http:
        before = http.get("api/status").json()["last_activity"]
        for path in ("openrl/health", "openrl/runs", f"openrl/runs/{runs['alice']}"):
            assert http.get(path).status_code == 200
        read_events(http, "openrl/events", 1)
        assert http.get("api/status").json()["last_activity"] == before
        http.post(f"openrl/runs/{runs['alice']}/control", json={"action": "nope"})
        assert http.get("api/status").json()["last_activity"] > before
