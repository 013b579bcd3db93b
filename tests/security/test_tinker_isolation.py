"""Bob against alice through the Tinker API (/api/v1), with the real ``tinker`` SDK where the SDK can
make the call and raw httpx where it cannot.

Already held elsewhere (not repeated here): every Tinker route on alice's run, sampler, session,
future and checkpoints answers bob 404, and a foreign id reads exactly like a made-up one
(tests/service/test_auth.py::test_another_tenant_gets_404_on_alices_objects,
::test_foreign_ids_look_exactly_like_unknown_ones, ::test_sdk_user_of_another_tenant_cannot_load_alices_checkpoint,
::test_path_traversal_in_a_run_id_does_not_reach_another_tenant); every REST route on alice's objects
answers 404 over raw HTTP (tests/service/test_rest.py::test_another_tenant_gets_404_for_every_rest_object).
This module adds the paths those leave open: another tenant's tinker:// path loaded into MY run, a
published checkpoint, a sampler handle, the RestClient's own calls (with access_scope="accessible"),
idempotency keys, copy_weights into another tenant's session, session search by owner, a fused
call's trace, and a foreign future after it expired.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import pytest
import tinker
from tinker import types
from tinker.types import RequestErrorCategory

from tests._support.raw import RawTinker, sft_datum
from tests.conftest import ALICE_KEY, BOB_KEY, TINY
from tests.security.conftest import refused, weights_of
from tests.service.test_scheduling import held_worker

RANK = 4  # alice's and bob's runs share it: a refusal is about ownership, never about a rank mismatch


@dataclass
class World:
    run: str  # alice's training run (model_id)
    session: str
    weights: str  # tinker:// paths of her checkpoints, one per kind
    sampler_weights: str
    external: str
    published: str  # a weights checkpoint she published
    published_external: str  # and an external (downloadable) one
    handle: str  # SamplingClient.get_sampler_handle() of her sampler
    sampler: str


def datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]), loss_fn_inputs={"target_tokens": [6, 7, 8, 9]}
    )


@pytest.fixture(scope="module")
def world(live) -> World:
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY, project_id="proj-alice")
    tc = sc.create_lora_training_client(base_model=TINY, rank=RANK, seed=1).result()
    tc.forward_backward([datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    rest = tinker.RestClient(base_url=live.url, api_key=ALICE_KEY)
    published = tc.save_state("published").result().path
    published_external = tc.save_weights_external("published-e").result().path
    for path in (published, published_external):
        rest.publish_checkpoint_from_tinker_path(path).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    yield World(
        run=tc.model_id,
        session=tc.model_id.split(":")[0],
        weights=tc.save_state("w").result().path,
        sampler_weights=tc.save_weights_for_sampler("s").result().path,
        external=tc.save_weights_external("e").result().path,
        published=published,
        published_external=published_external,
        handle=sampler.get_sampler_handle(),
        sampler=sampler._sampling_session_id,
    )
    sc.close("success").result()


@pytest.fixture(scope="module")
def bob_sdk(live):
    """Bob's ServiceClient, a training client of his (same rank as alice's) and his RestClient."""
    sc = tinker.ServiceClient(base_url=live.url, api_key=BOB_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=RANK, seed=2).result()
    tc.forward_backward([datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    yield sc, tc, tinker.RestClient(base_url=live.url, api_key=BOB_KEY)
    sc.close("success").result()


# -- another tenant's tinker:// path in MY calls -----------------------------------------------------
@pytest.mark.parametrize("method", ["load_state", "load_state_with_optimizer"])
def test_loading_another_tenants_checkpoint_into_my_own_run_is_refused(
    live, world, bob_sdk, method, alice_unchanged
):
    """Attack: bob's own training client (his run, same base model and rank) loads alice's weights
    checkpoint by its tinker:// path. Refused as not found (a load takes its run's seq slot, so the
    refusal is the op's result: a user error, as for a path that never existed); his run keeps its
    own weights."""
    _, tc, _ = bob_sdk
    before = weights_of(live, "bob")[tc.model_id]
    for path in (world.weights, world.published):
        with pytest.raises(tinker.RequestFailedError, match="not found") as refusal:
            getattr(tc, method)(path).result()
        assert refusal.value.category == RequestErrorCategory.User
    assert weights_of(live, "bob")[tc.model_id] == before
    tc.forward_backward([datum()], "cross_entropy").result()  # and his run carries on


def test_a_published_checkpoint_is_still_private_to_other_tenants(world, bob_sdk, alice_unchanged):
    """Attack: alice published a checkpoint (Tinker's "public"); bob tries every SDK call that
    reads a checkpoint by path. Publishing is recorded only: nothing is shared across tenants."""
    sc, _, rest = bob_sdk
    attempts = {
        "training client from state": lambda: sc.create_training_client_from_state(world.published),
        "with optimizer": lambda: sc.create_training_client_from_state_with_optimizer(world.published),
        "sampling client": lambda: sc.create_sampling_client(model_path=world.published),
        "weights info": lambda: rest.get_weights_info_by_tinker_path(world.published),
        "download urls": lambda: rest.get_external_weights_urls(world.published_external),
        "copy to my project": lambda: rest.copy_weights(world.published, "proj-bob"),
        "run by path (accessible)": lambda: rest.get_training_run_by_tinker_path(
            world.published, access_scope="accessible"
        ),
    }
    for what, attempt in attempts.items():
        with pytest.raises(tinker.NotFoundError):
            attempt().result()
            pytest.fail(f"{what}: bob read alice's published checkpoint")


def test_another_tenants_sampler_handle_does_not_sample_with_my_key(world, alice_unchanged):
    """Attack: alice's sampler handle (SamplingClient.get_sampler_handle, "carries no credentials")
    reaches bob, who opens it with his own key and samples."""
    client = tinker.SamplingClient.from_sampler_handle(world.handle, api_key=BOB_KEY)
    with pytest.raises(tinker.NotFoundError, match="unknown sampling_session_id"):
        client.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()


# Every RestClient call that names one of alice's objects, as bob.
REST_CALLS = {
    "get_training_run (accessible)": lambda r, w: r.get_training_run(w.run, access_scope="accessible"),
    "get_training_run_by_tinker_path": lambda r, w: r.get_training_run_by_tinker_path(w.weights),
    "list_checkpoints": lambda r, w: r.list_checkpoints(w.run),
    "delete_checkpoint": lambda r, w: r.delete_checkpoint(w.run, "weights/w"),
    "delete_checkpoint_from_tinker_path": lambda r, w: r.delete_checkpoint_from_tinker_path(w.weights),
    "publish_checkpoint_from_tinker_path": lambda r, w: r.publish_checkpoint_from_tinker_path(w.weights),
    "unpublish_checkpoint_from_tinker_path": lambda r, w: r.unpublish_checkpoint_from_tinker_path(
        w.published
    ),
    "set_checkpoint_ttl_from_tinker_path": lambda r, w: r.set_checkpoint_ttl_from_tinker_path(
        w.weights, 7200
    ),
    "clear_checkpoint_ttl": lambda r, w: r.set_checkpoint_ttl_from_tinker_path(w.sampler_weights, None),
    "get_external_weights_urls": lambda r, w: r.get_external_weights_urls(w.external),
    "get_weights_info_by_tinker_path": lambda r, w: r.get_weights_info_by_tinker_path(w.sampler_weights),
    "copy_weights": lambda r, w: r.copy_weights(w.weights, "proj-bob"),
    "get_session (accessible)": lambda r, w: r.get_session(w.session, access_scope="accessible"),
    "assign_session_project": lambda r, w: r.assign_session_project(w.session, "stolen"),
    "export_session_trace": lambda r, w: r.export_session_trace(w.session),
    "get_sampler": lambda r, w: r.get_sampler(w.sampler),
}


@pytest.mark.parametrize("call", REST_CALLS)
def test_rest_client_calls_on_another_tenants_objects_are_not_found(world, bob_sdk, call, alice_unchanged):
    """Attack: bob's RestClient, each call aimed at one of alice's runs, checkpoints, sessions or
    samplers (read, delete, publish, TTL, download, copy, move, trace)."""
    _, _, rest = bob_sdk
    with pytest.raises(tinker.NotFoundError):
        REST_CALLS[call](rest, world).result()


def test_accessible_listings_and_searches_show_only_my_own(world, bob_sdk, alice_unchanged):
    """Attack: bob lists training runs with access_scope="accessible" (and alice's project id), and
    searches sessions of every owner ("accessible") or of alice by name ("user" owner)."""
    _, tc, rest = bob_sdk
    for project in (None, "proj-alice"):
        runs = rest.list_training_runs(limit=100, access_scope="accessible", project_id=project).result()
        assert world.run not in [r.training_run_id for r in runs.training_runs]
    assert tc.model_id in [
        r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs
    ]
    for owner in (types.AccessibleSearchOwner(), types.UserSearchOwner(owner_urns=["alice", "user:alice"])):
        found = rest.search_sessions(types.SessionSearchRequest(owner=owner, limit=50)).result()
        assert world.session not in [s.session_id for s in found.sessions]
        assert all(s.owner == "bob" for s in found.sessions), found.sessions
    byname = rest.search_sessions(types.SessionSearchRequest(session_id=world.session)).result()
    assert byname.sessions == []


# -- raw HTTP: what the SDK does not let a caller choose -------------------------------------------
def test_copying_my_checkpoint_into_another_tenants_session_is_refused(live, world, bob_sdk, alice_unchanged):
    """Attack: bob copies one of his own checkpoints into a run slot of alice's session
    (copy_weights with her session_id): it would add a run to her session and files to her folder."""
    _, tc, _ = bob_sdk
    mine = tc.save_state("bobs-own").result().path
    with live.client(BOB_KEY) as bob:
        r = bob.post(
            "/api/v1/copy_weights", json={"source_path": mine, "session_id": world.session, "model_seq_id": 7}
        )
        assert "unknown session_id" in refused(r, 404)["error"]


def test_an_idempotency_key_another_tenant_used_runs_my_own_request(live):
    """Attack: bob re-sends alice's X-Idempotency-Key (seen in a log or a shared notebook) with the
    same create_model body, hoping for her reply (her model_id) instead of a new run of his own."""
    key = {"X-Idempotency-Key": "idem-shared-0001"}
    with live.client(ALICE_KEY) as a, live.client(BOB_KEY) as b:
        ra, rb = RawTinker(a), RawTinker(b)
        try:
            sa, sb = ra.session(), rb.session()
            body = {"model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": RANK}}
            first = a.post("/api/v1/create_model", json={"session_id": sa, **body}, headers=key).json()
            ra.result(first["request_id"])
            theirs = b.post("/api/v1/create_model", json={"session_id": sb, **body}, headers=key)
            assert theirs.status_code == 200, theirs.text
            assert (
                theirs.json()["model_id"].startswith(sb)
                and theirs.json()["request_id"] != first["request_id"]
            )
            assert "error" not in rb.result(theirs.json()["request_id"])
            # and alice's future stays hers
            refused(b.post("/api/v1/retrieve_future", json={"request_id": first["request_id"]}), 404)
        finally:
            ra.finish_sessions()
            rb.finish_sessions()


def test_a_fused_call_does_not_name_another_tenants_run_in_my_trace(live):
    """Attack: bob's forward/backward runs fused with alice's in one device pass; bob exports his
    session's trace (a Perfetto file behind a signed URL) hoping to see her run in "fused_with"."""
    with live.client(ALICE_KEY) as a, live.client(BOB_KEY) as b:
        ra, rb = RawTinker(a), RawTinker(b)
        try:
            sa, sb = ra.session(), rb.session()
            alice_run, bob_run = ra.create_model(sa, rank=RANK), rb.create_model(sb, rank=RANK)
            data = [sft_datum([11, 12, 13], [14, 15])]
            with held_worker(live.service.engine, live.service.futures):  # both ops wait, then fuse
                requests = [ra.submit_fb(alice_run, 1, data), rb.submit_fb(bob_run, 1, data)]
            assert "error" not in ra.result(requests[0]) and "error" not in rb.result(requests[1])
            url = b.get(f"/api/v1/sessions/{sb}/trace_export").json()["url"]
            trace = httpx.get(url, timeout=30)
        finally:
            ra.finish_sessions()
            rb.finish_sessions()
    assert trace.status_code == 200
    ops = [e for e in trace.json()["traceEvents"] if e["name"] == "forward_backward"]
    assert [e["tid"] for e in ops] == [bob_run]
    assert ops[0]["args"].get("fused_id"), "the two calls did not fuse: this test proves nothing"
    assert ops[0]["args"]["fused_with"] == []
    assert alice_run not in trace.text and sa not in trace.text


def test_another_tenants_expired_future_is_not_found_not_gone(live):
    """Attack: bob polls a request id of alice's whose result has expired (OPENRL_FUTURE_TTL_S). A 410
    "finished too long ago" tells him the id was real; an unknown id answers 404."""
    with live.client(ALICE_KEY) as a, live.client(BOB_KEY) as b:
        ra = RawTinker(a)
        try:
            model = ra.create_model(ra.session(), rank=RANK)
            request_id = ra.submit_optim(model, 1)
            ra.result(request_id)
            # the housekeeping round, one TTL later (the service's own sweep, its clock wound forward)
            live.service.engine.forget(
                live.service.futures.sweep(now=time.time() + live.service.futures.ttl_s + 1)
            )
            assert a.post("/api/v1/retrieve_future", json={"request_id": request_id}).status_code == 410
            made_up = "req-" + "0" * 32
            unknown = refused(b.post("/api/v1/retrieve_future", json={"request_id": made_up}), 404)
            theirs = refused(b.post("/api/v1/retrieve_future", json={"request_id": request_id}), 404)
            assert theirs["error"].replace(request_id, "ID") == unknown["error"].replace(made_up, "ID")
        finally:
            ra.finish_sessions()


def test_my_samplers_do_not_evict_another_tenants_sampler(make_server):
    """Attack: bob creates sampler snapshots until the service's snapshot budget is full, so that
    alice's sampling client, idle for a moment, is evicted (a denial of service, no data read)."""
    live = make_server(max_sampler_snapshots=3)
    alice = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    bob = tinker.ServiceClient(base_url=live.url, api_key=BOB_KEY)
    try:
        hers = alice.create_lora_training_client(base_model=TINY, rank=RANK).result()
        sampler = hers.save_weights_and_get_sampling_client().result()
        prompt, params = types.ModelInput.from_ints([1, 2, 3]), types.SamplingParams(max_tokens=2)
        sampler.sample(prompt, 1, params).result()
        his = bob.create_lora_training_client(base_model=TINY, rank=RANK).result()
        for _ in range(3):
            his.save_weights_and_get_sampling_client().result()
        sampler.sample(prompt, 1, params).result()  # HOLE: NotFoundError "evicted" today
    finally:
        alice.close("success").result()
        bob.close("success").result()
