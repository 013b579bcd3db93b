"""JupyterHub users with crafted names against API-key tenants and each other.

With ``--hub-api-url`` a hub user's token is a tenant ``hub:<name>``, and hub names may hold any
character: one named ``alice``, ``../alice``, ``hub:alice`` or with a newline must get a tenant and a
data folder of its own, see nothing of the API tenant ``alice`` and write nowhere else. The hub is a
stand-in on loopback answering as JupyterHub does (tests/_support/jhub.py FakeHub); a real JupyterHub
is in tests/hub, too slow to start per module. The collisions that ``~`` and the long name digest
allowed are in test_tenant_folders.py; minted keys' lifetime and hub-cache flooding in test_hub_keys.py
and test_hub_flood.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import tinker

from openrl_service.config import hub_tenant, tenant_folder
from tests._support.jhub import FakeHub
from tests.conftest import ALICE_KEY, BOB_KEY, TINY, start_server
from tests.security.conftest import V1, files_of, refused, sse_until

SHA_OF_X = hashlib.sha256(b"x").hexdigest()  # a job's payload: b"x", base64 "eA=="
CRAFTED = [
    "alice",
    "bob",
    "..",
    "../alice",
    "../../tenants/alice",
    "alice/../../alice",
    "%2e%2e%2falice",
    "hub:alice",
    "hub~alice",
    "alice\n",
    "alice\x00",
    "é-alice",
    " alice",
]


@pytest.fixture(scope="module")
def hub():
    """The stand-in hub on loopback (tests/_support/jhub.py FakeHub: the two hub calls the service makes)."""
    with FakeHub() as fake:
        yield fake


_TOKENS: dict[tuple[int, str], str] = {}


def token(hub: FakeHub, name: str) -> str:
    """A token of hub user ``name`` (the user is created on first use)."""
    key = (id(hub), name)
    if key not in _TOKENS:
        _TOKENS[key] = hub.add_user(name)
    return _TOKENS[key]


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model_dir, hub):
    """This module's service, with the stand-in hub (overrides the plain one of conftest.py)."""
    server = start_server(tmp_path_factory.mktemp("crafted"), tiny_model_dir, hub_api_url=hub.api_url)
    server.hub = hub
    yield server
    server.stop()


def as_user(live, name: str) -> httpx.Client:
    return httpx.Client(
        base_url=live.url, headers={"Authorization": f"token {token(live.hub, name)}"}, timeout=60
    )


@pytest.fixture(scope="module")
def alices(live, alice):
    """The API tenant alice's objects: a notebook run, a Tinker-SDK run, a checkpoint of each API."""
    notebook = alice.post(f"{V1}/runs", json={"name": "alice-nb", "rank": 4}).json()["run_id"]
    nb_ckpt = alice.post(f"{V1}/runs/{notebook}/checkpoints", json={"name": "nb"}).json()["path"]
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    yield {
        "notebook": notebook,
        "sdk": tc.model_id,
        "checkpoints": [nb_ckpt, tc.save_state("sdk").result().path],
    }
    sc.close("success").result()


@pytest.mark.parametrize("name", CRAFTED, ids=repr)
def test_a_hub_user_named_like_another_tenant_sees_none_of_its_data(live, alices, name, alice_unchanged):
    """Attack: a hub user whose name is (or walks to) another tenant's name or folder lists and
    reads runs, checkpoints, sessions, jobs and keys, and loads alice's checkpoints."""
    secrets = {alices["notebook"], alices["sdk"], *alices["checkpoints"]}
    with as_user(live, name) as c:
        listings = [
            c.get(f"{V1}/runs", params={"include": "all"}),
            c.get("/api/v1/training_runs", params={"limit": 1000}),
            c.get("/api/v1/checkpoints", params={"limit": 1000}),
            c.get("/api/v1/sessions", params={"limit": 1000}),
            c.get(f"{V1}/jobs"),
            c.get("/api/v1/keys"),
        ]
        for r in listings:
            assert r.status_code == 200, r.text
            assert not any(s in r.text for s in secrets), r.text[:500]
        for path in alices["checkpoints"]:
            refused(c.post("/api/v1/weights_info", json={"tinker_path": path}), 404)
            refused(c.post(f"{V1}/runs", json={"rank": 4, "load_from": path}), 404)
        for run_id in (alices["notebook"], alices["sdk"]):
            refused(c.get(f"{V1}/runs/{run_id}"), 404)
            refused(c.post(f"{V1}/runs/{run_id}/control", json={"action": "stop"}), 404)
            refused(c.get(f"/api/v1/training_runs/{run_id}/checkpoints"), 404)


