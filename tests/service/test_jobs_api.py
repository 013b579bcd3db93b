"""Detached jobs (/openrl/v1/jobs): submit, the job-scoped key and its limits, payload versions, control
fan-out, revocation, Kubernetes through the launcher interface, tenancy, restarts, and payloads that
are stored as bytes and never unpickled. A real service on loopback, httpx as the client."""

from __future__ import annotations

import base64
import hashlib
import pickle
import time
import uuid

import httpx
import pytest

from openrl_service.errors import UserError
from tests.conftest import ALICE_KEY, BOB_KEY, start_server

V1 = "/openrl/v1"
PAYLOAD = b"\x80\x05 opaque cloudpickle bytes \x00\xff" * 10


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def body(job_name: str, /, data: bytes = PAYLOAD, **over) -> dict:
    """A submit body; ``over`` replaces fields (``...`` leaves one out)."""
    out = {
        "name": job_name,
        "kind": "run",
        "where": "local",
        "payload": b64(data),
        "payload_sha256": hashlib.sha256(data).hexdigest(),
        "reward": "letters",
        "meta": {"steps": 3, "model": "openrl/tiny", "cloudpickle": "3.1.1"},
    }
    out.update(over)
    return {k: v for k, v in out.items() if v is not ...}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def submit(c: httpx.Client, job_name: str, /, **over) -> dict:
    r = c.post(f"{V1}/jobs", json=body(job_name, **over))
    assert r.status_code == 201, r.text
    return r.json()


def keyed(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60)


def alive(url: str) -> None:
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200


def refused(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()
    for w in words:
        assert w in err["error"] or w == err.get("field"), (w, err)
    return err


@pytest.fixture
def alice(server):
    with server.client(ALICE_KEY) as c:
        yield c


def new_run(c: httpx.Client, name: str, **meta) -> dict:
    r = c.post(f"{V1}/runs", json={"name": name, "seed": 0, "user_metadata": meta})
    assert r.status_code == 201, r.text
    return r.json()


def test_a_local_job_key_drives_its_own_runs_and_nothing_else(server, alice):
    name = unique("job")
    job = submit(alice, name)
    assert job["state"] == "submitted" and job["where"] == "local" and job["kind"] == "run"
    assert job["key"].startswith("tml-job-") and job["key_id"] and job["runs"] == []
    assert job["payload_versions"][0]["sha256"] == hashlib.sha256(PAYLOAD).hexdigest()
    assert job["payload_versions"][0]["bytes"] == len(PAYLOAD) and "payload" not in job["payload_versions"][0]
    assert job["meta"]["steps"] == 3 and type(job["meta"]["steps"]) is int and job["k8s"] is None  # not 3.0
    jid = job["job_id"]
    mine = new_run(alice, unique("alice-own"))  # a run of the same tenant, not the job's
    other = submit(alice, unique("other"))
    try:
        with keyed(server.url, job["key"]) as jk:
            assert jk.get("/api/v1/get_server_capabilities").status_code == 200
            assert jk.get(f"{V1}/jobs/{jid}").json()["name"] == name
            assert [j["job_id"] for j in jk.get(f"{V1}/jobs").json()["jobs"]] == [jid]
            got = jk.get(f"{V1}/jobs/{jid}/payloads").json()["payloads"]
            assert [p["version"] for p in got] == [1] and base64.b64decode(got[0]["payload"]) == PAYLOAD
            # its runs are labelled with the job (other labels kept)
            run = new_run(jk, "job-run", **{"openrl.sweep": "s1"})
            assert run["user_metadata"] == {"openrl.sweep": "s1", "openrl.job": jid}
            rid = run["run_id"]
            s = jk.post(
                f"{V1}/runs/{rid}/sample", json={"prompts": ["Hi"], "num_samples": 2, "max_tokens": 4}
            )
            assert s.status_code == 200, s.text
            items = [
                {"sample_id": x["sample_id"], "advantage": a}
                for x, a in zip(s.json()["samples"], (1, -1), strict=True)
            ]
            step = jk.post(f"{V1}/runs/{rid}/train_step", json={"samples": items})
            assert step.status_code == 200 and step.json()["step"] == 1
            assert jk.post(f"{V1}/runs/{rid}/heartbeat", json={"state": "running"}).status_code == 200
            assert (
                jk.post(f"{V1}/runs/{rid}/metrics", json={"step": 1, "reward_mean": 0.5}).status_code == 201
            )
            assert [r["run_id"] for r in jk.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]] == [
                rid
            ]
            st = jk.post(f"{V1}/jobs/{jid}/state", json={"state": "running", "pid": 4242, "host": "laptop"})
            assert st.status_code == 200 and st.json()["state"] == "running" and st.json()["pid"] == 4242
            assert st.json()["runs"] == [rid]
            # the owner sees the run, with its labels, in the runs list
            listed = {r["run_id"]: r for r in alice.get(f"{V1}/runs").json()["runs"]}
            assert listed[rid]["user_metadata"]["openrl.job"] == jid and mine["run_id"] in listed
            # everything outside the job is refused, naming the job
            for method, path, payload in [
                ("POST", f"{V1}/runs/{mine['run_id']}/sample", {"prompts": ["Hi"]}),
                ("GET", f"{V1}/runs/{mine['run_id']}", None),
                ("DELETE", f"{V1}/runs/{mine['run_id']}", None),
                ("GET", f"{V1}/jobs/{other['job_id']}", None),
                ("GET", f"{V1}/jobs/{other['job_id']}/payloads", None),
                ("POST", f"{V1}/jobs/{other['job_id']}/state", {"state": "failed"}),
                ("POST", f"{V1}/jobs", body(unique("spawn"))),
                ("POST", f"{V1}/jobs/{jid}/control", {"action": "stop"}),
                ("POST", f"{V1}/jobs/{jid}/payloads", {"payload": b64(b"x"), "payload_sha256": "0" * 64}),
                ("DELETE", f"{V1}/jobs/{jid}", None),
                ("GET", f"{V1}/events", None),
                ("POST", "/api/v1/create_session", {"tags": []}),
                ("POST", "/api/v1/create_model", {"session_id": "x"}),
                ("GET", "/api/v1/training_runs", None),
                ("POST", "/api/v1/keys", {"name": "more"}),
                ("GET", "/metrics", None),
            ]:
                r = jk.request(method, path, json=payload)
                refused(r, 403, f"job {name}", "X-API-Key")
            # a run labelled with another job is refused
            r = jk.post(f"{V1}/runs", json={"name": "x", "user_metadata": {"openrl.job": other["job_id"]}})
            refused(r, 403, jid, "user_metadata.openrl.job")
            # a terminal state revokes the key: its next request is refused (401, naming the job)
            fin = jk.post(f"{V1}/jobs/{jid}/state", json={"state": "finished", "message": "3 steps"})
            assert fin.status_code == 200 and fin.json()["state"] == "finished"
            refused(jk.get(f"{V1}/jobs/{jid}"), 401, "revoked", name)
            refused(jk.post(f"{V1}/runs/{rid}/sample", json={"prompts": ["Hi"]}), 401, "revoked")
        entry = alice.get(f"{V1}/jobs/{jid}").json()
        assert entry["state"] == "finished" and entry["message"] == "3 steps" and entry["runs"] == [rid]
        assert alice.get(f"{V1}/runs/{rid}").status_code == 200  # the runs stay
        refused(alice.post(f"{V1}/jobs/{jid}/state", json={"state": "running"}), 409, "finished")
        alive(server.url)
    finally:
        alice.delete(f"{V1}/runs/{mine['run_id']}")
        alice.delete(f"{V1}/jobs/{other['job_id']}")


