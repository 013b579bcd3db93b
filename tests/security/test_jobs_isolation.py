"""Detached jobs (/openrl/v1/jobs): a job's key used beyond its job, and another tenant's jobs.

A job key (``tml-job-…``) sits in a worker process or a Kubernetes Secret; if it leaks, it must reach
that one job and the runs it made, nothing else. Already held elsewhere: the key's scope against its
own tenant's other runs and jobs, the Tinker API, /metrics and minting; revocation at a terminal state
and at DELETE; the reserved job label (tests/service/test_jobs_api.py::test_a_local_job_key_drives_its_own_runs_and_nothing_else,
::test_retried_reports_and_payloads_are_answered_not_refused_or_duplicated,
::test_the_job_label_is_reserved_for_job_keys); bob's ordinary key on alice's job by id and by name
(::test_names_are_unique_among_active_jobs_and_tenants_are_isolated). This module adds a job key against
ANOTHER tenant, against its own tenant's other job's runs (live and kept), path tricks around its
scope check, load_from, and job names that look like another tenant's job id.
"""

from __future__ import annotations

import base64
import hashlib
import uuid

import httpx
import pytest
import tinker

from tests.conftest import ALICE_KEY, BOB_KEY, TINY
from tests.security.conftest import V1, refused


def submit(c: httpx.Client, name: str, data: bytes) -> dict:
    r = c.post(
        f"{V1}/jobs",
        json={
            "name": name,
            "kind": "run",
            "where": "local",
            "payload": base64.b64encode(data).decode(),
            "payload_sha256": hashlib.sha256(data).hexdigest(),
        },
    )
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture(scope="module")
def jobs(live, alice, bob):
    """alice's job J1 (its key, a live run), her job J2 (a live run and an ended, kept one) and bob's
    job with a live run, plus a run of bob's own and a checkpoint of his."""
    j1, j2 = submit(alice, "alice-j1", b"alice payload one"), submit(alice, "alice-j2", b"alice payload two")
    bj = submit(bob, "bob-j", b"bob payload")
    runs = {}
    for tag, job in (("j1", j1), ("j2", j2), ("bob-j", bj)):
        with live.client(job["key"]) as jk:
            runs[tag] = jk.post(f"{V1}/runs", json={"name": f"{tag}-run", "rank": 4}).json()["run_id"]
    with live.client(j2["key"]) as jk:
        runs["j2-kept"] = jk.post(f"{V1}/runs", json={"name": "j2-kept", "rank": 4}).json()["run_id"]
        assert jk.delete(f"{V1}/runs/{runs['j2-kept']}").status_code == 200
    runs["bob"] = bob.post(f"{V1}/runs", json={"name": "bob-own", "rank": 4}).json()["run_id"]
    sc = tinker.ServiceClient(base_url=live.url, api_key=BOB_KEY)
    bob_ckpt = (
        sc.create_lora_training_client(base_model=TINY, rank=4).result().save_state("bob-ck").result().path
    )
    yield {"j1": j1, "j2": j2, "bob-j": bj, "runs": runs, "bob_ckpt": bob_ckpt}
    sc.close("success").result()


RUN_CALLS = [
    ("GET", "", None),
    ("GET", "/metrics", None),
    ("GET", "/checkpoints", None),
    ("POST", "/heartbeat", {"state": "stopped"}),
    ("POST", "/control", {"action": "stop"}),
    ("POST", "/sample", {"prompts": ["Hi"], "max_tokens": 2}),
    ("POST", "/checkpoints", {"name": "by-a-job"}),
    ("POST", "/metrics", {"step": 3, "reward_mean": -1.0}),
    ("DELETE", "", None),
]


@pytest.mark.parametrize("target", ["bob", "bob-j"])
def test_a_job_key_cannot_touch_another_tenants_runs(live, bob, jobs, target):
    """Attack: alice's job key (leaked from her worker) on bob's own run and on his job's run: read,
    metrics, checkpoints, heartbeat, stop, sample, save, add metrics, delete."""
    run_id = jobs["runs"][target]
    before = bob.get(f"{V1}/runs/{run_id}").json()
    with live.client(jobs["j1"]["key"]) as jk:
        for method, suffix, body in RUN_CALLS:
            body = refused(jk.request(method, f"{V1}/runs/{run_id}{suffix}", json=body), 403)
            assert jobs["j1"]["job_id"] in body["error"]
    after = bob.get(f"{V1}/runs/{run_id}").json()
    assert (after["control"], after["step"], after["metrics_count"]) == (
        before["control"],
        before["step"],
        before["metrics_count"],
    )


@pytest.mark.parametrize("target", ["j2", "j2-kept"])
def test_a_job_key_cannot_reach_another_jobs_runs(live, alice, jobs, target):
    """Attack: alice's job J1's key on the runs of her other job J2, the live one and the ended
    (kept) one: the same tenant, but not its job."""
    run_id = jobs["runs"][target]
    with live.client(jobs["j1"]["key"]) as jk:
        for method, suffix, body in RUN_CALLS:
            refused(jk.request(method, f"{V1}/runs/{run_id}{suffix}", json=body), 403)
        listed = {r["run_id"] for r in jk.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]}
    assert listed == {jobs["runs"]["j1"]}
    assert alice.get(f"{V1}/runs/{run_id}").status_code == 200  # still there for its owner


