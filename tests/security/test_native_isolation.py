"""Bob against alice through the notebook API (/openrl/v1): her notebook runs, her Tinker-SDK runs,
her job's kept runs, her samples, her checkpoints and her event stream.

Already held elsewhere: bob's GET and sample of alice's notebook run are 404 and her run is not in his
list (tests/service/test_native_api.py::test_run_lifecycle_and_tenancy), his load_from of her
checkpoint is refused and leaves no run (tests/service/test_load_from.py::test_bad_load_from_is_refused_naming_the_field),
his panel cannot stop her run (tests/server/test_control.py::test_another_tenants_run_cannot_be_stopped),
and the tick's "runs" are his own (tests/service/test_telemetry.py::test_tick_schema_2_fields_and_labels_on_cpu).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

import pytest
import tinker

from openrl_service.engine import native as native_module
from tests.conftest import ALICE_KEY, BOB_KEY, TINY
from tests.security.conftest import V1, refused, sse_until


@dataclass
class Alices:
    notebook: str  # a notebook run with metrics rows, a checkpoint and stored samples
    sdk: str  # a Tinker-SDK training run
    kept: str  # her detached job's run, ended and kept with the job
    job: str
    samples: list[str]
    checkpoint: str  # tinker:// path of the notebook run's checkpoint


def sampled(c, run_id: str, n: int = 2) -> list[str]:
    r = c.post(f"{V1}/runs/{run_id}/sample", json={"prompts": ["Hi"], "num_samples": n, "max_tokens": 3})
    assert r.status_code == 200, r.text
    return [s["sample_id"] for s in r.json()["samples"]]


@pytest.fixture(scope="module")
def alices(live, alice) -> Alices:
    notebook = alice.post(f"{V1}/runs", json={"name": "alice-notebook", "seed": 0, "rank": 4}).json()[
        "run_id"
    ]
    samples = sampled(alice, notebook)
    step = alice.post(
        f"{V1}/runs/{notebook}/train_step",
        json={"samples": [{"sample_id": s, "advantage": 1.0} for s in samples]},
    )
    assert step.status_code == 200, step.text
    assert (
        alice.post(f"{V1}/runs/{notebook}/metrics", json={"step": 1, "reward_mean": 0.5}).status_code == 201
    )
    checkpoint = alice.post(f"{V1}/runs/{notebook}/checkpoints", json={"name": "nb"}).json()["path"]
    samples = sampled(alice, notebook)  # fresh ones, for bob to try to train on
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    sdk = sc.create_lora_training_client(base_model=TINY, rank=4).result().model_id
    data = b"opaque payload"
    job = alice.post(
        f"{V1}/jobs",
        json={
            "name": "alice-job",
            "kind": "run",
            "where": "local",
            "payload": base64.b64encode(data).decode(),
            "payload_sha256": hashlib.sha256(data).hexdigest(),
        },
    ).json()
    with live.client(job["key"]) as jk:
        kept = jk.post(f"{V1}/runs", json={"name": "alice-job-run"}).json()["run_id"]
        assert jk.post(f"{V1}/runs/{kept}/metrics", json={"step": 1, "reward_mean": 0.25}).status_code == 201
        assert jk.delete(f"{V1}/runs/{kept}").status_code == 200  # ended: kept with the job
    assert alice.get(f"{V1}/runs/{kept}").json()["ended"] is True
    yield Alices(notebook, sdk, kept, job["job_id"], samples, checkpoint)
    sc.close("success").result()


# Every notebook-API route that names a run, as bob; each must be 404 for each of alice's runs.
ROUTES = {
    "get": ("GET", "", None),
    "heartbeat": ("POST", "/heartbeat", {"state": "stopped"}),
    "pause": ("POST", "/control", {"action": "pause", "reason": "mine now"}),
    "stop": ("POST", "/control", {"action": "stop"}),
    "delete": ("DELETE", "", None),
    "sample": ("POST", "/sample", {"prompts": ["Hi"], "max_tokens": 2}),
    "train_step": ("POST", "/train_step", {"samples": [{"sample_id": "smp-x", "advantage": 1.0}]}),
    "save_checkpoint": ("POST", "/checkpoints", {"name": "stolen", "overwrite": True}),
    "list_checkpoints": ("GET", "/checkpoints", None),
    "add_metrics": ("POST", "/metrics", {"step": 9, "reward_mean": -1.0}),
    "read_metrics": ("GET", "/metrics", None),
}


@pytest.mark.parametrize("which", ["notebook", "sdk", "kept"])
@pytest.mark.parametrize("route", ROUTES)
def test_every_run_route_on_another_tenants_run_is_not_found(bob, alices, route, which, alice_unchanged):
    """Attack: bob calls each run route (read, heartbeat, pause, stop, delete, sample, train, save,
    list checkpoints, add and read metrics) on alice's notebook run, her Tinker-SDK run, and her
    detached job's ended (kept) run."""
    method, suffix, body = ROUTES[route]
    run_id = getattr(alices, which)
    r = bob.request(method, f"{V1}/runs/{run_id}{suffix}", json=body)
    assert "unknown run" in refused(r, 404)["error"]


