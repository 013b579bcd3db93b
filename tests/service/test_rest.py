"""The REST catalogue: every object is the caller's alone, TTLs really expire, listings page."""

import time
import urllib.request

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import ALICE_KEY, BOB_KEY, TINY


@pytest.fixture(scope="module")
def alice_world(server):
    """Alice's session with a trained run, a checkpoint of each kind and a sampler."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY, project_id="proj-alice")
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]}
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    paths = {
        "training": tc.save_state("w").result().path,
        "sampler": tc.save_weights_for_sampler("s").result().path,
        "external": tc.save_weights_external("e").result().path,
    }
    sampler = tc.save_weights_and_get_sampling_client().result()
    session_id = tc.model_id.split(":")[0]
    yield {"run": tc.model_id, "paths": paths, "sampler": sampler._sampling_session_id, "session": session_id}
    sc.close("success").result()


def test_another_tenant_gets_404_for_every_rest_object(server, alice_world):
    bob = httpx.Client(base_url=server.url, headers={"X-API-Key": BOB_KEY}, timeout=30)
    alice = httpx.Client(base_url=server.url, headers={"X-API-Key": ALICE_KEY}, timeout=30)
    run, session, sampler = alice_world["run"], alice_world["session"], alice_world["sampler"]
    ckpt = "weights/w"
    requests = [
        ("GET", f"/api/v1/training_runs/{run}", None),
        ("GET", f"/api/v1/training_runs/{run}/checkpoints", None),
        ("DELETE", f"/api/v1/training_runs/{run}/checkpoints/{ckpt}", None),
        ("POST", f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/publish", None),
        ("DELETE", f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/publish", None),
        ("PUT", f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/ttl", {"ttl_seconds": 7200}),
        ("GET", f"/api/v1/training_runs/{run}/checkpoints/external_weights/e/external_weights_urls", None),
        ("POST", "/api/v1/weights_info", {"tinker_path": alice_world["paths"]["training"]}),
        (
            "POST",
            "/api/v1/copy_weights",
            {"source_path": alice_world["paths"]["training"], "destination_project_id": "p"},
        ),
        ("GET", f"/api/v1/sessions/{session}", None),
        ("PUT", f"/api/v1/sessions/{session}/project", {"project_id": "stolen"}),
        ("GET", f"/api/v1/sessions/{session}/trace_export", None),
        ("GET", f"/api/v1/samplers/{sampler}", None),
    ]
    for method, url, body in requests:
        r = bob.request(method, url, json=body)
        assert r.status_code == 404, (method, url, r.status_code, r.text)
    # Nothing of Alice's shows up in Bob's listings, and her objects are untouched.
    bob_runs = bob.get("/api/v1/training_runs", params={"limit": 1000}).json()["training_runs"]
    assert run not in {r["training_run_id"] for r in bob_runs}
    bob_ckpts = bob.get("/api/v1/checkpoints", params={"limit": 1000}).json()["checkpoints"]
    assert not {c["tinker_path"] for c in bob_ckpts} & set(alice_world["paths"].values())
    assert session not in bob.get("/api/v1/sessions").json()["sessions"]
    assert bob.post("/api/v1/sessions/search", json={"session_id": session}).json()["sessions"] == []
    ckpts = {
        c["checkpoint_id"]: c
        for c in alice.get(f"/api/v1/training_runs/{run}/checkpoints").json()["checkpoints"]
    }
    assert ckpts[ckpt]["public"] is False and ckpts[ckpt]["expires_at"] is None


def test_expired_checkpoint_disappears_and_cannot_be_loaded(make_server):
    live = make_server(min_ttl_s=1)
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    rest = tinker.RestClient(base_url=live.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    short = tc.save_state("short", ttl_seconds=1).result().path
    keep = tc.save_state("keep").result().path
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[short].expires_at is not None and listed[keep].expires_at is None
    time.sleep(1.2)  # past the TTL: expiry is a wall-clock property
    listed = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert listed == [keep]
    assert short not in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    with pytest.raises(tinker.NotFoundError):
        sc.create_training_client_from_state(short).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(short).result()
    assert live.service.store.sweep_expired() == 1  # and the sweep deletes its files
    sc.close("success").result()


def test_ttl_bounds_are_checked(server, alice_world):
    rest = tinker.RestClient(base_url=server.url, api_key=ALICE_KEY)
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(alice_world["paths"]["sampler"], 5).result()


def test_listing_pages(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=BOB_KEY)
    rest = tinker.RestClient(base_url=server.url, api_key=BOB_KEY)
    try:  # the session is finished even if an assert fails: its runs leave Bob's live-run quota
        ids = [sc.create_lora_training_client(base_model=TINY, rank=2).result().model_id for _ in range(3)]
        first = rest.list_training_runs(limit=2, offset=0).result()
        second = rest.list_training_runs(limit=2, offset=2).result()
        assert first.cursor.total_count >= 3 and first.cursor.limit == 2 and len(first.training_runs) == 2
        seen = [r.training_run_id for r in first.training_runs + second.training_runs]
        # Newest first: Bob's three newest runs are this test's, on the first two pages, no repeats.
        assert set(ids) <= set(seen) and len(seen) == len(set(seen))
    finally:
        sc.close("success").result()


def test_signed_download_links_work_without_a_key_and_expire_when_forged(server, alice_world):
    rest = tinker.RestClient(base_url=server.url, api_key=ALICE_KEY)
    urls = rest.get_external_weights_urls(alice_world["paths"]["external"]).result().urls
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(urls)
    with urllib.request.urlopen(urls["adapter_config.json"]) as r:  # a plain GET, no key
        assert b'"peft_type": "LORA"' in r.read()
    forged = urls["adapter_config.json"][:-4] + "0000"
    assert httpx.get(forged).status_code == 404