def test_payload_versions_are_kept_in_order_and_read_after_n(server, alice):
    job = submit(alice, unique("swap"))
    jid = job["job_id"]
    blobs = [PAYLOAD, b"second reward", b"third reward \x00"]
    for i, blob in enumerate(blobs[1:], start=2):
        r = alice.post(
            f"{V1}/jobs/{jid}/payloads",
            json={
                "payload": b64(blob),
                "payload_sha256": hashlib.sha256(blob).hexdigest(),
                "reward": f"r{i}",
            },
        )
        assert r.status_code == 201 and r.json() == {"version": i}
    with keyed(server.url, job["key"]) as jk:
        newer = jk.get(f"{V1}/jobs/{jid}/payloads", params={"after": 1}).json()["payloads"]
        assert [(p["version"], p["reward"]) for p in newer] == [(2, "r2"), (3, "r3")]
        assert [base64.b64decode(p["payload"]) for p in newer] == blobs[1:]
        assert jk.get(f"{V1}/jobs/{jid}/payloads", params={"after": 3}).json()["payloads"] == []
        refused(jk.get(f"{V1}/jobs/{jid}/payloads", params={"after": -1}), 400, "after")
        refused(jk.get(f"{V1}/jobs/{jid}/payloads", params={"after": "x"}), 400, "after")
    entry = alice.get(f"{V1}/jobs/{jid}").json()
    assert [v["bytes"] for v in entry["payload_versions"]] == [len(b) for b in blobs]
    assert entry["reward"] == "r3"
    bad = alice.post(f"{V1}/jobs/{jid}/payloads", json={"payload": b64(b"abc"), "payload_sha256": "ab" * 32})
    refused(bad, 400, "payload_sha256")
    alice.delete(f"{V1}/jobs/{jid}")
    alive(server.url)


