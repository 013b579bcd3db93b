"""Minted keys live no longer than the hub account they were minted for (tests/_support/jhub.py's
FakeHub, counting; tests/hub/test_hub_accounts.py does the same against a real JupyterHub).

The service holds a hub token of its own (``$JUPYTERHUB_API_TOKEN``, scope read:users) and re-checks,
at most every OPENRL_HUB_USER_RECHECK_S (1 s here, 60 s by default), that the user a key was minted
for still exists with the same ``created`` time. An identity is the name and that time: a deleted
user's minted keys, the keys of their detached jobs and their hub tokens stop working; an account
created again under the same name inherits none of it; a live user's keys keep working; and every
minted key expires after OPENRL_MINTED_KEY_TTL_S.
"""

from __future__ import annotations

import base64
import hashlib
import json
import stat
import time

import httpx
import pytest

from openrl_service.config import tenant_folder
from tests._support.jhub import FakeHub
from tests._support.serve import serving

V1 = "/openrl/v1"
RECHECK_S = 1  # OPENRL_HUB_USER_RECHECK_S and OPENRL_HUB_CACHE_TTL_S here
GUARD_S = 60  # hang guard of each wait: the refusals are due after RECHECK_S


@pytest.fixture
def hub():
    with FakeHub() as h:
        yield h


def serve_with(hub: FakeHub, tmp_path, tiny_model_dir, *, service_token: bool = True, **env: str):
    base = {"OPENRL_HUB_USER_RECHECK_S": str(RECHECK_S), "OPENRL_HUB_CACHE_TTL_S": str(RECHECK_S)}
    if service_token:
        base["JUPYTERHUB_API_TOKEN"] = hub.service_token
    return serving(tmp_path / "data", tiny_model_dir, "--hub-api-url", hub.api_url, env={**base, **env})


def call(url: str, cred: str, method: str = "GET", path: str = f"{V1}/runs", **kw) -> httpx.Response:
    return httpx.request(method, f"{url}{path}", headers={"X-API-Key": cred}, timeout=60, **kw)


def mint(url: str, hub_token: str) -> dict:
    r = call(url, hub_token, "POST", "/api/v1/keys", json={"name": "sdk"})
    assert r.status_code == 201, r.text
    return r.json()


