"""Auth and tenancy: API keys, per-tenant objects, Host/Origin checks, no CORS, and the CLI's key handling.

* Keys look like ``tml-…`` (the Tinker SDK refuses anything else) and travel as ``X-API-Key`` or
  ``Authorization: Bearer``; every route but the health checks answers 401 without a valid one.
* Runs, samplers, checkpoints, futures and sessions belong to a tenant: another tenant gets the same
  404 as for an id that never existed.
* A foreign Host (DNS rebinding) or a foreign Origin (a web page) is refused; no CORS headers, ever.
"""

from __future__ import annotations

import re
import stat
import subprocess
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
import tinker

from openrl_service.api import proto
from tests._support.raw import result
from tests._support.serve import cli, serving
from tests.conftest import ALICE_KEY, BOB_KEY, TINY

PROTO = "application/x-protobuf"
PUBLIC = {"/healthz", "/readyz", "/api/v1/healthz"}
SIGNED = ("/api/v1/downloads/", "/api/v1/uploads/")  # signed links: their own authorisation
KEY_OPTIONAL = {"/metrics"}  # Prometheus scrapes: no key → aggregates only (test_telemetry.py)


# -- helpers ----------------------------------------------------------------------------------------------
def ok_result(client: httpx.Client, resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    out = result(client, resp.json()["request_id"])
    assert "error" not in out, out
    return out


def fb_body(model_id: str, seq_id: int) -> bytes:
    msg = proto.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array([11, 12, 13, 14], dtype="<i4").tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.dense = proto.DTYPE_INT64, np.array([12, 13, 14, 15], dtype="<i8").tobytes()
    t.shape.append(4)
    return msg.SerializeToString()


def new_session(client: httpx.Client) -> str:
    r = client.post("/api/v1/create_session", json={})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def assert_no_cors(resp: httpx.Response) -> None:
    cors = [h for h in resp.headers if h.lower().startswith("access-control-")]
    assert cors == [], (resp.status_code, dict(resp.headers))


@dataclass
class World:
    """Alice's objects: a session, a run with history, a sampler, two checkpoints and a future."""

    session_id: str
    model_id: str
    sampler_id: str
    request_id: str
    weights_path: str
    sampler_path: str
    seq: int
    counters: dict = field(default_factory=lambda: {"model": 1, "sampler": 1})

    def next(self, kind: str) -> int:
        self.counters[kind] += 1
        return self.counters[kind]


@pytest.fixture(scope="module")
def alice_world(server):
    with server.client(ALICE_KEY) as c:
        sid = new_session(c)
        r = c.post(
            "/api/v1/create_model",
            json={"session_id": sid, "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 8}},
        )
        model_id = ok_result(c, r)["model_id"]
        fb = c.post("/api/v1/forward_backward", content=fb_body(model_id, 1), headers={"Content-Type": PROTO})
        ok_result(c, fb)
        r = c.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 2, "path": "alice-ck"})
        weights_path = ok_result(c, r)["path"]
        r = c.post(
            "/api/v1/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 3, "path": "alice-sw"}
        )
        sampler_path = ok_result(c, r)["path"]
        r = c.post(
            "/api/v1/create_sampling_session",
            json={"session_id": sid, "sampling_session_seq_id": 0, "base_model": TINY},
        )
        sampler_id = r.json()["sampling_session_id"]
        yield World(sid, model_id, sampler_id, fb.json()["request_id"], weights_path, sampler_path, seq=3)
        c.post(f"/api/v1/sessions/{sid}/finish", json={})


@pytest.fixture(scope="module")
def bob_session(server):
    with server.client(BOB_KEY) as c:
        sid = new_session(c)
        yield sid
        c.post(f"/api/v1/sessions/{sid}/finish", json={})