def test_bad_submissions_name_the_field_and_the_service_stays_up(server, alice, monkeypatch):
    n = unique("bad")
    cases = [
        ({"name": ""}, "name"),
        ({"name": "x" * 65}, "name"),
        ({"name": "has space"}, "name"),
        ({"name": 7}, "name"),
        ({"kind": "batch"}, "kind"),
        ({"kind": ...}, "kind"),
        ({"where": "moon"}, "where"),
        ({"k8s": {"image": "x"}}, "k8s"),
        ({"payload": ...}, "payload"),
        ({"payload": "not base64!!"}, "payload"),
        ({"payload_sha256": "0" * 64}, "payload_sha256"),
        ({"payload_sha256": "nothex"}, "payload_sha256"),
        ({"reward": "r" * 129}, "reward"),
        ({"meta": {f"k{i}": i for i in range(33)}}, "meta"),
        ({"meta": {"nested": {"a": 1}}}, "meta.nested"),
        ({"meta": ["steps"]}, "meta"),
        ({"meta": {"k" * 65: 1}}, "meta"),
    ]
    for over, field in cases:
        r = alice.post(f"{V1}/jobs", json=body(n, **over))
        err = refused(r, 400, field)
        assert err["field"] == field, (over, err)
        if "meta" in over and isinstance(over["meta"], dict) and "k" * 65 in over["meta"]:
            assert "'kkkk" in err["error"] and "65 characters; at most 64" in err["error"], err
    refused(alice.post(f"{V1}/jobs", content=b"{not json", headers={"content-type": "application/json"}), 400)
    # k8s on a service without a launcher: 409 naming where and the flag
    refused(alice.post(f"{V1}/jobs", json=body(n, where="k8s")), 409, "where", "--jobs-namespace")
    # the size limit: 413 naming the payload and the setting
    monkeypatch.setattr(server.service.limits, "max_job_payload_bytes", 1000)
    for size in (1001, 50_000):
        err = refused(alice.post(f"{V1}/jobs", json=body(n, data=b"p" * size)), 413, "payload")
        assert "OPENRL_MAX_JOB_PAYLOAD_BYTES=1000" in err["error"]
    assert alice.post(f"{V1}/jobs", json=body(n, data=b"p" * 1000)).status_code == 201
    # state and control bodies
    jid = alice.get(f"{V1}/jobs/{n}").json()["job_id"]
    for payload, field in [
        ({"state": "exploded"}, "state"),
        ({"state": "running", "pid": -1}, "pid"),
        ({"state": "running", "pid": 2**31}, "pid"),
        ({"state": "running", "message": "m" * 2001}, "message"),
        ({"state": "running", "host": 5}, "host"),
    ]:
        err = refused(alice.post(f"{V1}/jobs/{jid}/state", json=payload), 400, field)
        assert err["field"] == field and (field != "pid" or "[1, 2147483647]" in err["error"]), err
    assert (
        refused(alice.post(f"{V1}/jobs/{jid}/control", json={"action": "boom"}), 400, "action")["field"]
        == "action"
    )
    assert alice.get(f"{V1}/jobs/{jid}").json()["state"] == "submitted"  # nothing changed
    refused(alice.get(f"{V1}/jobs/no-such-job"), 404, "job_id")
    alice.delete(f"{V1}/jobs/{jid}")
    alive(server.url)


def test_names_are_unique_among_active_jobs_and_tenants_are_isolated(server, alice):
    name = unique("dup")
    first = submit(alice, name)
    dup = refused(alice.post(f"{V1}/jobs", json=body(name)), 409, "name", first["job_id"])
    assert "job.delete()" in dup["error"] and f"DELETE /openrl/v1/jobs/{first['job_id']}" in dup["error"]
    with server.client(BOB_KEY) as bob:
        theirs = submit(bob, name)  # another tenant may use the name
        jid = first["job_id"]
        for method, path, payload in [
            ("GET", f"{V1}/jobs/{jid}", None),
            ("GET", f"{V1}/jobs/{name}", None),  # by name: bob's own job, not alice's
            ("GET", f"{V1}/jobs/{jid}/payloads", None),
            ("POST", f"{V1}/jobs/{jid}/state", {"state": "failed"}),
            ("POST", f"{V1}/jobs/{jid}/control", {"action": "stop"}),
            (
                "POST",
                f"{V1}/jobs/{jid}/payloads",
                {"payload": b64(b"x"), "payload_sha256": hashlib.sha256(b"x").hexdigest()},
            ),
            ("DELETE", f"{V1}/jobs/{jid}", None),
        ]:
            r = bob.request(method, path, json=payload)
            if path.endswith(name):
                assert r.json()["job_id"] == theirs["job_id"]
            else:
                refused(r, 404, "job_id")
        assert jid not in [j["job_id"] for j in bob.get(f"{V1}/jobs").json()["jobs"]]
        with keyed(server.url, theirs["key"]) as bk:  # bob's job key cannot reach alice's job either
            refused(bk.get(f"{V1}/jobs/{jid}"), 403)
        bob.delete(f"{V1}/jobs/{theirs['job_id']}")
    # once the first is over, the name is free again, and the name finds the newest job
    assert alice.post(f"{V1}/jobs/{jid}/state", json={"state": "failed"}).status_code == 200
    second = submit(alice, name)
    assert alice.get(f"{V1}/jobs/{name}").json()["job_id"] == second["job_id"]
    assert [j["job_id"] for j in alice.get(f"{V1}/jobs").json()["jobs"] if j["name"] == name] == [
        jid,
        second["job_id"],
    ]
    for j in (jid, second["job_id"]):
        alice.delete(f"{V1}/jobs/{j}")
    alive(server.url)


