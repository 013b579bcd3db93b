"""One tenant cannot use up what every tenant shares: checkpoint bytes, live runs, sampler snapshots.

Each limit answers a 4xx that names the quota and how to free it, and what one tenant does to reach
its limit never costs another tenant anything (the attack: fill the disk or the snapshot budget so
that a neighbour's save fails or their sampler is evicted). Jobs and minted keys have their own
per-tenant limits (tests/service/test_jobs_api.py, tests/service/test_hub_identity.py).
"""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from openrl_service.config import Limits
from tests._support.raw import RawTinker
from tests.conftest import ALICE_KEY, BOB_KEY, TINY
from tests.service.test_full_finetune import footprint

PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [11, 12]}]}


def test_a_tenant_filling_the_snapshot_budget_evicts_its_own_snapshots_not_a_neighbours(make_server):
    live = make_server(max_sampler_snapshots=4)
    with live.client(ALICE_KEY) as a, live.client(BOB_KEY) as b:
        alice, bob = RawTinker(a), RawTinker(b)
        bob_model = bob.create_model(bob.session())
        bobs = bob.snapshot(bob_model, 1)
        alice_model = alice.create_model(alice.session())
        alices = [alice.snapshot(alice_model, seq) for seq in range(1, 9)]  # twice the whole budget
        ok = bob.post("asample", sampling_session_id=bobs, num_samples=1, prompt=PROMPT)
        assert ok.status_code == 200, ok.text  # bob's one snapshot survived alice's flood
        gone = alice.post("asample", sampling_session_id=alices[0], num_samples=1, prompt=PROMPT)
        assert gone.status_code == 404 and "evicted" in gone.json()["error"], gone.text
        newest = alice.post("asample", sampling_session_id=alices[-1], num_samples=1, prompt=PROMPT)
        assert newest.status_code == 200, newest.text
        alice.finish_sessions()
        bob.finish_sessions()


def test_over_the_byte_budget_the_tenant_holding_the_most_bytes_gives_way(make_server, tiny_model_dir):
    """The attack: alice's full fine-tune makes sampler snapshots, each a whole copy of the model, until
    the service's snapshot bytes are full. Bob holds more snapshots than she does, but small LoRA ones:
    over the byte budget the tenant holding the most bytes gives way, not the one holding the most
    snapshots; and a snapshot bigger than the whole budget is kept without costing anybody else."""
    whole = footprint(tiny_model_dir) // 4  # one float32 copy of the tiny model
    for budget in (int(whole * 1.5), int(whole * 0.5)):  # room for one full snapshot; for none
        live = make_server(max_sampler_snapshot_bytes=budget)
        with live.client(ALICE_KEY) as a, live.client(BOB_KEY) as b:
            alice, bob = RawTinker(a), RawTinker(b)
            bob_model = bob.create_model(bob.session(), rank=2)
            bobs = [bob.snapshot(bob_model, seq) for seq in (1, 2, 3)]
            alice_model = alice.create_model(alice.session(), rank=0)
            alices = [alice.snapshot(alice_model, seq) for seq in (1, 2)]
            for sid in bobs:
                ok = bob.post("asample", sampling_session_id=sid, num_samples=1, prompt=PROMPT)
                assert ok.status_code == 200, (budget, ok.text)
            first = alice.post("asample", sampling_session_id=alices[0], num_samples=1, prompt=PROMPT)
            assert first.status_code == 404 and "evicted" in first.json()["error"], first.text
            newest = alice.post("asample", sampling_session_id=alices[1], num_samples=1, prompt=PROMPT)
            assert newest.status_code == 200, newest.text
            alice.finish_sessions()
            bob.finish_sessions()


