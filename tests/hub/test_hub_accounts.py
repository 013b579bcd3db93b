"""A hub account's lifetime, with a real JupyterHub: the OpenRL service holds a hub token of its own
(the ``openrl`` service's, scope read:users through the chart's role, k8s/jupyterhub/values.yaml) and
re-checks that each minted key's user still exists with the same ``created`` time.

An admin deletes alice through the hub API: within the re-check bound her minted key, her job's key
and her hub token are refused while bob keeps working. The admin creates alice again: the new
account sees none of the old keys, and the old ones stay refused. One hub and one service for the
module (no single-user servers: the users' tokens come from the hub's token API); the tests run in
file order.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from dataclasses import dataclass, field

import httpx
import pytest

from openrl_jupyter.local import free_port
from tests._support import serve
from tests._support.jhub import Hub, HubUnavailable, proxy_command, start_hub, wait_hub

V1 = "/openrl/v1"
RECHECK_S = 2  # OPENRL_HUB_USER_RECHECK_S and --hub-cache-ttl-s
GUARD_S = 60  # hang guard of each wait (the refusals are due after RECHECK_S)


@dataclass
class World:
    hub: Hub
    url: str
    served: serve.Served
    creds: dict[str, str] = field(default_factory=dict, repr=False)
    facts: dict[str, str] = field(default_factory=dict)

    def call(self, cred: str, method: str = "GET", path: str = f"{V1}/runs", **kw) -> httpx.Response:
        return httpx.request(method, f"{self.url}{path}", headers={"X-API-Key": cred}, timeout=60, **kw)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    try:
        proxy_command()
    except HubUnavailable as e:
        pytest.skip(str(e))  # a failure under OPENRL_CI_STRICT=1
    root = tmp_path_factory.mktemp("jhub-accounts")
    service_token = secrets.token_hex(32)  # what the admin puts in the Secret and the chart values
    hub = start_hub(root / "hub", users=("alice", "bob"), service_tokens={"openrl": service_token})
    served = None
    try:
        (root / "data").mkdir()
        port = free_port()
        served = serve.start(
            root / "data",
            tiny_model_dir,
            "--hub-api-url",
            hub.api_url,
            "--hub-cache-ttl-s",
            str(RECHECK_S),
            env={"JUPYTERHUB_API_TOKEN": service_token, "OPENRL_HUB_USER_RECHECK_S": str(RECHECK_S)},
            port=port,
        )
        wait_hub(hub)
        serve.wait_ready(served)
        yield World(hub, f"http://127.0.0.1:{port}", served)
    finally:
        if served is not None and served.proc.poll() is None:
            served.proc.terminate()
            serve.finish(served, 30)
        hub.stop()


def error(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error"))
    except ValueError:
        return r.text


def ok(r: httpx.Response, status: int = 200) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()


def job_body(name: str) -> dict:
    data = b"opaque payload"
    return {
        "name": name,
        "kind": "run",
        "where": "local",
        "payload": base64.b64encode(data).decode(),
        "payload_sha256": hashlib.sha256(data).hexdigest(),
        "meta": {"steps": 1},
    }


def test_a_deleted_users_key_job_key_and_token_stop_working_while_bob_keeps_working(world):
    hub, w = world.hub, world
    _, alice = hub.new_token("alice")
    _, bob = hub.new_token("bob")
    a_key = ok(w.call(alice, "POST", "/api/v1/keys", json={"name": "sdk"}), 201)["key"]
    b_key = ok(w.call(bob, "POST", "/api/v1/keys", json={"name": "sdk"}), 201)["key"]
    run_id = ok(w.call(a_key, "POST", f"{V1}/runs", json={"name": "alice-run", "seed": 0}), 201)["run_id"]
    path = ok(w.call(a_key, "POST", f"{V1}/runs/{run_id}/checkpoints", json={"name": "ck"}), 201)["path"]
    job_key = ok(w.call(a_key, "POST", f"{V1}/jobs", json=job_body("alice-job")), 201)["key"]
    for cred in (a_key, job_key, alice, b_key, bob):
        ok(w.call(cred))
    w.creds.update(alice=alice, a_key=a_key, job_key=job_key, bob=bob, b_key=b_key)
    w.facts.update(run_id=run_id, path=path)

    hub.delete_user("alice")
    deadline = time.monotonic() + GUARD_S
    left = {"minted key": a_key, "job key": job_key, "hub token": alice}
    refusals = {}
    while left:
        assert time.monotonic() < deadline, f"still working after alice was deleted: {sorted(left)}"
        for what, cred in list(left.items()):
            r = w.call(cred)
            if r.status_code != 200:
                assert r.status_code == 401, (what, r.status_code, r.text)
                refusals[what] = error(r)
                del left[what]
        for cred in (b_key, bob):
            ok(w.call(cred))
        time.sleep(0.2)
    assert "the JupyterHub user 'alice' no longer exists" in refusals["minted key"], refusals
    assert "the JupyterHub user 'alice' no longer exists" in refusals["job key"], refusals
    assert ok(w.call(b_key))["runs"] == []  # bob never saw alice's run


def test_alice_created_again_inherits_no_keys_and_the_old_ones_stay_refused(world):
    hub, w = world.hub, world
    assert w.creds, "runs after the deletion test"
    hub.create_user("alice")
    _, again = hub.new_token("alice")
    assert ok(w.call(again, path="/api/v1/keys")) == {"keys": []}
    for cred, says in (
        (w.creds["a_key"], "the JupyterHub user 'alice' was deleted and created again"),
        (w.creds["job_key"], "an earlier JupyterHub account named 'alice'"),
    ):
        r = w.call(cred)
        assert r.status_code == 401 and says in error(r), r.text
    assert w.call(w.creds["alice"]).status_code == 401  # the old hub token died with the account
    new_key = ok(w.call(again, "POST", "/api/v1/keys", json={"name": "new"}), 201)["key"]
    ok(w.call(new_key))
    ok(w.call(w.creds["b_key"]))
    w.creds["again"] = again


def test_alice_created_again_sees_none_of_the_old_runs_or_checkpoints(world):
    w = world
    again = w.creds["again"]
    assert ok(w.call(again))["runs"] == []
    assert w.call(again, path=f"{V1}/runs/{w.facts['run_id']}").status_code == 404
    listed = ok(w.call(again, path="/api/v1/checkpoints"))
    assert w.facts["path"] not in str(listed), listed