def submit_job(url: str, cred: str, name: str) -> dict:
    data = b"opaque payload"
    body = {
        "name": name,
        "kind": "run",
        "where": "local",
        "payload": base64.b64encode(data).decode(),
        "payload_sha256": hashlib.sha256(data).hexdigest(),
        "meta": {"steps": 1},
    }
    r = call(url, cred, "POST", f"{V1}/jobs", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def new_run(url: str, cred: str, name: str) -> str:
    r = call(url, cred, "POST", f"{V1}/runs", json={"name": name, "seed": 0})
    assert r.status_code == 201, r.text
    return r.json()["run_id"]


def error(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error"))
    except ValueError:
        return r.text


def test_a_deleted_users_keys_job_keys_and_token_stop_working_while_a_live_user_keeps_working(
    hub, tmp_path, tiny_model_dir
):
    alice, bob = hub.add_user("alice"), hub.add_user("bob")
    with serve_with(hub, tmp_path, tiny_model_dir) as s:
        a_key, b_key = mint(s.url, alice)["key"], mint(s.url, bob)["key"]
        new_run(s.url, a_key, "alice-run")
        job_key = submit_job(s.url, a_key, "alice-job")["key"]
        for cred in (a_key, job_key, alice, b_key, bob):
            assert call(s.url, cred).status_code == 200
        jobs_dir = s.data_dir / "tenants" / tenant_folder("hub:alice") / "jobs"
        assert jobs_dir.is_dir()

        hub.delete_user("alice")
        deadline = time.monotonic() + GUARD_S
        left = {"minted key": a_key, "job key": job_key, "hub token": alice}
        refusals = {}
        while left:
            assert time.monotonic() < deadline, f"still working after the user was deleted: {sorted(left)}"
            for what, cred in list(left.items()):
                r = call(s.url, cred)
                if r.status_code != 200:
                    assert r.status_code == 401, (what, r.status_code, r.text)
                    refusals[what] = error(r)
                    del left[what]
            for cred in (b_key, bob):  # bob is untouched throughout
                r = call(s.url, cred)
                assert r.status_code == 200, r.text
            time.sleep(0.1)
        says = "the JupyterHub user 'alice' no longer exists"
        assert says in refusals["minted key"] and "keys minted for that account" in refusals["minted key"]
        assert says in refusals["job key"], refusals
        # deletion revokes access; the data stays until the admin removes it
        assert jobs_dir.is_dir()

        # bob's key keeps working across re-checks: the service asks the hub about bob again and again
        asked = hub.asked_users("bob")
        assert asked >= 1, "the service never asked the hub whether bob still exists"
        while hub.asked_users("bob") < asked + 2:
            assert time.monotonic() < deadline + GUARD_S, "bob's key was not re-checked"
            r = call(s.url, b_key)
            assert r.status_code == 200, r.text
            time.sleep(0.1)


def test_a_recreated_account_inherits_no_keys_and_the_old_tenant_is_retired_first(
    hub, tmp_path, tiny_model_dir
):
    first = hub.add_user("alice")
    with serve_with(hub, tmp_path, tiny_model_dir) as s:
        old_key = mint(s.url, first)["key"]
        old_job_key = submit_job(s.url, old_key, "old-job")["key"]
        assert call(s.url, old_key).status_code == 200
        old_created = hub.users["alice"]

        hub.delete_user("alice")
        again = hub.add_user("alice")  # the same name, a new account
        assert hub.users["alice"] != old_created
        # the new account's first request: the old tenant is retired before it proceeds
        r = call(s.url, again, path="/api/v1/keys")
        assert r.status_code == 200 and r.json() == {"keys": []}, r.text
        assert "retired tenant 'hub:alice'" in s.stderr, s.stderr[-2000:]
        for cred, says in (
            (old_key, "the JupyterHub user 'alice' was deleted and created again"),
            (old_job_key, "an earlier JupyterHub account named 'alice'"),
        ):
            r = call(s.url, cred)
            assert r.status_code == 401 and says in error(r), r.text
        # the service's record of the identities it saw: private, with the new account
        path = s.data_dir / "hub-identities.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert json.loads(path.read_text())["alice"]["created"] == hub.users["alice"]
        # the new account works, and its own new key too
        new_key = mint(s.url, again)["key"]
        assert call(s.url, new_key).status_code == 200
        assert [k["id"] for k in call(s.url, again, path="/api/v1/keys").json()["keys"]] != []


def test_a_recreated_account_sees_none_of_the_old_accounts_runs(hub, tmp_path, tiny_model_dir):
    first = hub.add_user("alice")
    with serve_with(hub, tmp_path, tiny_model_dir) as s:
        new_run(s.url, first, "old-run")
        hub.delete_user("alice")
        again = hub.add_user("alice")
        r = call(s.url, again)
        assert r.status_code == 200 and r.json()["runs"] == [], r.text


def test_minted_keys_expire_after_the_configured_lifetime(hub, tmp_path, tiny_model_dir):
    alice = hub.add_user("alice")
    with serve_with(hub, tmp_path, tiny_model_dir, OPENRL_MINTED_KEY_TTL_S="3") as s:
        rec = mint(s.url, alice)
        assert rec["expires"] == pytest.approx(rec["created"] + 3, abs=0.01)
        deadline = time.monotonic() + GUARD_S
        while (r := call(s.url, rec["key"])).status_code == 200:
            assert time.monotonic() < deadline, "the key never expired"
            time.sleep(0.2)
        assert r.status_code == 401, r.text
        assert "expired after 3 s (OPENRL_MINTED_KEY_TTL_S)" in error(r) and "%openrl token" in error(r), (
            r.text
        )
        assert call(s.url, mint(s.url, alice)["key"]).status_code == 200  # a new one works


def test_without_a_service_token_the_service_says_keys_rely_on_expiry(hub, tmp_path, tiny_model_dir):
    alice = hub.add_user("alice")
    with serve_with(hub, tmp_path, tiny_model_dir, service_token=False) as s:
        assert call(s.url, mint(s.url, alice)["key"]).status_code == 200
    assert "no hub token of its own" in s.stdout and "OPENRL_MINTED_KEY_TTL_S" in s.stdout, s.stdout
    assert "JUPYTERHUB_API_TOKEN" in s.stdout


@pytest.mark.parametrize(
    ("token", "scopes", "says"),
    [
        ("right", ["read:users:name"], "lacks the scope read:users"),
        ("wrong", None, "does not accept the service's own token"),
    ],
)
def test_a_service_token_that_cannot_read_users_is_a_503_naming_it_never_a_false_deletion(
    tmp_path, tiny_model_dir, token, scopes, says
):
    # A token without read:users gets 404 for every user, as for a deleted one: the service must
    # not conclude that everyone was deleted (nor retire anyone), but say what to fix.
    with FakeHub(service_scopes=scopes) as hub:
        alice = hub.add_user("alice")
        env = {"JUPYTERHUB_API_TOKEN": hub.service_token if token == "right" else "not-the-hubs"}
        with serve_with(hub, tmp_path, tiny_model_dir, service_token=False, **env) as s:
            for cred in (alice, alice):  # the hub token, twice: the answer is the same each time
                r = call(s.url, cred)
                assert r.status_code == 503 and says in error(r), r.text
                assert "no longer exists" not in error(r) and int(r.headers["retry-after"]) >= 1
        assert says in s.stderr  # logged for the admin


def test_with_the_hub_down_minted_keys_get_503_naming_it_and_api_keys_still_work(tmp_path, tiny_model_dir):
    carol = "tml-carol-0123456789abcdef"
    with FakeHub() as hub:
        alice = hub.add_user("alice")
        with serve_with(hub, tmp_path, tiny_model_dir, OPENRL_API_KEYS=f"carol:{carol}") as s:
            key = mint(s.url, alice)["key"]
            assert call(s.url, key).status_code == 200
            hub.go_down()
            deadline = time.monotonic() + GUARD_S
            while (r := call(s.url, key)).status_code == 200:  # until the last answer is too old
                assert time.monotonic() < deadline, "a minted key kept working unchecked with the hub down"
                time.sleep(0.1)
            assert r.status_code == 503 and "unreachable" in error(r), r.text
            assert int(r.headers["retry-after"]) >= 1
            assert call(s.url, carol).status_code == 200