def test_control_fans_out_to_every_run_of_the_job_and_delete_revokes(server, alice):
    job = submit(alice, unique("ctl"))
    jid = job["job_id"]
    with keyed(server.url, job["key"]) as jk:
        rids = [new_run(jk, f"r{i}")["run_id"] for i in range(2)]
        for rid in rids:  # the worker is alive
            jk.post(f"{V1}/runs/{rid}/heartbeat", json={"state": "running"})
        bystander = new_run(alice, unique("bystander"))["run_id"]
        r = alice.post(f"{V1}/jobs/{jid}/control", json={"action": "pause", "reason": "look at it"})
        assert r.status_code == 200 and r.json()["control"]["action"] == "pause"
        assert r.json()["control"]["reason"] == "look at it" and sorted(r.json()["runs"]) == sorted(rids)
        for rid in rids:  # the worker reads it from its heartbeat replies
            hb = jk.post(f"{V1}/runs/{rid}/heartbeat").json()
            assert hb["control"]["state"] == "pause_requested" and hb["control"]["reason"] == "look at it"
        assert alice.get(f"{V1}/runs/{bystander}").json()["control"]["state"] == "running"
        r = alice.post(f"{V1}/jobs/{jid}/control", json={"action": "resume"})
        assert r.json()["control"]["action"] == "resume"
        assert {jk.get(f"{V1}/runs/{rid}").json()["control"]["state"] for rid in rids} == {"running"}
        # DELETE revokes the key at once; the runs stay
        d = alice.delete(f"{V1}/jobs/{jid}")
        assert d.status_code == 200 and d.json()["deleted"] is True
        refused(jk.get(f"{V1}/runs/{rids[0]}"), 401, "revoked")
        refused(alice.get(f"{V1}/jobs/{jid}"), 404)
        assert alice.get(f"{V1}/runs/{rids[0]}").status_code == 200
    for rid in (*rids, bystander):
        alice.delete(f"{V1}/runs/{rid}")
    alive(server.url)


def test_the_service_never_unpickles_a_payload(server, alice, tmp_path):
    """A pickle whose loading would create a file: stored, returned byte-identical, never loaded."""
    marker = tmp_path / "unpickled-here"

    class Trap:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload, again = pickle.dumps(Trap()), pickle.dumps(Trap(), protocol=2)
    assert payload != again and not marker.exists()
    job = submit(alice, unique("trap"), data=payload)
    r = alice.post(
        f"{V1}/jobs/{job['job_id']}/payloads",
        json={"payload": b64(again), "payload_sha256": hashlib.sha256(again).hexdigest()},
    )
    assert r.status_code == 201
    with keyed(server.url, job["key"]) as jk:
        back = jk.get(f"{V1}/jobs/{job['job_id']}/payloads").json()["payloads"]
    assert [base64.b64decode(p["payload"]) for p in back] == [payload, again]
    assert not marker.exists()
    stored = sorted((server.data_dir / "tenants" / "alice" / "jobs" / job["job_id"]).glob("payload-*.bin"))
    assert [p.read_bytes() for p in stored] == [payload, again]
    alice.delete(f"{V1}/jobs/{job['job_id']}")
    assert not marker.exists()


class FakeKube:
    """The KubeLauncher's four methods, recording what the service asked."""

    def __init__(self):
        self.submitted: list[dict] = []
        self.deleted: list[str] = []
        self.fail_submit = False
        self.phase, self.reason = "running", None
        self.asked: list[str] = []

    def validate(self, request: dict) -> dict:
        image = request.get("image", "openrl/job:1")
        if image != "openrl/job:1":
            raise UserError(f"k8s.image {image!r} is not allowed; allowed: openrl/job:1", field="k8s.image")
        return {"image": image, "volumes": list(request.get("volumes", [])), "cpu": "1", "memory": "2Gi"}

    def submit(self, *, tenant, job_id, name, kind, key, request) -> dict:
        if self.fail_submit:
            raise RuntimeError("the API server said no")
        self.submitted.append(
            {"tenant": tenant, "job_id": job_id, "name": name, "kind": kind, "key": key, "request": request}
        )
        job = f"openrl-{name}"
        return {"namespace": "openrl", "job": job, "configmap": f"{job}-spec", "secret": f"{job}-token"}

    def status(self, job_name: str) -> dict:
        self.asked.append(job_name)
        return {"phase": self.phase, "active": 1, "succeeded": 0, "failed": 0, "reason": self.reason}

    def delete(self, job_name: str) -> None:
        self.deleted.append(job_name)


def test_k8s_jobs_go_through_the_launcher_and_the_key_is_never_returned(server, alice, monkeypatch):
    kube = FakeKube()
    monkeypatch.setattr(server.parts, "kube", kube)
    name = unique("kube")
    before = len(alice.get(f"{V1}/jobs").json()["jobs"])
    refused(
        alice.post(f"{V1}/jobs", json=body(name, where="k8s", k8s={"image": "evil/img"})), 400, "k8s.image"
    )
    refused(alice.post(f"{V1}/jobs", json=body(name, where="k8s", k8s={"serviceAccount": "admin"})), 400)
    kube.fail_submit = True
    refused(alice.post(f"{V1}/jobs", json=body(name, where="k8s")), 500, "Kubernetes")
    assert len(alice.get(f"{V1}/jobs").json()["jobs"]) == before  # nothing left behind
    kube.fail_submit = False
    r = alice.post(f"{V1}/jobs", json=body(name, where="k8s", k8s={"volumes": ["data"]}))
    assert r.status_code == 201, r.text
    job = r.json()
    assert "key" not in job and job["k8s"] == {
        "namespace": "openrl",
        "job": f"openrl-{name}",
        "configmap": f"openrl-{name}-spec",
        "secret": f"openrl-{name}-token",
    }
    (sent,) = kube.submitted
    assert (
        sent["tenant"] == "alice"
        and sent["job_id"] == job["job_id"]
        and sent["request"]["volumes"] == ["data"]
    )
    assert sent["key"].startswith("tml-job-") and sent["key"] not in r.text
    with keyed(server.url, sent["key"]) as jk:  # the key in the Secret works, scoped to the job
        entry = jk.get(f"{V1}/jobs/{job['job_id']}").json()
        assert entry["k8s"] == {"namespace": "openrl", "job": f"openrl-{name}", "phase": "running"}
        assert alice.delete(f"{V1}/jobs/{job['job_id']}").status_code == 200
        assert kube.deleted == [f"openrl-{name}"]
        refused(jk.get(f"{V1}/jobs/{job['job_id']}"), 401)
    alive(server.url)