def test_a_tenant_has_its_own_snapshot_quota_named_when_its_sampler_was_evicted(make_server):
    live = make_server(max_sampler_snapshots=100, max_sampler_snapshots_per_tenant=2)
    with live.client(ALICE_KEY) as a:
        alice = RawTinker(a)
        model = alice.create_model(alice.session())
        ids = [alice.snapshot(model, seq) for seq in (1, 2, 3)]
        gone = alice.post("asample", sampling_session_id=ids[0], num_samples=1, prompt=PROMPT)
        assert gone.status_code == 404, gone.text
        assert "OPENRL_MAX_SAMPLER_SNAPSHOTS_PER_TENANT" in gone.json()["error"], gone.text
        assert (
            alice.post("asample", sampling_session_id=ids[2], num_samples=1, prompt=PROMPT).status_code == 200
        )
        alice.finish_sessions()


def test_checkpoint_bytes_are_a_per_tenant_quota_that_names_itself_and_how_to_free_it(make_server):
    live = make_server()
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    rest = tinker.RestClient(base_url=live.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    first = tc.save_state("one").result().path
    size = {c.tinker_path: c.size_bytes for c in rest.list_checkpoints(tc.model_id).result().checkpoints}[
        first
    ]
    live.service.settings.limits.max_checkpoint_bytes_per_tenant = int(size * 2.5)  # room for two
    tc.save_state("two").result()
    with pytest.raises(tinker.RequestFailedError) as refused:  # a save is a future: its result says why
        tc.save_state("three").result()
    text = str(refused.value)
    assert "OPENRL_MAX_CHECKPOINT_BYTES_PER_TENANT" in text and "delete" in text, text
    listed = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert sorted(listed) == ["weights/one", "weights/two"]  # nothing half-written stays
    # another tenant is not charged for alice's bytes
    bob = tinker.ServiceClient(base_url=live.url, api_key=BOB_KEY)
    bob_tc = bob.create_lora_training_client(base_model=TINY, rank=4).result()
    assert bob_tc.save_state("mine").result().path.endswith("/weights/mine")
    # deleting frees the room; an overwrite counts only the difference
    rest.delete_checkpoint_from_tinker_path(first).result()
    tc.save_state("three").result()
    with pytest.raises(tinker.RequestFailedError, match="OPENRL_MAX_CHECKPOINT_BYTES_PER_TENANT"):
        tc.save_weights_for_sampler("s").result()  # sampler weights count too
    sc.close("success").result()
    bob.close("success").result()


def test_live_runs_are_a_per_tenant_quota_and_a_neighbour_can_still_create(make_server):
    live = make_server(limits=Limits(max_runs_per_tenant=2))
    alice = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    for _ in range(2):
        alice.create_lora_training_client(base_model=TINY, rank=2).result()
    with pytest.raises(tinker.APIStatusError) as refused:
        alice.create_lora_training_client(base_model=TINY, rank=2).result()
    assert "OPENRL_MAX_RUNS_PER_TENANT" in str(refused.value) and "finish" in str(refused.value)
    assert refused.value.status_code == 403  # not a 409, which the SDK retries for a minute
    bob = tinker.ServiceClient(base_url=live.url, api_key=BOB_KEY)
    tc = bob.create_lora_training_client(base_model=TINY, rank=2).result()
    out = tc.forward_backward(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints([1, 2, 3]),
                loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0] * 3},
            )
        ],
        "cross_entropy",
    ).result()
    assert out.metrics
    alice.close("success").result()
    bob.close("success").result()