# -- keys ---------------------------------------------------------------------------------------------------
def test_every_route_but_health_needs_a_key(server):
    """Walks the live app's own route table, so a route added later is covered too."""
    app = server.server.config.app
    routes = [(m.upper(), p) for p, ms in app.openapi()["paths"].items() for m in ms]
    routes += [
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
        ("GET", "/redoc"),
        ("POST", "/api/v1/no_such_route"),
    ]
    assert ("POST", "/api/v1/forward_backward") in routes
    unprotected = []
    with server.client(None) as anon, server.client("tml-wrong-0123456789abcdef") as wrong:
        for method, path in routes:
            url = re.sub(r"\{[^}]+\}", "x", path)
            for who, c in (("missing", anon), ("wrong", wrong)):
                r = c.request(method, url, json={} if method == "POST" else None)
                if path.startswith(SIGNED):
                    # Signed download and upload links carry their own authorisation: a forged one is unknown.
                    if r.status_code != 404 or " link" not in r.json()["error"]:
                        unprotected.append(
                            f"{method} {path} ({who} key): forged link answered {r.status_code}"
                        )
                elif path in PUBLIC:
                    if r.status_code != 200:
                        unprotected.append(
                            f"{method} {path} ({who} key): public route answered {r.status_code}"
                        )
                elif path in KEY_OPTIONAL and who == "missing":
                    if r.status_code != 200:
                        unprotected.append(f"{method} {path} (no key): answered {r.status_code}")
                elif r.status_code != 401:
                    unprotected.append(f"{method} {path} ({who} key): {r.status_code}")
                else:
                    error = r.json()["error"]
                    if isinstance(error, dict):  # the OpenAI-compatible routes answer in OpenAI's shape
                        assert error["type"] == "authentication_error", (path, error)
                        error = error["message"]
                    if who not in error or "X-API-Key" not in error:
                        unprotected.append(f"{method} {path}: 401 message {error!r}")
    assert unprotected == []


def test_missing_key_is_a_401_that_says_how_to_send_one(server):
    with server.client(None) as c:
        r = c.post("/api/v1/create_session", json={})
    assert r.status_code == 401
    body = r.json()
    assert body["category"] == "user"
    assert "missing API key" in body["error"]
    assert "X-API-Key" in body["error"] and "Authorization: Bearer" in body["error"]


@pytest.mark.parametrize(
    "headers",
    [
        {"X-API-Key": "tml-wrong-0123456789abcdef"},
        {"X-API-Key": ALICE_KEY[:-1]},  # a prefix of a real key
        {"X-API-Key": ALICE_KEY + "0"},
        {"Authorization": "Bearer tml-wrong-0123456789abcdef"},
        {"Authorization": f"Basic {ALICE_KEY}"},
    ],
    ids=["wrong", "prefix", "extended", "bearer-wrong", "basic-scheme"],
)
def test_wrong_key_is_a_401(server, headers):
    with httpx.Client(base_url=server.url, headers=headers) as c:
        r = c.get("/api/v1/get_server_capabilities")
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert "API key" in error
    sent = next(iter(headers.values())).split(" ")[-1]
    assert sent not in error and sent[4:] not in error  # what was sent is described, never echoed
    if "X-API-Key" in headers:
        assert error.startswith("wrong API key: the X-API-Key header holds a tml- key of"), error
    elif headers["Authorization"].startswith("Bearer"):
        assert error.startswith("wrong API key: the Authorization: Bearer header holds"), error
    else:  # the header was sent, in a form that carries no key: say so, not "wrong key"
        assert "the Authorization header is not 'Bearer <key>' (its scheme is 'Basic')" in error, error
    assert "TINKER_API_KEY or OPENRL_TOKEN" in error or "Bearer <key>" in error


def test_bearer_token_is_the_same_tenant_as_x_api_key(server):
    with (
        server.client(ALICE_KEY) as by_header,
        httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {ALICE_KEY}"}, timeout=60
        ) as by_bearer,
    ):
        assert by_bearer.get("/api/v1/get_server_capabilities").status_code == 200
        sid = new_session(by_header)
        r = by_bearer.post("/api/v1/session_heartbeat", json={"session_id": sid})
        assert r.status_code == 200, r.text  # Alice's session, reached with Alice's bearer token
        by_bearer.post(f"/api/v1/sessions/{sid}/finish", json={})


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_health_routes_need_no_key(server, path):
    r = httpx.get(f"{server.url}{path}")
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("ok", "ready")


def test_sdk_with_a_wrong_key_fails_with_an_authentication_error(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key="tml-not-a-real-key-0123456789")
    with pytest.raises(tinker.AuthenticationError):
        sc.create_lora_training_client(base_model=TINY, rank=8).result()