@pytest.mark.parametrize("phase", ["failed", "missing"])
def test_a_k8s_job_whose_kubernetes_job_ended_without_a_report_fails(server, alice, monkeypatch, phase):
    """The pods died (backoff used up) or the Job was deleted behind the service's back: the job is
    failed with Kubernetes' reason when read and on the housekeeping round, and its key revoked; a job
    that is over is not asked about again."""
    kube = FakeKube()
    monkeypatch.setattr(server.parts, "kube", kube)
    monkeypatch.setattr("openrl_service.api.jobs.PHASE_TTL_S", 0.0)  # no cached phase: every read asks
    a, b = (submit(alice, unique(n), where="k8s") for n in ("podgone", "sweep"))
    kube.phase, kube.reason = phase, "BackoffLimitExceeded: Job has reached the specified backoff limit"
    try:
        entry = alice.get(f"{V1}/jobs/{a['job_id']}").json()  # read: reconciled
        assert entry["state"] == "failed" and "Kubernetes Job" in entry["message"]
        assert "BackoffLimitExceeded" in entry["message"]
        assert server.parts.jobs.jobs[b["job_id"]]["state"] == "submitted"
        server.parts.jobs.poll_kube()  # the status poll (on its own thread in the service)...
        server.parts.jobs.sweep(time.time())  # ...whose answers the next housekeeping round applies
        assert server.parts.jobs.jobs[b["job_id"]]["state"] == "failed"
        keys = {sent["job_id"]: sent["key"] for sent in kube.submitted}
        for j in (a, b):
            with keyed(server.url, keys[j["job_id"]]) as jk:
                refused(jk.get(f"{V1}/jobs/{j['job_id']}"), 401, "revoked")
        asked = len(kube.asked)
        listed = {j["job_id"]: j for j in alice.get(f"{V1}/jobs").json()["jobs"]}
        assert listed[a["job_id"]]["state"] == "failed" and len(kube.asked) == asked  # over: not asked
    finally:
        for j in (a, b):
            alice.delete(f"{V1}/jobs/{j['job_id']}")


def test_a_k8s_job_waits_while_its_kubernetes_job_is_pending(server, alice, monkeypatch):
    """A preempted pod's retry may wait in Kueue longer than OPENRL_JOB_LOST_AFTER_S: while Kubernetes
    says pending, the silent job is not failed; once Kubernetes says running and nothing asks, it is."""
    kube = FakeKube()
    monkeypatch.setattr(server.parts, "kube", kube)
    job = submit(alice, unique("queued"), where="k8s")
    try:
        with keyed(server.url, kube.submitted[0]["key"]) as jk:
            assert jk.post(f"{V1}/jobs/{job['job_id']}/state", json={"state": "running"}).status_code == 200
        # rounds as if OPENRL_JOB_LOST_AFTER_S had passed (not slept: the service's own rounds, at the
        # real time, must not fail the job meanwhile)
        later = time.time() + server.service.limits.job_lost_after_s + 1
        kube.phase = "pending"
        server.parts.jobs.poll_kube()
        server.parts.jobs.sweep(later)
        assert server.parts.jobs.jobs[job["job_id"]]["state"] == "running"
        kube.phase = "running"
        server.parts.jobs.poll_kube()
        server.parts.jobs.sweep(later)
        assert server.parts.jobs.jobs[job["job_id"]]["state"] == "failed"
    finally:
        alice.delete(f"{V1}/jobs/{job['job_id']}")