def test_my_runs_list_holds_none_of_another_tenants_runs(bob, alices):
    """Attack: bob lists every run he can see (?include=all: notebook, Tinker SDK, jobs' kept runs)."""
    listed = bob.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]
    assert not {r["run_id"] for r in listed} & {alices.notebook, alices.sdk, alices.kept}


def test_training_on_another_tenants_samples_is_refused(bob, alices, alice_unchanged):
    """Attack: bob trains HIS run on alice's sample ids (her prompts and completions, kept by the
    service for her next train_step)."""
    mine = bob.post(f"{V1}/runs", json={"name": "bob-thief", "seed": 1, "rank": 4}).json()["run_id"]
    try:
        items = [{"sample_id": s, "advantage": 1.0} for s in alices.samples]
        r = bob.post(f"{V1}/runs/{mine}/train_step", json={"samples": items})
        assert "is unknown for this run" in refused(r, 404)["error"]
        assert bob.get(f"{V1}/runs/{mine}").json()["step"] == 0
    finally:
        bob.delete(f"{V1}/runs/{mine}")


def test_loading_another_tenants_checkpoint_into_a_new_run_is_refused(bob, alices, alice_unchanged):
    """Attack: bob creates a run that starts from alice's notebook checkpoint (load_from)."""
    before = bob.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]
    r = bob.post(f"{V1}/runs", json={"name": "bob-loads", "rank": 4, "load_from": alices.checkpoint})
    assert refused(r, 404)["field"] == "load_from"
    assert bob.get(f"{V1}/runs", params={"include": "all"}).json()["runs"] == before


def test_an_idempotency_key_another_tenant_used_creates_my_own_run(alice, bob, alices):
    """Attack: bob re-sends alice's run creation with her X-Idempotency-Key, hoping for her reply
    (her run's id, which would then answer him as if it were his)."""
    key = {"X-Idempotency-Key": "native-shared-0001"}
    body = {"name": "same-name", "seed": 3, "rank": 4}
    hers = alice.post(f"{V1}/runs", json=body, headers=key)
    theirs = bob.post(f"{V1}/runs", json=body, headers=key)
    try:
        assert hers.status_code == theirs.status_code == 201, (hers.text, theirs.text)
        assert theirs.json()["run_id"] != hers.json()["run_id"]
        assert bob.get(f"{V1}/runs/{theirs.json()['run_id']}").status_code == 200
        refused(bob.get(f"{V1}/runs/{hers.json()['run_id']}"), 404)
    finally:
        alice.delete(f"{V1}/runs/{hers.json()['run_id']}")
        bob.delete(f"{V1}/runs/{theirs.json()['run_id']}")


def test_another_tenants_events_never_reach_my_event_stream(live, alice, alices):
    """Attack: bob keeps /openrl/v1/events open while alice creates, samples, trains, reports
    metrics, pauses, resumes, saves and deletes runs. His stream carries his own events (a run he
    creates last, the marker), ticks, and nothing of hers: no run id, name, metric or reward."""
    with live.client(BOB_KEY) as b, b.stream("GET", f"{V1}/events") as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        sse_until(lines, lambda kind, _: kind == "tick")  # subscribed: her events would reach it now
        run = alice.post(f"{V1}/runs", json={"name": "alice-secret-name", "seed": 0, "rank": 4}).json()[
            "run_id"
        ]
        ids = sampled(alice, run)
        alice.post(
            f"{V1}/runs/{run}/train_step", json={"samples": [{"sample_id": s, "advantage": 1} for s in ids]}
        )
        alice.post(f"{V1}/runs/{run}/metrics", json={"step": 1, "reward_mean": 0.123456})
        alice.post(f"{V1}/runs/{run}/control", json={"action": "pause", "reason": "alice-secret-reason"})
        alice.post(f"{V1}/runs/{run}/heartbeat", json={"state": "paused"})
        alice.post(f"{V1}/runs/{run}/control", json={"action": "resume"})
        alice.post(f"{V1}/runs/{run}/checkpoints", json={"name": "alice-secret-ckpt"})
        alice.post(f"{V1}/runs/{alices.notebook}/control", json={"action": "pause"})
        alice.post(f"{V1}/runs/{alices.notebook}/control", json={"action": "resume"})
        alice.delete(f"{V1}/runs/{run}")
        marker = b.post(f"{V1}/runs", json={"name": "bob-marker", "rank": 4}).json()["run_id"]
        events, text = sse_until(lines, lambda kind, d: kind == "run" and d.get("run_id") == marker)
        b.delete(f"{V1}/runs/{marker}")
    runs = [d for kind, d in events if kind == "run"]
    assert runs and {d["run_id"] for d in runs} == {marker}, runs
    for secret in (
        run,
        alices.notebook,
        "alice-secret-name",
        "alice-secret-reason",
        "alice-secret-ckpt",
        "0.123456",
    ):
        assert secret not in text, secret
    assert all(set(d["runs"]) <= {marker} for kind, d in events if kind == "tick")