def test_a_job_key_cannot_escape_its_scope_through_the_path(live, jobs):
    """Attack: J1's key wraps a forbidden route in its own allowed prefixes: encoded slashes, encoded
    dot segments, doubled and trailing slashes, another case, a query string. Nothing it gets back
    is another job's or another run's: each answer is an error body alone."""
    own_job, own_run = jobs["j1"]["job_id"], jobs["runs"]["j1"]
    other_job, other_run = jobs["j2"]["job_id"], jobs["runs"]["j2"]
    secret = base64.b64encode(b"alice payload two").decode()
    paths = [
        f"{V1}/runs/{own_run}/%2E%2E/{other_run}",
        f"{V1}/runs/{own_run}/%2E%2E%2F{other_run}/control",
        f"{V1}/runs/{own_run}%2F%2E%2E%2F{other_run}",
        f"{V1}/runs/{own_run}/%2E%2E/%2E%2E/jobs/{other_job}/payloads",
        f"{V1}/jobs/{own_job}/%2E%2E/{other_job}/payloads",
        f"{V1}/jobs/{own_job}%2F%2E%2E%2F{other_job}/payloads",
        f"{V1}/jobs/{own_job}/payloads/%2E%2E/%2E%2E/{other_job}/payloads",
        f"{V1}/jobs/{other_job}/payloads?job={own_job}",
        f"{V1}//jobs/{other_job}/payloads",
        f"{V1}/jobs/{other_job}/payloads/",
        f"/OPENRL/v1/jobs/{other_job}/payloads",
        f"{V1}/jobs/{own_job}/",
        f"{V1}/runs/",
        f"{V1}/runs//{other_run}",
    ]
    with live.client(jobs["j1"]["key"]) as jk:
        for path in paths:
            for method in ("GET", "POST", "DELETE"):
                r = jk.request(method, path, json={"action": "stop"} if method == "POST" else None)
                refused(r, 403, 404, 405)  # an error and nothing else
                assert secret not in r.text, (method, path)


def test_a_job_key_cannot_start_from_another_tenants_checkpoint(live, jobs):
    """Attack: alice's job key creates a run that loads bob's checkpoint (load_from)."""
    with live.client(jobs["j1"]["key"]) as jk:
        r = jk.post(f"{V1}/runs", json={"name": "thief", "rank": 4, "load_from": jobs["bob_ckpt"]})
        assert refused(r, 404)["field"] == "load_from"
        listed = {r["run_id"] for r in jk.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]}
    assert listed == {jobs["runs"]["j1"]}


def test_another_tenants_job_key_cannot_read_or_report_my_job(live, jobs):
    """Attack: bob's job key on alice's job: read it, its payloads (her reward's pickled code) by id and
    by name, report it failed, hot-swap its payload, control, delete."""
    jid, name = jobs["j1"]["job_id"], jobs["j1"]["name"]
    x = base64.b64encode(b"x").decode()
    with live.client(jobs["bob-j"]["key"]) as bk:
        for method, path, body in [
            ("GET", f"{V1}/jobs/{jid}", None),
            ("GET", f"{V1}/jobs/{name}", None),
            ("GET", f"{V1}/jobs/{jid}/payloads", None),
            ("GET", f"{V1}/jobs/{name}/payloads", None),
            ("POST", f"{V1}/jobs/{jid}/state", {"state": "failed", "message": "bob was here"}),
            (
                "POST",
                f"{V1}/jobs/{jid}/payloads",
                {"payload": x, "payload_sha256": hashlib.sha256(b"x").hexdigest()},
            ),
            ("POST", f"{V1}/jobs/{jid}/control", {"action": "stop"}),
            ("DELETE", f"{V1}/jobs/{jid}", None),
        ]:
            refused(bk.request(method, path, json=body), 403)
    with live.client(ALICE_KEY) as alice:
        mine = alice.get(f"{V1}/jobs/{jid}").json()
    assert mine["state"] == "submitted" and mine["control"] is None and len(mine["payload_versions"]) == 1


def test_a_job_named_like_another_tenants_job_resolves_to_my_own(live, bob, jobs):
    """Attack: bob names his job after alice's job id (and another after her job's name), then asks
    for that id or name and its payloads, hoping the lookup by name falls through to her job."""
    jid, name = jobs["j1"]["job_id"], jobs["j1"]["name"]
    impostors = [submit(bob, jid, b"bob's decoy"), submit(bob, name, b"bob's decoy 2")]
    try:
        for ref, mine in zip((jid, name), impostors, strict=True):
            got = bob.get(f"{V1}/jobs/{ref}")
            assert got.status_code == 200 and got.json()["job_id"] == mine["job_id"]
            payloads = bob.get(f"{V1}/jobs/{ref}/payloads").json()["payloads"]
            assert [base64.b64decode(p["payload"]) for p in payloads][0].startswith(b"bob's decoy")
        with live.client(ALICE_KEY) as alice:
            assert alice.get(f"{V1}/jobs/{jid}").json()["name"] == name  # hers, for her
    finally:
        for job in impostors:
            bob.delete(f"{V1}/jobs/{job['job_id']}")


def test_a_made_up_job_key_is_a_plain_401(live, jobs):
    """Attack: guess a job key (the tml-job- prefix with random text): an unknown key, nothing more."""
    with live.client("tml-job-" + uuid.uuid4().hex) as guess:
        for path in (f"{V1}/jobs/{jobs['j1']['job_id']}/payloads", f"{V1}/runs/{jobs['runs']['j1']}"):
            body = refused(guess.get(path), 401)
            assert jobs["j1"]["name"] not in body["error"]