def test_jobs_payloads_and_keys_survive_a_restart(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    live = start_server(data, tiny_model_dir)
    try:
        with live.client(ALICE_KEY) as alice:
            job = submit(alice, "keeps")
            done = submit(alice, "done")
            jid = job["job_id"]
            with keyed(live.url, job["key"]) as jk:
                rid = new_run(jk, "kept-run")["run_id"]
                jk.post(f"{V1}/jobs/{jid}/state", json={"state": "running", "pid": 7})
            v2 = b"v2 \x00\x01"
            alice.post(
                f"{V1}/jobs/{jid}/payloads",
                json={"payload": b64(v2), "payload_sha256": hashlib.sha256(v2).hexdigest()},
            )
            with keyed(live.url, done["key"]) as dk:
                dk.post(f"{V1}/jobs/{done['job_id']}/state", json={"state": "failed"})
            before = alice.get(f"{V1}/jobs/{jid}").json()
    finally:
        live.stop()
    live = start_server(data, tiny_model_dir)
    try:
        with live.client(ALICE_KEY) as alice:
            after = alice.get(f"{V1}/jobs/{jid}").json()
            assert after == before and after["runs"] == [rid] and after["state"] == "running"
            with keyed(live.url, job["key"]) as jk:  # still valid
                got = jk.get(f"{V1}/jobs/{jid}/payloads").json()["payloads"]
                assert [base64.b64decode(p["payload"]) for p in got] == [PAYLOAD, v2]
                assert jk.get(f"{V1}/runs/{rid}").status_code == 200
            with keyed(live.url, done["key"]) as dk:  # still revoked
                refused(dk.get(f"{V1}/jobs/{done['job_id']}"), 401, "revoked")
            refused(alice.post(f"{V1}/jobs", json=body("keeps")), 409, "name")  # still active
    finally:
        live.stop()


def test_the_jobs_api_is_refused_on_a_service_without_auth(tmp_path, tiny_model_dir):
    """--no-auth: every caller is the same tenant, so any local user could send a running worker a
    payload it unpickles (code) or read its payloads: the jobs API answers 409 naming --no-auth; the
    runs API still works."""
    live = start_server(tmp_path / "data", tiny_model_dir, no_auth=True)
    try:
        with live.client(None) as anon:
            for method, path, payload in [
                ("POST", f"{V1}/jobs", body("open")),
                ("GET", f"{V1}/jobs", None),
                ("GET", f"{V1}/jobs/open", None),
                ("POST", f"{V1}/jobs/open/payloads", {"payload": b64(b"x"), "payload_sha256": "0" * 64}),
                ("GET", f"{V1}/jobs/open/payloads", None),
                ("POST", f"{V1}/jobs/open/state", {"state": "failed"}),
                ("POST", f"{V1}/jobs/open/control", {"action": "stop"}),
                ("DELETE", f"{V1}/jobs/open", None),
            ]:
                err = refused(anon.request(method, path, json=payload), 409, "--no-auth")
                assert "any local user could send code" in err["error"], err
            assert not (tmp_path / "data" / "tenants" / "default" / "jobs").exists()
            assert new_run(anon, "still-works")["name"] == "still-works"
    finally:
        live.stop()


def test_stop_or_pause_before_the_run_exists_reaches_the_run_at_creation(server, alice):
    """The worker's runs may not exist yet when the job is stopped or paused (still starting, queued
    in Kueue, a sweep's later runs): a run created after it carries the control from its creation."""
    stop, pause = submit(alice, unique("early-stop")), submit(alice, unique("early-pause"))
    try:
        r = alice.post(f"{V1}/jobs/{stop['job_id']}/control", json={"action": "stop", "reason": "too late"})
        assert r.status_code == 200 and r.json()["runs"] == [] and r.json()["control"]["action"] == "stop"
        assert alice.post(f"{V1}/jobs/{pause['job_id']}/control", json={"action": "pause"}).status_code == 200
        with keyed(server.url, stop["key"]) as jk:
            run = new_run(jk, "after-stop")
            assert run["control"]["state"] == "stop_requested" and run["control"]["reason"] == "too late"
            hb = jk.post(f"{V1}/runs/{run['run_id']}/heartbeat", json={"state": "running"}).json()
            assert hb["control"]["state"] == "stop_requested"
            # the worker's Run obeys and says so: the run is stopped
            hb = jk.post(f"{V1}/runs/{run['run_id']}/heartbeat", json={"state": "stopped"}).json()
            assert hb["control"]["state"] == "stopped"
        with keyed(server.url, pause["key"]) as jk:
            assert new_run(jk, "after-pause")["control"]["state"] == "pause_requested"
            # resumed: the next run starts running
            assert (
                alice.post(f"{V1}/jobs/{pause['job_id']}/control", json={"action": "resume"}).status_code
                == 200
            )
            assert new_run(jk, "after-resume")["control"]["state"] == "running"
            runs = alice.get(f"{V1}/jobs/{pause['job_id']}").json()["runs"]
            assert {alice.get(f"{V1}/runs/{r}").json()["control"]["state"] for r in runs} == {"running"}
        # an ordinary run of the tenant is untouched
        assert new_run(alice, unique("bystander"))["control"]["state"] == "running"
    finally:
        for j in (stop, pause):
            for rid in alice.get(f"{V1}/jobs/{j['job_id']}").json()["runs"]:
                alice.delete(f"{V1}/runs/{rid}")
            alice.delete(f"{V1}/jobs/{j['job_id']}")


def test_a_jobs_runs_stay_readable_after_their_session_is_reaped_and_a_restart(tmp_path, tiny_model_dir):
    """A detached run's worker ends; an hour later (OPENRL_SESSION_IDLE_TIMEOUT_S) its session is
    reaped. Its entry and metric rows stay readable (and listed as ended with include=all), across a
    restart, until the job is deleted; an ordinary run is forgotten as before."""
    data = tmp_path / "data"
    live = start_server(data, tiny_model_dir, session_idle_timeout_s=60.0)
    try:
        with live.client(ALICE_KEY) as alice:
            job = submit(alice, "kept")
            jid = job["job_id"]
            plain = new_run(alice, "plain")["run_id"]
            with keyed(live.url, job["key"]) as jk:
                rid = new_run(jk, "job-run")["run_id"]
                for step, reward in ((1, 0.25), (2, 0.75)):
                    assert (
                        jk.post(
                            f"{V1}/runs/{rid}/metrics", json={"step": step, "reward_mean": reward}
                        ).status_code
                        == 201
                    )
                jk.post(f"{V1}/runs/{rid}/heartbeat", json={"state": "finished"})
                assert jk.post(f"{V1}/jobs/{jid}/state", json={"state": "finished"}).status_code == 200
            rows = alice.get(f"{V1}/runs/{rid}/metrics").json()["metrics"]
            assert [r["reward_mean"] for r in rows] == [0.25, 0.75]
            # the idle reaper's round, past the timeout (as an hour later)
            assert len(live.service.reap_idle_sessions(now=time.time() + 120)) >= 2
            refused(alice.get(f"{V1}/runs/{plain}"), 404, "unknown run")

            def readable(c):
                entry = c.get(f"{V1}/runs/{rid}").json()
                assert entry["run_id"] == rid and entry["ended"] is True and entry["state"] == "finished"
                assert entry["user_metadata"]["openrl.job"] == jid and entry["name"] == "job-run"
                assert c.get(f"{V1}/runs/{rid}/metrics").json()["metrics"] == rows
                listed = {
                    r["run_id"]: r for r in c.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]
                }
                assert listed[rid]["ended"] is True and plain not in listed
                assert rid not in [r["run_id"] for r in c.get(f"{V1}/runs").json()["runs"]]  # live ones only
                assert c.get(f"{V1}/jobs/{jid}").json()["runs"] == [rid]

            readable(alice)
    finally:
        live.stop()
    live = start_server(data, tiny_model_dir, session_idle_timeout_s=60.0)
    try:
        with live.client(ALICE_KEY) as alice:
            readable(alice)
            with live.client(BOB_KEY) as bob:  # another tenant: unknown
                refused(bob.get(f"{V1}/runs/{rid}"), 404)
                refused(bob.get(f"{V1}/runs/{rid}/metrics"), 404)
            assert alice.delete(f"{V1}/jobs/{jid}").status_code == 200
            refused(alice.get(f"{V1}/runs/{rid}"), 404, "unknown run")
            refused(alice.get(f"{V1}/runs/{rid}/metrics"), 404)
            assert rid not in [
                r["run_id"] for r in alice.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]
            ]
    finally:
        live.stop()