# -- tenancy: Bob gets 404 on everything of Alice's --------------------------------------------------------
# Each case builds the request from Alice's objects, the caller's own session and a seq id. Bob's attempt
# must be a 404; the same request from Alice must then succeed (so the 404 is about ownership alone).
CASES = {
    "get_info": lambda w, sid, seq: ("POST", "/api/v1/get_info", {"json": {"model_id": w.model_id}}),
    "forward_backward": lambda w, sid, seq: (
        "POST",
        "/api/v1/forward_backward",
        {"content": fb_body(w.model_id, seq), "headers": {"Content-Type": PROTO}},
    ),
    "optim_step": lambda w, sid, seq: (
        "POST",
        "/api/v1/optim_step",
        {"json": {"model_id": w.model_id, "seq_id": seq, "adam_params": {"learning_rate": 1e-4}}},
    ),
    "save_weights": lambda w, sid, seq: (
        "POST",
        "/api/v1/save_weights",
        {"json": {"model_id": w.model_id, "seq_id": seq, "path": f"ck-{seq}"}},
    ),
    "save_weights_for_sampler": lambda w, sid, seq: (
        "POST",
        "/api/v1/save_weights_for_sampler",
        {"json": {"model_id": w.model_id, "seq_id": seq, "path": f"sw-{seq}"}},
    ),
    "load_state": lambda w, sid, seq: (
        "POST",
        "/api/v1/load_weights",
        {"json": {"model_id": w.model_id, "seq_id": seq, "path": w.weights_path, "optimizer": True}},
    ),
    "get_sampler": lambda w, sid, seq: ("GET", f"/api/v1/samplers/{w.sampler_id}", {}),
    "asample": lambda w, sid, seq: (
        "POST",
        "/api/v1/asample",
        {
            "json": {
                "sampling_session_id": w.sampler_id,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [11, 12]}]},
                "sampling_params": {"max_tokens": 2},
            }
        },
    ),
    "create_from_state": lambda w, sid, seq: (
        "POST",
        "/api/v1/load_weights",
        {
            "json": {
                "session_id": sid,
                "model_seq_id": w.next("model"),
                "path": w.weights_path,
                "optimizer": True,
            }
        },
    ),
    "sampler_from_checkpoint": lambda w, sid, seq: (
        "POST",
        "/api/v1/create_sampling_session",
        {
            "json": {
                "session_id": sid,
                "sampling_session_seq_id": w.next("sampler"),
                "model_path": w.sampler_path,
            }
        },
    ),
    "retrieve_future": lambda w, sid, seq: (
        "POST",
        "/api/v1/retrieve_future",
        {"json": {"request_id": w.request_id}},
    ),
    "create_model_in_session": lambda w, sid, seq: (
        "POST",
        "/api/v1/create_model",
        {"json": {"session_id": w.session_id, "model_seq_id": w.next("model"), "lora_config": {"rank": 4}}},
    ),
    "sampler_in_session": lambda w, sid, seq: (
        "POST",
        "/api/v1/create_sampling_session",
        {
            "json": {
                "session_id": w.session_id,
                "sampling_session_seq_id": w.next("sampler"),
                "base_model": TINY,
            }
        },
    ),
    "heartbeat": lambda w, sid, seq: (
        "POST",
        "/api/v1/session_heartbeat",
        {"json": {"session_id": w.session_id}},
    ),
    "training_run": lambda w, sid, seq: ("GET", f"/api/v1/training_runs/{w.model_id}", {}),
    "checkpoints": lambda w, sid, seq: ("GET", f"/api/v1/training_runs/{w.model_id}/checkpoints", {}),
}


SEQ_ORDERED = {"forward_backward", "optim_step", "save_weights", "save_weights_for_sampler", "load_state"}


@pytest.mark.parametrize("case", CASES)
def test_another_tenant_gets_404_on_alices_objects(server, alice_world, bob_session, case):
    w = alice_world
    with server.client(BOB_KEY) as bob:
        method, path, kw = CASES[case](w, bob_session, w.seq + 1)  # Alice's next slot: Bob must not take it
        r = bob.request(method, path, **kw)
        assert r.status_code == 404, (r.status_code, r.text)
        assert r.json()["category"] == "user"
        assert re.search(r"unknown|not found", r.json()["error"]), r.json()
    with server.client(ALICE_KEY) as alice:
        method, path, kw = CASES[case](w, w.session_id, w.seq + 1)
        r = alice.request(method, path, **kw)
        if case in SEQ_ORDERED:
            w.seq += 1
        assert r.status_code == 200, (r.status_code, r.text)
        if "request_id" in r.json():
            ok_result(alice, r)