def test_crafted_hub_names_write_only_inside_their_own_tenant_folder(live, alices):
    """Attack: hub users with path-like names create runs, checkpoints and jobs, hoping the files land
    in another tenant's folder (or outside tenants/). Each gets one folder directly under tenants/;
    the API tenants' files are unchanged, byte for byte."""
    tenants = Path(live.data_dir) / "tenants"
    before = {d.name for d in tenants.iterdir()}
    api_tenants = {t: files_of(live, t) for t in before if not t.startswith("hub~")}
    for name in CRAFTED:
        folder = tenants / tenant_folder(hub_tenant(name))
        assert folder.resolve().parent == tenants.resolve(), (name, folder)
        with as_user(live, name) as c:
            run = c.post(f"{V1}/runs", json={"name": "mine", "rank": 4})
            assert run.status_code == 201, run.text
            saved = c.post(f"{V1}/runs/{run.json()['run_id']}/checkpoints", json={"name": "ck"})
            assert saved.status_code == 201, saved.text
            c.delete(f"{V1}/runs/{run.json()['run_id']}")
            job = c.post(
                f"{V1}/jobs",
                json={
                    "name": "j",
                    "kind": "run",
                    "where": "local",
                    "payload": "eA==",
                    "payload_sha256": SHA_OF_X,
                },
            )
            assert job.status_code == 201, job.text
        assert (folder / "runs").is_dir() and (folder / "jobs" / job.json()["job_id"]).is_dir(), name
    assert {d.name for d in tenants.iterdir()} == before | {tenant_folder(hub_tenant(n)) for n in CRAFTED}
    assert {t: files_of(live, t) for t in api_tenants} == api_tenants


def test_another_user_cannot_list_or_revoke_my_minted_key(live, bob):
    """Attack: bob (an API key) and a hub user named like carol's folder list and revoke the key
    carol minted with her hub token."""
    with as_user(live, "carol") as carol:
        minted = carol.post("/api/v1/keys", json={"name": "laptop"})
        assert minted.status_code == 201, minted.text
    key, key_id = minted.json()["key"], minted.json()["id"]
    with as_user(live, "hub:carol") as impostor:
        for c in (bob, impostor):
            assert key_id not in c.get("/api/v1/keys").text
            refused(c.delete(f"/api/v1/keys/{key_id}"), 404)
    with live.client(key) as k:  # still hers, still working
        assert k.get(f"{V1}/runs").status_code == 200


def test_a_hub_user_named_alice_never_gets_alices_events(live, alice):
    """Attack: hub user "alice" keeps /openrl/v1/events open while the API tenant alice works; only
    the hub user's own marker run may appear."""
    with as_user(live, "alice") as hub_alice, hub_alice.stream("GET", f"{V1}/events") as stream:
        lines = stream.iter_lines()
        sse_until(lines, lambda kind, _: kind == "tick")
        run = alice.post(f"{V1}/runs", json={"name": "api-alice-secret", "rank": 4}).json()["run_id"]
        alice.post(f"{V1}/runs/{run}/metrics", json={"step": 1, "reward_mean": 0.4242})
        alice.delete(f"{V1}/runs/{run}")
        marker = hub_alice.post(f"{V1}/runs", json={"name": "hub-marker", "rank": 4}).json()["run_id"]
        events, text = sse_until(lines, lambda kind, d: kind == "run" and d.get("run_id") == marker)
        hub_alice.delete(f"{V1}/runs/{marker}")
    assert {d["run_id"] for kind, d in events if kind == "run"} == {marker}
    assert run not in text and "api-alice-secret" not in text and "0.4242" not in text