def test_full_fine_tunes_are_a_per_tenant_quota_and_a_neighbour_can_still_start_one(make_server):
    """The attack: alice opens full fine-tunes (rank 0) until every other full run on the device spends its
    time waiting on disk, and the spill folder fills the disk. Each is a whole copy of the model's
    training state, so a tenant holds at most OPENRL_MAX_FULL_RUNS_PER_TENANT of them."""
    live = make_server(limits=Limits(max_full_runs_per_tenant=1))
    alice = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    alice.create_lora_training_client(base_model=TINY, rank=0).result()
    with pytest.raises(tinker.APIStatusError) as refused:
        alice.create_lora_training_client(base_model=TINY, rank=0).result()
    text = str(refused.value)
    assert refused.value.status_code == 403, text
    assert "OPENRL_MAX_FULL_RUNS_PER_TENANT" in text and "rank" in text and "LoRA" in text, text
    alice.create_lora_training_client(base_model=TINY, rank=2).result()  # a LoRA run still may start
    bob = tinker.ServiceClient(base_url=live.url, api_key=BOB_KEY)
    bobs = bob.create_lora_training_client(base_model=TINY, rank=0).result()  # a neighbour's full run too
    assert (
        bobs.forward_backward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0] * 3},
                )
            ],
            "cross_entropy",
        )
        .result()
        .metrics
    )
    alice.close("success").result()  # finishing the session frees its runs
    again = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    again.create_lora_training_client(base_model=TINY, rank=0).result()
    again.close("success").result()
    bob.close("success").result()


def test_a_tenant_filling_the_queue_does_not_get_a_neighbours_sampling_refused(make_server):
    """The attack: bob queues sampling requests until the service's queue is full, so that alice's
    sampling is refused with 429. Over OPENRL_MAX_QUEUED_TOTAL only a tenant holding at least its
    share of the queue is refused."""
    from tests._support.raw import result
    from tests.service.test_scheduling import asample, held_worker, sampler

    live = make_server(limits=Limits(max_queued_per_run=8, max_queued_total=2))
    svc = live.service
    with live.client(ALICE_KEY) as a, live.client(BOB_KEY) as b:
        alice, bob = RawTinker(a), RawTinker(b)
        bobs = sampler(bob, bob.session(), 0)
        hers = sampler(alice, alice.session(), 0)
        with held_worker(svc.engine, svc.futures):
            assert asample(b, bobs).status_code == 200
            assert asample(b, bobs).status_code == 200  # the service's queue is full: 2 of 2
            over = asample(b, bobs)
            assert over.status_code == 429 and over.json()["limit"] == "OPENRL_MAX_QUEUED_TOTAL", over.text
            mine = asample(a, hers)
            assert mine.status_code == 200, mine.text  # alice holds nothing queued: she is not refused
        assert "error" not in result(a, mine.json()["request_id"])
        alice.finish_sessions()
        bob.finish_sessions()


def test_live_sessions_are_a_per_tenant_quota(make_server):
    """A client that opens sessions in a loop (each holds memory and a record on disk) is refused at
    OPENRL_MAX_SESSIONS_PER_TENANT with a 403 naming it; finishing one frees room; bob is unaffected."""
    live = make_server(limits=Limits(max_sessions_per_tenant=2))
    with live.client(ALICE_KEY) as a, live.client(BOB_KEY) as b:
        alice, bob = RawTinker(a), RawTinker(b)
        first, _ = alice.session(), alice.session()
        over = alice.post("create_session")
        assert over.status_code == 403, over.text
        assert "OPENRL_MAX_SESSIONS_PER_TENANT" in over.json()["error"] and "finish" in over.json()["error"]
        assert bob.session()  # another tenant opens its own
        assert alice.post("session_heartbeat", session_id=first).status_code == 200  # the live ones work
        alice.finish_sessions()
        assert alice.session()  # room again
        alice.finish_sessions()
        bob.finish_sessions()


def test_notebook_runs_count_against_the_session_quota(make_server):
    live = make_server(limits=Limits(max_sessions_per_tenant=1))
    with live.client(ALICE_KEY) as a:
        first = a.post("/openrl/v1/runs", json={"name": "one", "rank": 2})
        assert first.status_code == 201, first.text
        second = a.post("/openrl/v1/runs", json={"name": "two", "rank": 2})
        assert second.status_code == 403 and "OPENRL_MAX_SESSIONS_PER_TENANT" in second.json()["error"]
        assert a.delete(f"/openrl/v1/runs/{first.json()['run_id']}").status_code in (200, 204)
        assert a.post("/openrl/v1/runs", json={"name": "two", "rank": 2}).status_code == 201