def test_another_tenant_cannot_finish_alices_session(server, alice_world):
    with server.client(BOB_KEY) as bob:
        r = bob.post(
            f"/api/v1/sessions/{alice_world.session_id}/finish", json={"reason": {"type": "success"}}
        )
        assert r.status_code == 404, r.text
    with server.client(ALICE_KEY) as alice:
        r = alice.post("/api/v1/session_heartbeat", json={"session_id": alice_world.session_id})
        assert r.status_code == 200, r.text  # still alive
        assert alice.post("/api/v1/get_info", json={"model_id": alice_world.model_id}).status_code == 200


def test_foreign_ids_look_exactly_like_unknown_ones(server, alice_world):
    """Bob cannot probe whether an id exists: a foreign id and a made-up one get the same answer."""
    fake_id = "s0000000000000000:train:0"
    with server.client(BOB_KEY) as bob:
        real = bob.post("/api/v1/get_info", json={"model_id": alice_world.model_id})
        fake = bob.post("/api/v1/get_info", json={"model_id": fake_id})
        assert real.status_code == fake.status_code == 404
        assert real.json()["error"].replace(alice_world.model_id, "ID") == fake.json()["error"].replace(
            fake_id, "ID"
        )
        fake_path = alice_world.weights_path.replace(alice_world.model_id, fake_id)
        bob_sid = new_session(bob)
        answers = []
        for path in (alice_world.weights_path, fake_path):
            r = bob.post(
                "/api/v1/load_weights",
                json={"session_id": bob_sid, "model_seq_id": 0, "path": path, "optimizer": False},
            )
            answers.append((r.status_code, r.json()["error"].replace(path, "PATH")))
        assert answers[0] == answers[1]
        bob.post(f"/api/v1/sessions/{bob_sid}/finish", json={})


def test_sdk_user_of_another_tenant_cannot_load_alices_checkpoint(server, alice_world):
    sc = tinker.ServiceClient(base_url=server.url, api_key=BOB_KEY)
    try:
        with pytest.raises(tinker.NotFoundError):
            sc.create_training_client_from_state(alice_world.weights_path).result()
        with pytest.raises(tinker.NotFoundError):
            sc.create_sampling_client(model_path=alice_world.sampler_path).result()
    finally:
        sc.close("success").result()


def test_path_traversal_in_a_run_id_does_not_reach_another_tenant(server, alice_world):
    with server.client(BOB_KEY) as bob:
        for run_id in (
            f"..%2F..%2Falice%2Fruns%2F{alice_world.model_id}",
            f"..%2Falice%2Fruns%2F{alice_world.model_id}",
            "..",
        ):
            r = bob.get(f"/api/v1/training_runs/{run_id}")
            assert r.status_code == 404, (run_id, r.status_code, r.text)


# -- Host and Origin; no CORS -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:80", "127.0.0.1.evil.example", "localhost.evil.example:1234", ""]
)
@pytest.mark.parametrize("path", ["/api/v1/get_server_capabilities", "/api/v1/sessions"])
def test_foreign_host_header_is_refused_even_with_a_valid_key(server, host, path):
    """A DNS-rebinding page reaches 127.0.0.1 under its own name; the Host header gives it away."""
    with server.client(ALICE_KEY) as c:
        r = c.get(path, headers={"Host": host})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert "Host" in r.json()["error"] and "--allowed-host" in r.json()["error"]
    assert_no_cors(r)


def test_loopback_host_names_are_accepted(server):
    port = server.url.rsplit(":", 1)[1]
    with server.client(ALICE_KEY) as c:
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
            assert c.get("/api/v1/get_server_capabilities", headers={"Host": host}).status_code == 200, host


def test_allowed_host_setting_adds_a_name(make_server):
    live = make_server(allowed_hosts=["trainer.lan"])
    with live.client(ALICE_KEY) as c:
        assert (
            c.get("/api/v1/get_server_capabilities", headers={"Host": "trainer.lan:8000"}).status_code == 200
        )
        assert c.get("/api/v1/get_server_capabilities", headers={"Host": "evil.example"}).status_code == 400


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/api/v1/healthz", "/metrics"])
def test_probes_and_scrapes_answer_any_host(make_server, path):
    """kubelet probes and Prometheus scrapes name the pod IP: with --allowed-host on a public bind
    they still get an answer (no tenant's data is behind these paths), while every other route is
    still refused under a foreign Host."""
    live = make_server(host="0.0.0.0", allowed_hosts=["trainer.example"])
    with live.client(None) as c:
        r = c.get(path, headers={"Host": "10.1.2.3:8000"})
        assert r.status_code == 200, (path, r.status_code, r.text)
        refused = c.get(
            "/api/v1/get_server_capabilities", headers={"Host": "10.1.2.3:8000", "X-API-Key": ALICE_KEY}
        )
        assert refused.status_code == 400 and "--allowed-host" in refused.json()["error"]