def test_my_idempotent_posts_do_not_evict_another_tenants_remembered_reply(live, alice, bob, monkeypatch):
    """Attack: bob sends many idempotent POSTs (each with a new X-Idempotency-Key) until the service's
    store of remembered replies is full, so that alice's retry of a request whose reply she lost is
    run again instead of answered. The store's bound is made small here (3) instead of sending
    10,000 requests."""
    monkeypatch.setattr(live.parts.native.replies, "max_entries", 3)
    key = {"X-Idempotency-Key": "alice-create-0001"}
    body = {"name": "alice-once", "seed": 5, "rank": 4}
    first = alice.post(f"{V1}/runs", json=body, headers=key)
    mine = bob.post(f"{V1}/runs", json={"name": "bob-flood", "rank": 4}).json()["run_id"]
    try:
        for i in range(3):
            r = bob.post(
                f"{V1}/runs/{mine}/metrics", json={"step": i}, headers={"X-Idempotency-Key": f"bob-{i}"}
            )
            assert r.status_code == 201, r.text
        retry = alice.post(f"{V1}/runs", json=body, headers=key)  # her reply was lost: she re-sends
        runs = [r["run_id"] for r in alice.get(f"{V1}/runs").json()["runs"] if r["name"] == "alice-once"]
        assert retry.json()["run_id"] == first.json()["run_id"] and len(runs) == 1, runs
    finally:
        for r in alice.get(f"{V1}/runs").json()["runs"]:
            if r["name"] == "alice-once":
                alice.delete(f"{V1}/runs/{r['run_id']}")
        bob.delete(f"{V1}/runs/{mine}")


def test_my_sampling_does_not_evict_another_tenants_stored_samples(live, alice, bob, monkeypatch):
    """Attack: bob samples until the service's store of completions (kept for a later train_step)
    is full, so alice's samples are dropped before she trains on them. The store's bound is made
    small here (4) instead of sampling 200,000 completions."""
    monkeypatch.setattr(native_module, "MAX_STORED_SAMPLES", 4)
    hers = alice.post(f"{V1}/runs", json={"name": "alice-rl", "seed": 0, "rank": 4}).json()["run_id"]
    his = bob.post(f"{V1}/runs", json={"name": "bob-flood", "seed": 0, "rank": 4}).json()["run_id"]
    try:
        ids = sampled(alice, hers, 2)
        sampled(bob, his, 4)
        r = alice.post(
            f"{V1}/runs/{hers}/train_step", json={"samples": [{"sample_id": s, "advantage": 1} for s in ids]}
        )
        assert r.status_code == 200, r.text
    finally:
        alice.delete(f"{V1}/runs/{hers}")
        bob.delete(f"{V1}/runs/{his}")


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", f"{V1}/events"), ("GET", f"{V1}/runs"), ("POST", f"{V1}/runs"), ("GET", f"{V1}/jobs")],
)
@pytest.mark.parametrize(
    "headers", [{"Host": "evil.example"}, {"Origin": "http://evil.example"}, {"Origin": "null"}]
)
def test_a_rebinding_or_cross_origin_page_cannot_use_the_notebook_api(live, method, path, headers):
    """Attack: a page in the user's browser drives the notebook API (events, runs, jobs) through DNS
    rebinding (a foreign Host) or cross-origin (a foreign or opaque Origin), even with a valid key.
    tests/service/test_auth.py holds the same on the Tinker routes."""
    with live.client(ALICE_KEY) as c:
        r = c.request(
            method, path, headers=headers, json={"name": "from-a-page"} if method == "POST" else None
        )
    refused(r, 400, 403)
    assert not any(h.lower().startswith("access-control-") for h in r.headers)