def test_a_job_whose_worker_stopped_reporting_fails_and_its_key_is_revoked(server, alice, monkeypatch):
    """A worker SIGKILLed (or OOM-killed) never reports: after OPENRL_JOB_LOST_AFTER_S without a request
    from its key, a running job (and a local job still submitted) is failed on the housekeeping round
    and when read, its key revoked and its name free again; a job whose key keeps asking stays."""
    jobs = server.parts.jobs
    monkeypatch.setattr(server.service.limits, "job_lost_after_s", 2)
    dead, never, alive_job = (submit(alice, unique(n)) for n in ("dead", "never", "alive"))
    try:
        with keyed(server.url, dead["key"]) as dk, keyed(server.url, alive_job["key"]) as ak:
            assert dk.post(f"{V1}/jobs/{dead['job_id']}/state", json={"state": "running"}).status_code == 200
            assert (
                ak.post(f"{V1}/jobs/{alive_job['job_id']}/state", json={"state": "running"}).status_code
                == 200
            )
            deadline = time.time() + 2.6
            while time.time() < deadline:  # the live worker polls; the dead one does not
                assert (
                    ak.get(f"{V1}/jobs/{alive_job['job_id']}/payloads", params={"after": 1}).status_code
                    == 200
                )
                time.sleep(0.2)
            ak.get(f"{V1}/jobs/{alive_job['job_id']}/payloads", params={"after": 1})
            jobs.sweep(time.time())  # the housekeeping round
            assert jobs.jobs[dead["job_id"]]["state"] == "failed"
            assert jobs.jobs[alive_job["job_id"]]["state"] == "running"
            entry = alice.get(f"{V1}/jobs/{dead['job_id']}").json()
            assert entry["state"] == "failed"
            assert entry["message"].startswith("its worker stopped reporting (no request for 2 s")
            refused(dk.get(f"{V1}/jobs/{dead['job_id']}"), 401, "revoked", "failed")
            # read (GET) also reconciles: the never-started local job
            got = alice.get(f"{V1}/jobs/{never['job_id']}").json()
            assert got["state"] == "failed" and "stopped reporting" in got["message"]
            assert ak.get(f"{V1}/jobs/{alive_job['job_id']}").json()["state"] == "running"
            # the names are free again
            again = submit(alice, dead["name"])
            alice.delete(f"{V1}/jobs/{again['job_id']}")
            # the owner's key may report the end (the notebook saw its child die): the key is revoked
            r = alice.post(
                f"{V1}/jobs/{alive_job['job_id']}/state", json={"state": "failed", "message": "exit -9"}
            )
            assert r.status_code == 200 and r.json()["state"] == "failed" and r.json()["message"] == "exit -9"
            refused(ak.get(f"{V1}/jobs/{alive_job['job_id']}"), 401, "revoked")
    finally:
        for j in (dead, never, alive_job):
            alice.delete(f"{V1}/jobs/{j['job_id']}")
    alive(server.url)