@pytest.mark.parametrize(
    "origin", ["http://evil.example", "https://127.0.0.1.evil.example", "http://localhost.evil.example:8000"]
)
def test_foreign_origin_is_a_403_even_with_a_valid_key(server, origin):
    """A web page the user visits must not be able to drive the service from the browser."""
    with server.client(ALICE_KEY) as c:
        r = c.post("/api/v1/create_session", json={}, headers={"Origin": origin})
    assert r.status_code == 403, r.text
    assert origin in r.json()["error"]
    assert_no_cors(r)


def test_same_origin_is_accepted(server):
    with server.client(ALICE_KEY) as c:
        r = c.get("/api/v1/get_server_capabilities", headers={"Origin": server.url})
    assert r.status_code == 200, r.text
    assert_no_cors(r)


def test_no_cors_headers_anywhere(server):
    """Not on answers, not on errors, not on a preflight: browsers never get permission to read."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x-api-key"}
    with server.client(ALICE_KEY) as c, server.client(None) as anon:
        responses = [
            c.get("/api/v1/get_server_capabilities", headers={"Origin": server.url}),
            c.post("/api/v1/create_session", json={}, headers={"Origin": "http://evil.example"}),
            anon.get("/readyz", headers={"Origin": server.url}),
            anon.post("/api/v1/create_session", json={}, headers={"Origin": server.url}),
            anon.options("/api/v1/create_session", headers={"Origin": "http://evil.example", **preflight}),
            anon.options("/api/v1/create_session", headers={"Origin": server.url, **preflight}),
            c.options("/api/v1/asample", headers={"Origin": "http://evil.example", **preflight}),
        ]
    for r in responses:
        assert_no_cors(r)
    assert responses[4].status_code == 403  # the foreign preflight is refused outright
    assert all(r.status_code != 200 for r in responses[4:])


def test_no_auth_mode_needs_no_key(make_server):
    live = make_server(no_auth=True)
    with live.client(None) as c:
        assert c.get("/api/v1/get_server_capabilities").status_code == 200
        sid = new_session(c)
        r = c.post(
            "/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "lora_config": {"rank": 4}}
        )
        model_id = ok_result(c, r)["model_id"]
        ok_result(
            c,
            c.post("/api/v1/forward_backward", content=fb_body(model_id, 1), headers={"Content-Type": PROTO}),
        )


def test_no_auth_mode_still_refuses_foreign_hosts_and_origins(make_server):
    live = make_server(no_auth=True)
    with live.client(None) as c:
        assert c.post("/api/v1/create_session", json={}, headers={"Host": "evil.example"}).status_code == 400
        r = c.post("/api/v1/create_session", json={}, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403


def test_no_auth_mode_refuses_an_opaque_null_origin(make_server):
    """Without keys, only the Origin check stops a web page. A sandboxed iframe or a file:// page sends
    ``Origin: null`` and can POST a text/plain body as a "simple" request, with no preflight."""
    live = make_server(no_auth=True)
    with live.client(None) as c:
        r = c.post(
            "/api/v1/create_session", content=b"{}", headers={"Origin": "null", "Content-Type": "text/plain"}
        )
    assert r.status_code == 403, (r.status_code, r.text)


# -- the command line ----------------------------------------------------------------------------------------
def status_with(url: str, key: str | None) -> int:
    headers = {"X-API-Key": key} if key else {}
    return httpx.get(f"{url}/api/v1/get_server_capabilities", headers=headers, timeout=30).status_code


def test_cli_refuses_no_auth_on_a_public_interface(tmp_path):
    argv, env = cli("serve", "--no-auth", "--host", "0.0.0.0", "--data-dir", str(tmp_path))
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "loopback" in proc.stderr
    assert "--insecure" in proc.stderr


def test_cli_refuses_a_key_without_the_tml_prefix(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("carol sk-not-a-tinker-key\n")
    argv, env = cli("serve", "--api-keys-file", str(keys), "--data-dir", str(tmp_path))
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "tml-" in proc.stderr and "carol" in proc.stderr and str(keys) in proc.stderr


def test_cli_without_keys_generates_one_prints_it_and_keeps_it(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    with serving(data, tiny_model_dir) as first:
        key_file = data / "api-key"
        key = key_file.read_text().strip()
        assert key.startswith("tml-")
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert status_with(first.url, key) == 200
        assert status_with(first.url, None) == 401
        assert status_with(first.url, ALICE_KEY) == 401
        # The printed key is what a user exports for the unmodified SDK.
        caps = tinker.RestClient(base_url=first.url, api_key=key).get_server_capabilities().result()
        assert [m.model_name for m in caps.supported_models] == [TINY]
    assert f"export TINKER_API_KEY={key}" in first.stdout.splitlines()
    assert f"export TINKER_BASE_URL={first.url}" in first.stdout.splitlines()  # what a notebook reads too
    # A restart reuses the same key: notebooks holding it keep working. It says where the key is, and
    # never prints it again (logs of a long-running service are read by more people than its owner).
    with serving(data, tiny_model_dir) as second:
        assert status_with(second.url, key) == 200
    assert key not in second.stdout
    assert f'export TINKER_BASE_URL={second.url} TINKER_API_KEY="$(cat {key_file})"' in second.stdout


def test_cli_access_log_never_shows_a_download_token(tmp_path, tiny_model_dir):
    """Signed download links authorise by their token alone: the access log names the route, not it."""
    keys = tmp_path / "keys"
    keys.write_text(f"alice {ALICE_KEY}\n")
    data = tmp_path / "data"
    with (
        serving(data, tiny_model_dir, "--api-keys-file", str(keys), "--access-log") as served,
        httpx.Client(base_url=served.url, headers={"X-API-Key": ALICE_KEY}, timeout=30) as c,
    ):
        sid = new_session(c)
        url = c.get(f"/api/v1/sessions/{sid}/trace_export").json()["url"]
        assert httpx.get(url, timeout=30).status_code == 200
    token = url.rsplit("/", 1)[1]
    log = served.stdout + (data / "stderr.log").read_text()  # uvicorn's access log goes to stdout
    assert f"/api/v1/sessions/{sid}/trace_export" in log  # the access log is on
    assert "/api/v1/downloads/" in log
    assert token not in log
    assert token.split(".")[0] not in log  # nor its payload


def test_cli_api_keys_file_gives_each_line_a_tenant(tmp_path, tiny_model_dir):
    keys = tmp_path / "keys"
    keys.write_text("# tenant key\n\ncarol tml-carol-0123456789abcdef\ndan   tml-dan-0123456789abcdef\n")
    data = tmp_path / "data"
    with serving(data, tiny_model_dir, "--api-keys-file", str(keys)) as served:
        url = served.url
        assert status_with(url, "tml-carol-0123456789abcdef") == 200
        assert status_with(url, "tml-dan-0123456789abcdef") == 200
        assert status_with(url, "tml-erin-0123456789abcdef") == 401
        assert_separate_tenants(url, "tml-carol-0123456789abcdef", "tml-dan-0123456789abcdef")
    assert not (data / "api-key").exists()  # configured keys: nothing generated
    assert "TINKER_API_KEY" not in served.stdout


def test_cli_openrl_api_keys_env(tmp_path, tiny_model_dir):
    env = {"OPENRL_API_KEYS": "dave:tml-dave-0123456789abcdef, erin:tml-erin-0123456789abcdef"}
    data = tmp_path / "data"
    with serving(data, tiny_model_dir, env=env) as served:
        url = served.url
        assert status_with(url, "tml-dave-0123456789abcdef") == 200
        assert status_with(url, "tml-erin-0123456789abcdef") == 200
        assert status_with(url, None) == 401
        assert_separate_tenants(url, "tml-dave-0123456789abcdef", "tml-erin-0123456789abcdef")
    assert not (data / "api-key").exists()
    assert "TINKER_API_KEY" not in served.stdout


def assert_separate_tenants(url: str, key_a: str, key_b: str) -> None:
    with (
        httpx.Client(base_url=url, headers={"X-API-Key": key_a}) as a,
        httpx.Client(base_url=url, headers={"X-API-Key": key_b}) as b,
    ):
        sid = new_session(a)
        assert a.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200
        assert b.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 404