def test_recorded_sequences_over_the_byte_budget_drop_the_heaviest_tenants_not_a_neighbours():
    """The attack: alice samples with record_stability_info=True until the service's memory for
    stable_reinforce records is full, so that bob's recorded sequences are dropped and his training
    request is refused. Over OPENRL_MAX_STABILITY_BYTES the tenant holding the most bytes gives way."""
    from types import SimpleNamespace

    from openrl_service.engine.stability import StabilityRecords

    seq = SimpleNamespace(tokens=list(range(100)), logprobs=[-1.0] * 100)
    one_request = StabilityRecords(max_per_tenant=10_000, max_bytes=1 << 30)
    one_request.record("alice", "s", [f"r:{i}" for i in range(4)], list(range(1000)), [seq] * 4)
    assert one_request.held_bytes("alice") < 4 * 4 * 1000  # less than four copies of the (int32) prompt alone
    capped = StabilityRecords(max_per_tenant=1, max_bytes=1 << 30)
    capped.record("alice", "s", [f"r:{i}" for i in range(4)], list(range(1000)), [seq] * 4)
    assert capped.count("alice") == 1 and capped.held_bytes("alice") >= 4 * 1000  # the prompt it keeps

    records = StabilityRecords(max_per_tenant=10_000, max_bytes=50_000)
    records.record("bob", "s", ["b:0"], [1, 2, 3], [seq])
    for k in range(200):
        records.record("alice", "s", [f"a{k}:{i}" for i in range(4)], list(range(50)), [seq] * 4)
    assert records.count("bob") == 1  # bob's record survived alice's flood
    assert records.held_bytes("alice") + records.held_bytes("bob") <= 50_000
    assert 0 < records.count("alice") < 800  # alice lost her least recently used ones
    records.forget("alice")
    assert records.held_bytes("alice") == 0 and records.count("bob") == 1


def test_exports_count_in_the_tenants_checkpoint_bytes(make_server):
    """Attack: keep the disk filling with exports (each a merged copy of the model) beyond the checkpoint
    quota. They count in the tenant's bytes, an export over the quota is refused naming it, and deleting
    the checkpoint frees its exports' bytes."""
    live = make_server()
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    path = tc.save_weights_for_sampler("s").result().path
    store = live.service.store
    alone = store.tenant_bytes("alice")
    with live.client(ALICE_KEY) as alice:
        r = alice.post("/api/v1/exports", json={"tinker_path": path, "merged": False})
        assert r.status_code == 200, r.text
        exported = sum(f["size_bytes"] for f in r.json()["files"])
        assert store.tenant_bytes("alice") == alone + exported
        live.service.settings.limits.max_checkpoint_bytes_per_tenant = store.tenant_bytes("alice") + 1024
        r = alice.post("/api/v1/exports", json={"tinker_path": path, "merged": True})  # a whole model
        assert r.status_code == 403, r.text
        body = r.json()
        assert body["field"] == "tinker_path" and "OPENRL_MAX_CHECKPOINT_BYTES_PER_TENANT" in body["error"]
        assert "export" in body["error"] and "delete" in body["error"]
        assert not [p for p in store.exports_dir("alice").iterdir() if p.name.startswith(".tmp")]
        assert store.tenant_bytes("alice") == alone + exported  # the refused one left nothing
        # bob's bytes are his own: alice's exports do not count against him
        bob = tinker.ServiceClient(base_url=live.url, api_key=BOB_KEY)
        bob_path = (
            bob.create_lora_training_client(base_model=TINY, rank=4)
            .result()
            .save_weights_for_sampler("b")
            .result()
            .path
        )
        with live.client(BOB_KEY) as bob_http:
            r = bob_http.post("/api/v1/exports", json={"tinker_path": bob_path, "merged": False})
            assert r.status_code == 200, r.text
        tinker.RestClient(base_url=live.url, api_key=ALICE_KEY).delete_checkpoint_from_tinker_path(
            path
        ).result()
        assert store.tenant_bytes("alice") == 0
    sc.close("success").result()
    bob.close("success").result()