def test_retried_reports_and_payloads_are_answered_not_refused_or_duplicated(server, alice):
    """The client retries POSTs whose reply was lost: the same terminal state again (with the key it
    revoked) answers the job; the newest payload's bytes again answer that version."""
    job = submit(alice, unique("retry"))
    jid = job["job_id"]
    v2 = b"reward v2"
    post_v2 = {"payload": b64(v2), "payload_sha256": hashlib.sha256(v2).hexdigest(), "reward": "r2"}
    first = alice.post(f"{V1}/jobs/{jid}/payloads", json=post_v2)
    assert first.status_code == 201 and first.json() == {"version": 2}
    again = alice.post(f"{V1}/jobs/{jid}/payloads", json=post_v2)
    assert again.status_code == 200 and again.json() == {"version": 2}
    assert [v["version"] for v in alice.get(f"{V1}/jobs/{jid}").json()["payload_versions"]] == [1, 2]
    # version 1's bytes are not the newest: a new version
    v1 = {"payload": b64(PAYLOAD), "payload_sha256": hashlib.sha256(PAYLOAD).hexdigest()}
    assert alice.post(f"{V1}/jobs/{jid}/payloads", json=v1).json() == {"version": 3}
    with keyed(server.url, job["key"]) as jk:
        done = jk.post(f"{V1}/jobs/{jid}/state", json={"state": "finished", "message": "6 steps"})
        assert done.status_code == 200
        retry = jk.post(f"{V1}/jobs/{jid}/state", json={"state": "finished", "message": "6 steps"})
        assert retry.status_code == 200 and retry.json()["state"] == "finished"
        assert retry.json()["message"] == "6 steps"
        # the revoked key may do nothing else
        refused(jk.post(f"{V1}/jobs/{jid}/state", json={"state": "failed"}), 401, "revoked")
        refused(jk.post(f"{V1}/jobs/{jid}/state", json={"state": "running"}), 401, "revoked")
        refused(jk.get(f"{V1}/jobs/{jid}"), 401, "revoked")
    assert alice.post(f"{V1}/jobs/{jid}/state", json={"state": "finished"}).status_code == 200
    refused(alice.post(f"{V1}/jobs/{jid}/state", json={"state": "stopped"}), 409, "finished")
    assert alice.get(f"{V1}/jobs/{jid}").json()["state"] == "finished"
    alice.delete(f"{V1}/jobs/{jid}")


def test_the_job_label_is_reserved_for_job_keys(server, alice):
    """An ordinary key may not label its runs as a job's (that would put them in the job key's scope)."""
    job = submit(alice, unique("label"))
    try:
        for meta in ({"openrl.job": job["job_id"]}, {"openrl.job.extra": "x"}):
            err = refused(alice.post(f"{V1}/runs", json={"name": "x", "user_metadata": meta}), 403)
            assert err["field"] == "user_metadata.openrl.job" and "reserved" in err["error"], err
            err = refused(alice.post("/api/v1/create_session", json={"tags": [], "user_metadata": meta}), 403)
            assert err["field"] == "user_metadata.openrl.job", err
        run = new_run(alice, unique("swept"), **{"openrl.sweep": "s1"})  # the sweep label stays free
        alice.delete(f"{V1}/runs/{run['run_id']}")
        assert alice.get(f"{V1}/jobs/{job['job_id']}").json()["runs"] == []
    finally:
        alice.delete(f"{V1}/jobs/{job['job_id']}")


def test_a_tenant_keeps_a_bounded_number_of_jobs_and_payload_bytes(server, monkeypatch):
    lim = server.service.limits
    with server.client(BOB_KEY) as bob:
        kept = bob.get(f"{V1}/jobs").json()["jobs"]
        used = sum(v["bytes"] for j in kept for v in j["payload_versions"])
        monkeypatch.setattr(lim, "max_jobs_per_tenant", len(kept) + 1)
        monkeypatch.setattr(lim, "max_job_payload_total_bytes", used + len(PAYLOAD) + 10)
        job = submit(bob, unique("one"))
        try:
            err = refused(bob.post(f"{V1}/jobs", json=body(unique("two"))), 409, "OPENRL_MAX_JOBS_PER_TENANT")
            assert "delete old jobs" in err["error"], err
            big = b"x" * 11
            r = bob.post(
                f"{V1}/jobs/{job['job_id']}/payloads",
                json={"payload": b64(big), "payload_sha256": hashlib.sha256(big).hexdigest()},
            )
            refused(r, 413, "OPENRL_MAX_JOB_PAYLOAD_TOTAL_BYTES", "payload")
            small = b"x" * 10
            r = bob.post(
                f"{V1}/jobs/{job['job_id']}/payloads",
                json={"payload": b64(small), "payload_sha256": hashlib.sha256(small).hexdigest()},
            )
            assert r.status_code == 201
        finally:
            bob.delete(f"{V1}/jobs/{job['job_id']}")
        # deleting frees both
        again = submit(bob, unique("again"))
        bob.delete(f"{V1}/jobs/{again['job_id']}")
