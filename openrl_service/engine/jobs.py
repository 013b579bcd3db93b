"""Detached jobs: what a notebook hands off so a run outlives its kernel (``/openrl/v1/jobs``).

A job is a record (name, kind, where, state, meta, control), its payloads (opaque bytes, version 1
the submit's, later versions a hot-swapped reward) and a job-scoped key (``tml-job-…``) the job's
worker authenticates with. The service never unpickles, imports or runs a payload: it stores the
bytes it was sent, checks their SHA-256 and size, and hands them back byte-identical.

On disk, under the tenant's folder (``<data>/tenants/<tenant>/jobs/<job_id>/``): ``job.json`` (the
record, with the key's SHA-256 digest, never the key; mode 0600) and ``payload-<version>.bin``. Each
file is written whole to a temporary file, fsynced and renamed over its name, so a crash leaves the
old file or the new one. Everything is read back at startup: jobs, payloads and keys survive a restart.

The key is scoped to its job (see :meth:`Jobs.allows`): it creates runs (each labelled
``user_metadata["openrl.job"] = job_id`` by the service), uses only those runs, reads its own job and
payloads and reports the job's state. A terminal state (finished, failed, stopped) or DELETE revokes
it; a revoked key is refused with 401 naming its job.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from openrl_common.protocol import TERMINAL_STATES
from openrl_service.config import Limits, tenant_folder
from openrl_service.engine.job_checks import JOB_META_KEY, check_submit, decode_payload
from openrl_service.errors import Conflict, NotFound, PayloadTooLarge, Unauthorized
from openrl_service.keydigest import key_digest
from openrl_service.storage.files import write_private

log = logging.getLogger("openrl_service")

JOB_KEY_PREFIX = "tml-job-"
MAX_MESSAGE_CHARS = 2000
MAX_PAYLOAD_VERSIONS = 100  # per job: each hot-swap stores a version
V1 = "/openrl/v1"


@dataclass(frozen=True)
class JobAccess:
    """A valid job key: whose job it is."""

    tenant: str
    job_id: str
    name: str
    revoked: bool = False  # a revoked key repeating its job's terminal state report (a retry): only that


@dataclass(frozen=True)
class JobRefusal:
    """A job key that may not make this request: 401 (revoked) or 403 (outside the job's scope)."""

    status: int
    message: str


class Jobs:
    """Every tenant's jobs, their payloads and their keys (digests only); see the module docstring."""

    def __init__(self, data_dir: Path, limits: Limits, runs: dict | None = None):
        self.root = Path(data_dir) / "tenants"
        self.limits = limits
        self.runs = runs if runs is not None else {}  # the engine's run registry (run id → RunState)
        self._lock = threading.RLock()
        self.jobs: dict[str, dict] = {}  # job id → record (what job.json holds)
        self._keys: dict[str, str] = {}  # SHA-256 of a live key → job id
        self._revoked: dict[str, str] = {}  # SHA-256 of a revoked key → job id (a 401 names the job)
        self._deleted_why: dict[str, str] = {}  # job id → why it was deleted, when not by its owner
        # run id → (job id, its entry): runs kept after their session ended (rows stay on disk)
        self._archived: dict[str, tuple[str, dict]] = {}
        self.seen: dict[str, float] = {}  # job id → when its key last made a request (in memory)
        self.started = time.time()  # a restart counts as a request: the workers had no service to reach
        self.kube_status = None  # callable(job name) → launcher status (set by the jobs router)
        self._kube_lock = threading.Lock()
        self._kube_phases: dict[str, tuple[float, str | None, str | None]] = {}  # Job → (asked, phase, why)
        self._kube_poller: threading.Thread | None = None  # the status poll in flight, if any
        self._load()

    # -- disk -------------------------------------------------------------------------------------
    def _dir(self, rec: dict) -> Path:
        return self.root / tenant_folder(rec["tenant"]) / "jobs" / rec["job_id"]

    def _save(self, rec: dict) -> None:
        write_private(self._dir(rec) / "job.json", json.dumps(rec).encode())

    def _load(self) -> None:
        for path in sorted(self.root.glob("*/jobs/*/job.json")):
            try:
                rec = json.loads(path.read_text())
                job_id = rec["job_id"]
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("skipping an unreadable job record %s", path)
                continue
            self.jobs[job_id] = rec
            for kept in path.parent.glob("runs/*.entry.json"):
                try:
                    self._archived[kept.name.removesuffix(".entry.json")] = (
                        job_id,
                        json.loads(kept.read_text()),
                    )
                except (OSError, ValueError):
                    log.warning("skipping an unreadable kept run %s", kept)
            if rec.get("key_digest"):
                (self._revoked if rec.get("key_revoked") else self._keys)[rec["key_digest"]] = job_id

    # -- keys -------------------------------------------------------------------------------------
    def access(self, key: str, method: str, path: str) -> JobAccess | JobRefusal | None:
        """What a ``tml-job-`` key may do here: its job (allowed), a refusal, or None (unknown key)."""
        digest = key_digest(key)
        job_id = self._keys.get(digest)
        rec = self.jobs.get(job_id) if job_id is not None else None
        if rec is None:
            gone = self._revoked.get(digest) or job_id
            if gone is None:
                return None
            rec = self.jobs.get(gone)
            if rec is not None and method == "POST" and path == f"{V1}/jobs/{gone}/state":
                return JobAccess(rec["tenant"], gone, rec["name"], revoked=True)  # a retried report
            why = (
                f"its job is {rec['state']}"
                if rec is not None
                else self._deleted_why.get(gone, "its job was deleted")
            )
            name = rec["name"] if rec is not None else gone
            return JobRefusal(401, f"this key of job {name} ({gone}) was revoked: {why}")
        acc = JobAccess(rec["tenant"], job_id, rec["name"])
        self.seen[job_id] = time.time()
        if not self.allows(acc, method, path):
            return JobRefusal(
                403,
                f"this key belongs to job {rec['name']} ({job_id}) and may only create and use that "
                "job's runs (/openrl/v1/runs), read the job and its payloads and report its state; "
                f"{method} {path[:200]} is outside it",
            )
        return acc

    def allows(self, acc: JobAccess, method: str, path: str) -> bool:
        """The job key's scope (the service's health checks are public anyway)."""
        if method == "GET" and path in ("/readyz", "/api/v1/healthz", "/api/v1/get_server_capabilities"):
            return True
        if path == f"{V1}/runs":
            return method in ("GET", "POST")
        if path.startswith(f"{V1}/runs/"):
            return self.run_belongs(acc, path[len(f"{V1}/runs/") :].split("/", 1)[0])
        mine = f"{V1}/jobs/{acc.job_id}"
        if method == "GET":
            return path in (f"{V1}/jobs", mine, f"{mine}/payloads")
        return method == "POST" and path == f"{mine}/state"

    def run_belongs(self, acc: JobAccess, run_id: str) -> bool:
        run = self.runs.get(run_id)
        if run is not None:
            return run.tenant == acc.tenant and (run.user_metadata or {}).get(JOB_META_KEY) == acc.job_id
        rec = self.jobs.get(acc.job_id)
        return rec is not None and run_id in rec.get("runs", ())  # gone now: its routes answer 404

    def _revoke(self, rec: dict) -> None:
        digest = rec.get("key_digest")
        if digest and not rec.get("key_revoked"):
            rec["key_revoked"] = True
            self._keys.pop(digest, None)
            self._revoked[digest] = rec["job_id"]

    # -- submit -----------------------------------------------------------------------------------
    def check_submit(self, body: dict) -> dict:
        """A submit body checked (each error names its field and limit), the payload decoded."""
        return check_submit(body, self.limits.max_job_payload_bytes)

    def create(self, tenant: str, req: dict) -> tuple[dict, str]:
        """Record the job, store payload version 1 and mint its key: (record, key)."""
        now = round(time.time(), 3)
        key = JOB_KEY_PREFIX + secrets.token_urlsafe(32)
        rec = {
            "job_id": "job-" + secrets.token_hex(8),
            "tenant": tenant,
            "name": req["name"],
            "kind": req["kind"],
            "where": req["where"],
            "state": "submitted",
            "created": now,
            "updated": now,
            "pid": None,
            "host": None,
            "message": None,
            "meta": req["meta"],
            "reward": req["reward"],
            "control": None,
            "runs": [],
            "payload_versions": [],
            "key_id": secrets.token_hex(8),
            "key_digest": key_digest(key),
            "key_revoked": False,
            "k8s": None,
        }
        with self._lock:
            mine = [r for r in self.jobs.values() if r["tenant"] == tenant]
            most = self.limits.max_jobs_per_tenant
            if len(mine) >= most:
                raise Conflict(
                    f"this tenant keeps {len(mine)} jobs, the most (OPENRL_MAX_JOBS_PER_TENANT={most}); "
                    "delete old jobs (job.delete() / DELETE /openrl/v1/jobs/{id}) to submit more",
                    field="name",
                )
            self._check_total(tenant, len(req["payload"]))
            for other in self.jobs.values():
                if (
                    other["tenant"] == tenant
                    and other["name"] == req["name"]
                    and other["state"] not in TERMINAL_STATES
                ):
                    raise Conflict(
                        f"job {req['name']!r} is {other['state']} ({other['job_id']}); stop it, delete it "
                        f"(job.delete() / DELETE /openrl/v1/jobs/{other['job_id']}) or pick another name",
                        field="name",
                    )
            self.jobs[rec["job_id"]] = rec
            try:
                self._store_payload(rec, req["payload"], req["reward"], now)
            except BaseException:
                self.jobs.pop(rec["job_id"], None)
                shutil.rmtree(self._dir(rec), ignore_errors=True)
                raise
            self._keys[rec["key_digest"]] = rec["job_id"]
        return rec, key

    def _check_total(self, tenant: str, adding: int) -> None:
        """The tenant's payload bytes (every version of every kept job) stay within their budget."""
        most = self.limits.max_job_payload_total_bytes
        total = adding + sum(
            v["bytes"] for r in self.jobs.values() if r["tenant"] == tenant for v in r["payload_versions"]
        )
        if total > most:
            raise PayloadTooLarge(
                f"payload: this tenant's job payloads would take {total} bytes; at most {most} "
                f"(OPENRL_MAX_JOB_PAYLOAD_TOTAL_BYTES={most}); delete old jobs to free some",
                field="payload",
            )

    def _store_payload(self, rec: dict, data: bytes, reward: str | None, now: float) -> int:
        version = len(rec["payload_versions"]) + 1
        write_private(self._dir(rec) / f"payload-{version}.bin", data)
        rec["payload_versions"].append(
            {
                "version": version,
                "reward": reward,
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
                "created": now,
            }
        )
        if reward is not None:
            rec["reward"] = reward
        rec["updated"] = now
        self._save(rec)
        return version

    def set_k8s(self, rec: dict, info: dict) -> None:
        with self._lock:
            rec["k8s"] = dict(info)
            if rec["job_id"] in self.jobs:  # not one deleted meanwhile (no job.json resurrected)
                self._save(rec)

    def discard(self, rec: dict) -> None:
        """Forget a job whose submission failed (its key with it)."""
        with self._lock:
            self.jobs.pop(rec["job_id"], None)
            self._keys.pop(rec.get("key_digest") or "", None)
            shutil.rmtree(self._dir(rec), ignore_errors=True)

    # -- lookups ----------------------------------------------------------------------------------
    def find(self, tenant: str, ref: str) -> dict:
        """The tenant's job ``ref`` (a job id, else the newest job of that name); 404 otherwise."""
        rec = self.jobs.get(ref)
        if rec is not None and rec["tenant"] == tenant:
            return rec
        named = [r for r in list(self.jobs.values()) if r["tenant"] == tenant and r["name"] == ref]
        if not named:
            raise NotFound(f"unknown job {ref[:100]!r}", field="job_id")
        return max(named, key=lambda r: r["created"])

    def of_tenant(self, tenant: str) -> list[dict]:
        return sorted(
            (r for r in list(self.jobs.values()) if r["tenant"] == tenant), key=lambda r: r["created"]
        )

    def runs_of(self, rec: dict) -> list[str]:
        """The job's runs: those recorded, and every live run labelled with the job (recorded now)."""
        live = [
            run_id
            for run_id, run in list(self.runs.items())
            if run.tenant == rec["tenant"] and (run.user_metadata or {}).get(JOB_META_KEY) == rec["job_id"]
        ]
        new = [r for r in live if r not in rec["runs"]]
        if new:
            with self._lock:
                rec["runs"] = rec["runs"] + [r for r in new if r not in rec["runs"]]
                if rec["job_id"] in self.jobs:
                    self._save(rec)
        return list(rec["runs"])

    def entry(self, rec: dict, phase: str | None = None) -> dict:
        """A job as the API shows it: never the key or its digest, no payload data."""
        out = {
            k: rec[k]
            for k in (
                "job_id",
                "name",
                "kind",
                "where",
                "state",
                "created",
                "updated",
                "pid",
                "host",
                "message",
                "meta",
                "reward",
                "control",
                "key_id",
            )
        }
        out["runs"] = self.runs_of(rec)
        out["payload_versions"] = [dict(v) for v in rec["payload_versions"]]
        k8s = rec.get("k8s")
        out["k8s"] = (
            None
            if k8s is None
            else {"namespace": k8s.get("namespace"), "job": k8s.get("job"), "phase": phase}
        )
        return out

    # -- changes ----------------------------------------------------------------------------------
    def report_state(self, tenant: str, ref: str, body: dict, revoked_key: bool = False) -> dict:
        """The job's worker (or the notebook) reports its state; a terminal one revokes the key. A
        repeat of the job's terminal state (a retried report) answers the job unchanged; with
        ``revoked_key`` (the job's own key, revoked by that state) nothing else is allowed."""
        state = body["state"]  # (its fields checked by the route's request model, JobState)
        pid, host, message = body.get("pid"), body.get("host"), body.get("message")
        with self._lock:
            rec = self.find(tenant, ref)
            if rec["state"] in TERMINAL_STATES and state == rec["state"]:
                return rec  # a retried report of the same end: answered, nothing changes
            if revoked_key:
                why = f"its job is {rec['state']}" if rec["state"] in TERMINAL_STATES else "its job was reset"
                raise Unauthorized(
                    f"this key of job {rec['name']} ({rec['job_id']}) was revoked: {why}", field="X-API-Key"
                )
            if rec["state"] in TERMINAL_STATES:
                raise Conflict(f"job {rec['name']} is already {rec['state']}", field="state")
            rec["state"] = state
            for k, v in (("pid", pid), ("host", host), ("message", message)):
                if v is not None:
                    rec[k] = v
            rec["updated"] = round(time.time(), 3)
            if state in TERMINAL_STATES:
                self._revoke(rec)
            self._save(rec)
        return rec

    def set_control(self, rec: dict, control: dict) -> None:
        with self._lock:
            rec["control"] = {**control, "at": round(time.time(), 3)}
            rec["updated"] = rec["control"]["at"]
            if rec["job_id"] in self.jobs:  # not one deleted meanwhile (no job.json resurrected)
                self._save(rec)

    def control_of(self, tenant: str, job_id: str) -> dict | None:
        """The job's recorded control (a run created after it obeys it too), if any."""
        rec = self.jobs.get(job_id)
        return rec.get("control") if rec is not None and rec["tenant"] == tenant else None

    def add_payload(self, tenant: str, ref: str, body: dict) -> tuple[int, bool]:
        """A new payload version (a hot-swapped reward); the job's worker polls for it. Returns
        (version, created): the newest version again when its bytes are the same (a retried POST)."""
        data = decode_payload(body["payload"], body["payload_sha256"], self.limits.max_job_payload_bytes)
        reward = body.get("reward")
        with self._lock:
            rec = self.find(tenant, ref)
            if rec["state"] in TERMINAL_STATES:
                raise Conflict(
                    f"job {rec['name']} is {rec['state']}; it takes no new payload", field="job_id"
                )
            newest = rec["payload_versions"][-1] if rec["payload_versions"] else None
            if newest is not None and newest["sha256"] == hashlib.sha256(data).hexdigest():
                return newest["version"], False
            if len(rec["payload_versions"]) >= MAX_PAYLOAD_VERSIONS:
                raise Conflict(
                    f"payload: job {rec['name']} already has {MAX_PAYLOAD_VERSIONS} payload versions, "
                    "the most kept; submit a new job",
                    field="payload",
                )
            self._check_total(rec["tenant"], len(data))
            return self._store_payload(rec, data, reward, round(time.time(), 3)), True

    def payloads(self, tenant: str, ref: str, after: int) -> list[dict]:
        """Payload versions newer than ``after``, each with its bytes as base64."""
        rec = self.find(tenant, ref)
        out = []
        for v in list(rec["payload_versions"]):
            if v["version"] > after:
                data = (self._dir(rec) / f"payload-{v['version']}.bin").read_bytes()
                out.append({**v, "payload": base64.b64encode(data).decode()})
        return out

    def delete(self, tenant: str, ref: str, why: str | None = None) -> dict:
        """Forget the job and its payloads; its key is revoked (its runs stay). ``why``: what its key's
        401 says from then on, when the job's owner did not delete it (the operator removed the tenant)."""
        with self._lock:
            rec = self.find(tenant, ref)
            self._revoke(rec)
            if why:
                self._deleted_why[rec["job_id"]] = why
            self.jobs.pop(rec["job_id"], None)
            self.seen.pop(rec["job_id"], None)
            for run_id in [r for r, (j, _) in self._archived.items() if j == rec["job_id"]]:
                del self._archived[run_id]
            shutil.rmtree(self._dir(rec), ignore_errors=True)
        return rec

    # -- lost workers -----------------------------------------------------------------------------
    def reconcile(self, rec: dict, phase: str | None = None, reason: str | None = None, now=None) -> bool:
        """Fail a job whose worker is gone without reporting, revoking its key: its Kubernetes Job
        ended or vanished (``phase`` failed/succeeded/missing), or no request from its key for
        OPENRL_JOB_LOST_AFTER_S while running (a local one: also while still submitted) unless its
        Kubernetes Job is pending (a retry pod waiting for a node or for Kueue)."""
        if rec["state"] in TERMINAL_STATES:
            return False
        now = time.time() if now is None else now
        limit = self.limits.job_lost_after_s
        if phase in ("failed", "succeeded", "missing"):
            what = "is gone" if phase == "missing" else phase
            message = f"its Kubernetes Job {what}" + (f": {reason}" if reason else "")
        elif phase == "pending":  # Kubernetes says a pod is to come (a retry queued in Kueue): wait
            return False
        elif rec["state"] == "running" or (rec["state"] == "submitted" and rec["where"] == "local"):
            last = max(self.seen.get(rec["job_id"], 0.0), self.started, rec["created"])
            if now - last <= limit:
                return False
            message = f"its worker stopped reporting (no request for {limit} s; OPENRL_JOB_LOST_AFTER_S)"
        else:
            return False
        with self._lock:
            if rec["state"] in TERMINAL_STATES or rec["job_id"] not in self.jobs:
                return False
            log.warning("job %s (%s) failed: %s", rec["name"], rec["job_id"], message)
            rec["state"], rec["message"] = "failed", message[:MAX_MESSAGE_CHARS]
            rec["updated"] = round(now, 3)
            self._revoke(rec)
            self._save(rec)
        return True

    def sweep(self, now: float) -> None:
        """The housekeeping round: reconcile every job not yet over, with what Kubernetes last said
        of its Job (:meth:`poll_kube`'s answers), then ask Kubernetes again on a thread of its own.
        The round never waits on the API server: a slow one (up to 35 s a call) would stall result
        expiry and idle-session reaping, which share the round."""
        for rec in [r for r in list(self.jobs.values()) if r["state"] not in TERMINAL_STATES]:
            phase = reason = None
            k8s = rec.get("k8s") or {}
            if k8s.get("job"):
                phase, reason = self.kube_phase(k8s["job"])
            self.reconcile(rec, phase, reason, now)
        self.poll_kube_in_background()

    def kube_phase(self, job_name: str) -> tuple[str | None, str | None]:
        """(phase, reason) of the Kubernetes Job as last asked, or (None, None): never asked yet, or
        the last call failed (the job is then judged by its worker's requests alone). An answer is
        at most one poll old: each call is bounded by the launcher's request timeout."""
        hit = self._kube_phases.get(job_name)
        return (None, None) if hit is None else (hit[1], hit[2])

    def poll_kube(self) -> None:
        """Ask Kubernetes the status of every job not yet over that has a Kubernetes Job (each call
        bounded by the launcher's request timeout); the next :meth:`sweep` applies the answers. An
        answer replaces only an older one (a call that started earlier and finished later loses)."""
        if self.kube_status is None:
            return
        names = {
            (r.get("k8s") or {}).get("job")
            for r in list(self.jobs.values())
            if r["state"] not in TERMINAL_STATES
        } - {None, ""}
        for name in sorted(names):
            asked_at = time.time()
            try:
                st = self.kube_status(name) or {}
                answer: tuple | None = (asked_at, st.get("phase"), st.get("reason"))
            except Exception:  # noqa: BLE001 - an unreachable API server: ask again next round
                log.warning("Kubernetes status of job %s failed", name, exc_info=True)
                answer = None
            with self._kube_lock:
                prior = self._kube_phases.get(name)
                if prior is None or prior[0] <= asked_at:
                    if answer is None:
                        self._kube_phases.pop(name, None)
                    else:
                        self._kube_phases[name] = answer
        with self._kube_lock:  # forget the answers about jobs that are over or gone
            for name in [n for n in self._kube_phases if n not in names]:
                del self._kube_phases[name]

    def poll_kube_in_background(self) -> bool:
        """Start :meth:`poll_kube` on a daemon thread unless the previous poll still runs (one at a
        time: a hung API server holds one thread, never more); True when one was started."""
        if self.kube_status is None:
            return False
        with self._kube_lock:
            if self._kube_poller is not None and self._kube_poller.is_alive():
                return False
            self._kube_poller = threading.Thread(
                target=self._poll_logged, name="openrl-kube-status", daemon=True
            )
            self._kube_poller.start()
        return True

    def _poll_logged(self) -> None:
        try:
            self.poll_kube()
        except Exception:  # noqa: BLE001 - a thread's error goes to the log, the next round retries
            log.exception("asking Kubernetes for the jobs' status failed")

    # -- runs kept after their session ------------------------------------------------------------
    def archive_run(self, tenant: str, job_id: str, run_id: str, entry: dict, metrics: list) -> None:
        """Keep a job's run (its entry and metric rows) in the job's folder when its session ends,
        readable until the job is deleted."""
        with self._lock:
            rec = self.jobs.get(job_id)
            if rec is None or rec["tenant"] != tenant:
                return
            folder = self._dir(rec) / "runs"
            write_private(folder / f"{run_id}.metrics.json", json.dumps(metrics, default=str).encode())
            entry = json.loads(json.dumps(entry, default=str))
            write_private(folder / f"{run_id}.entry.json", json.dumps(entry).encode())  # last: the index
            self._archived[run_id] = (job_id, entry)
            if run_id not in rec["runs"]:
                rec["runs"] = rec["runs"] + [run_id]
                self._save(rec)

    def archived(self, tenant: str, run_id: str) -> dict | None:
        """A kept run of ``tenant``: its entry (kept in memory), else None."""
        job_id, entry = self._archived.get(run_id) or ("", None)
        rec = self.jobs.get(job_id)
        return dict(entry) if rec is not None and rec["tenant"] == tenant else None

    def archived_metrics(self, tenant: str, run_id: str) -> list[dict]:
        """A kept run's metric rows (read from the job's folder)."""
        job_id, _ = self._archived.get(run_id) or ("", None)
        rec = self.jobs.get(job_id)
        if rec is None or rec["tenant"] != tenant:
            return []
        try:
            return json.loads((self._dir(rec) / "runs" / f"{run_id}.metrics.json").read_text())
        except (OSError, ValueError):
            return []

    def archived_of(self, tenant: str) -> list[str]:
        return [
            r
            for r, (j, _) in list(self._archived.items())
            if (self.jobs.get(j) or {}).get("tenant") == tenant
        ]