def test_a_hub_users_metrics_scrape_names_only_their_own_runs(live, alices):
    """Attack: hub user "alice" scrapes /metrics with her hub token, looking for the API tenant
    alice's per-run series."""
    with as_user(live, "alice") as c:
        run = c.post(f"{V1}/runs", json={"name": "hub-alice-run", "rank": 4}).json()["run_id"]
        c.post(f"{V1}/runs/{run}/sample", json={"prompts": ["Hi"], "max_tokens": 2})
        r = c.get("/metrics")
        c.delete(f"{V1}/runs/{run}")
    assert r.status_code == 200
    assert run in r.text
    assert alices["notebook"] not in r.text and alices["sdk"] not in r.text
    with live.client(BOB_KEY) as b:
        assert run not in b.get("/metrics").text


def test_revoking_a_minted_key_ends_the_event_stream_it_opened(live):
    """Attack: dave mints a key, opens /openrl/v1/events with it, and the key is revoked (dave
    revokes it, e.g. because it leaked). The open stream must not keep carrying dave's run events:
    after the revocation it ends, at the latest when its next event would be sent."""
    with as_user(live, "dave") as dave:
        minted = dave.post("/api/v1/keys", json={"name": "leaked"}).json()
        with live.client(minted["key"]) as leaked, leaked.stream("GET", f"{V1}/events") as stream:
            lines = stream.iter_lines()
            sse_until(lines, lambda kind, _: kind == "tick")
            assert dave.delete(f"/api/v1/keys/{minted['id']}").status_code == 204
            refused(leaked.get(f"{V1}/runs"), 401)  # the key itself is refused at once
            marker = dave.post(f"{V1}/runs", json={"name": "dave-after-revocation", "rank": 4}).json()[
                "run_id"
            ]
            events, text = sse_until(lines, lambda kind, d: kind == "run" and d.get("run_id") == marker)
        dave.delete(f"{V1}/runs/{marker}")
    assert marker not in text, "the revoked key's stream still carried dave's new run"


def test_the_openai_endpoint_takes_hub_tokens_and_minted_keys_and_keeps_tenants_apart(live, alices):
    """A hub user reaches /v1 with their own token and with a key they minted (the OpenAI SDK sends it
    as a Bearer key) and sees their own checkpoints; a hub user named like the API tenant alice, and
    any other, gets a 404 for alice's checkpoints from the endpoint and the export route alike."""
    import openai

    with as_user(live, "dave") as dave:
        assert TINY in {m["id"] for m in dave.get("/v1/models").json()["data"]}
        minted = dave.post("/api/v1/keys", json={"name": "oai"})
        assert minted.status_code == 201, minted.text
        run = dave.post(f"{V1}/runs", json={"name": "dave-oai", "rank": 4}).json()["run_id"]
        mine = dave.post(f"{V1}/runs/{run}/checkpoints", json={"name": "oai"}).json()["path"]
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=minted.json()["key"], max_retries=0)
    assert mine in {m.id for m in client.models.list()}
    out = client.completions.create(model=mine, prompt="Hi", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1
    assert not set(alices["checkpoints"]) & {m.id for m in client.models.list()}
    for who in ("alice", "dave"):
        with as_user(live, who) as c:
            for path in alices["checkpoints"]:
                r = c.post(
                    "/v1/chat/completions",
                    json={"model": path, "messages": [{"role": "user", "content": "x"}]},
                )
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
                refused(c.post("/api/v1/exports", json={"tinker_path": path}), 404)
