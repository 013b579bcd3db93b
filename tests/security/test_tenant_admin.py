"""The operator removes a tenant's data: `openrl-service admin tenants` / `admin remove TENANT`.

The operator is whoever can read the data dir (the volume, `kubectl exec` into the pod): the running
service writes ``<data>/admin-key`` (0600) and the lock file names its URL, so the admin command needs
nothing else. A removed tenant's sessions end, its runs, samplers, checkpoints, traces, jobs (and their
keys) and minted keys are gone, also after a restart (the journal replays the removal), and no other
tenant loses anything. The admin key is good for the admin routes only; a tenant's key never reaches them.
"""

from __future__ import annotations

import json
import stat
import subprocess

import httpx
import pytest

from tests._support.serve import cli, serving
from tests.conftest import ALICE_KEY, BOB_KEY
from tests.service.test_jobs_api import body

KEYS = {"OPENRL_API_KEYS": f"alice:{ALICE_KEY},bob:{BOB_KEY}"}
V1 = "/openrl/v1"


def admin(data_dir, *args: str) -> subprocess.CompletedProcess:
    argv, env = cli("admin", "--data-dir", str(data_dir), *args)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def _world(url: str, key: str) -> dict:
    """A tenant with a run, a checkpoint and a job."""
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60) as c:
        run = c.post(f"{V1}/runs", json={"name": "r", "rank": 2})
        assert run.status_code == 201, run.text
        run_id = run.json()["run_id"]
        ck = c.post(f"{V1}/runs/{run_id}/checkpoints", json={"name": "ck"})
        assert ck.status_code in (200, 201), ck.text
        job = c.post(f"{V1}/jobs", json=body("j"))
        assert job.status_code == 201, job.text
        return {
            "run": run_id,
            "path": ck.json()["path"],
            "job": job.json()["job_id"],
            "job_key": job.json()["key"],
        }


def test_the_operator_removes_one_tenant_and_only_that_one(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    with serving(data, tiny_model_dir, env=KEYS) as s:
        key_file = data / "admin-key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        alice, bob = _world(s.url, ALICE_KEY), _world(s.url, BOB_KEY)

        listed = admin(data, "tenants", "--json")
        assert listed.returncode == 0, listed.stderr
        rows = {r["tenant"]: r for r in json.loads(listed.stdout)}
        assert rows["alice"]["checkpoint_bytes"] > 0 and rows["alice"]["live_runs"] == 1
        assert rows["alice"]["jobs"] == 1 and rows["bob"]["jobs"] == 1
        table = admin(data, "tenants")
        assert table.returncode == 0 and "alice" in table.stdout and "bob" in table.stdout

        removed = admin(data, "remove", "alice", "--yes")
        assert removed.returncode == 0, removed.stderr
        assert "alice" in removed.stdout
        assert not (data / "tenants" / "alice").exists() and (data / "tenants" / "bob").is_dir()

        a = httpx.Client(base_url=s.url, headers={"X-API-Key": ALICE_KEY}, timeout=60)
        b = httpx.Client(base_url=s.url, headers={"X-API-Key": BOB_KEY}, timeout=60)
        assert a.get(f"{V1}/runs/{alice['run']}").status_code == 404
        assert a.get(f"{V1}/jobs/{alice['job']}").status_code == 404
        gone = a.post(f"{V1}/runs", json={"name": "again", "rank": 2, "load_from": alice["path"]})
        assert gone.status_code == 404, gone.text
        job_key = httpx.get(f"{s.url}{V1}/runs", headers={"X-API-Key": alice["job_key"]}, timeout=60)
        assert job_key.status_code == 401, job_key.text
        # bob keeps everything
        assert b.get(f"{V1}/runs/{bob['run']}").status_code == 200
        assert b.get(f"{V1}/jobs/{bob['job']}").status_code == 200
        # alice (her API key is the operator's to revoke) starts from nothing
        assert a.get(f"{V1}/runs").json()["runs"] == []

    with serving(data, tiny_model_dir, env=KEYS) as s:  # the journal replays the removal
        a = httpx.Client(base_url=s.url, headers={"X-API-Key": ALICE_KEY}, timeout=60)
        assert a.get(f"{V1}/runs/{alice['run']}").status_code == 404
        assert alice["path"] not in a.get(f"{s.url}/api/v1/checkpoints").text
        assert not list((data / "tenants").glob("alice/runs/*/weights/ck"))
        b = httpx.Client(base_url=s.url, headers={"X-API-Key": BOB_KEY}, timeout=60)
        assert bob["path"] in b.get(f"{s.url}/api/v1/checkpoints").text


def test_the_admin_key_reaches_the_admin_routes_only_and_a_tenant_key_never_does(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    with serving(data, tiny_model_dir, env=KEYS) as s:
        admin_key = (data / "admin-key").read_text().strip()
        as_admin = {"X-API-Key": admin_key}
        ok = httpx.get(f"{s.url}{V1}/admin/tenants", headers=as_admin, timeout=60)
        assert ok.status_code == 200, ok.text
        for path in (f"{V1}/runs", "/api/v1/training_runs", "/api/v1/checkpoints", f"{V1}/jobs"):
            r = httpx.get(f"{s.url}{path}", headers=as_admin, timeout=60)
            assert r.status_code == 403 and "admin" in r.json()["error"], (path, r.text)
        for key in (ALICE_KEY, BOB_KEY, "tml-not-a-key"):
            r = httpx.get(f"{s.url}{V1}/admin/tenants", headers={"X-API-Key": key}, timeout=60)
            assert r.status_code in (401, 403), r.text
            r = httpx.delete(f"{s.url}{V1}/admin/tenants/bob", headers={"X-API-Key": key}, timeout=60)
            assert r.status_code in (401, 403), r.text
        bad = httpx.delete(f"{s.url}{V1}/admin/tenants/nobody", headers=as_admin, timeout=60)
        assert bad.status_code == 404 and "nobody" in bad.json()["error"]


def test_the_admin_command_says_what_is_missing(tmp_path):
    out = admin(tmp_path / "nothing-here", "tenants")
    assert out.returncode != 0 and "no openrl-service" in out.stderr.lower(), out.stderr


@pytest.mark.parametrize("args", [("remove",), ("remove", "a/b", "--yes")])
def test_bad_admin_arguments_are_refused(tmp_path, args):
    out = admin(tmp_path, *args)
    assert out.returncode == 2, out.stderr
