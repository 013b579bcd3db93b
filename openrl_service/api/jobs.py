"""Detached jobs (``/openrl/v1/jobs``): runs that outlive the notebook (engine/jobs.py keeps them).

    POST   /openrl/v1/jobs                       submit {name, kind, where, payload, payload_sha256, reward?,
                                                 meta?, k8s?} → 201 entry (+ key for where=local)
    GET    /openrl/v1/jobs                       the caller's jobs (a job key: its own job only)
    GET    /openrl/v1/jobs/{job}                 one job, by id or else the newest of that name
    POST   /openrl/v1/jobs/{job}/state           {state, pid?, host?, message?}; terminal revokes the key
    POST   /openrl/v1/jobs/{job}/control         {action, reason?}: pause / resume / stop every run of it
    POST   /openrl/v1/jobs/{job}/payloads        a new payload version (a hot-swapped reward) → 201 {version}
    GET    /openrl/v1/jobs/{job}/payloads        ?after=N: the versions after N, with their bytes (base64)
    DELETE /openrl/v1/jobs/{job}                 forget it, revoke its key, delete its Kubernetes Job

where=k8s goes through the service's KubeLauncher (``Container.kube``, openrl_service/kube.py; None unless
the service runs with --jobs-namespace): ``validate`` before the key is minted, ``submit`` after
(the key goes into a Secret and is never returned), ``status`` for entries, ``delete`` on DELETE.
"""

from __future__ import annotations

import logging
import time

import anyio
from fastapi import APIRouter, Depends, Query, Request

from openrl_common.protocol import TERMINAL_STATES
from openrl_service.api import links as L
from openrl_service.api import schemas as S
from openrl_service.api.http import ServiceRoute, json_response, read_model, tenant
from openrl_service.api.openapi_bodies import body
from openrl_service.container import Container
from openrl_service.errors import ApiError, Conflict, InternalError, NotFound

log = logging.getLogger("openrl_service")
PHASE_TTL_S = 5.0


def build_jobs_router(c: Container) -> APIRouter:
    svc, jobs = c.service, c.jobs

    def with_keys() -> None:
        """Without keys every caller is the same tenant: anyone on the machine could send a running
        worker code (a payload it unpickles) or read its payloads. Jobs need a keyed service."""
        if not svc.settings.auth_enabled:
            raise Conflict(
                "the jobs API is off on a service started with --no-auth: without keys any local user "
                "could send code to a running worker (a payload it unpickles) or read its payloads; "
                "start the service with an API key (the default) to detach runs",
                field="--no-auth",
            )

    r = APIRouter(
        prefix="/openrl/v1",
        tags=["jobs"],
        dependencies=[Depends(with_keys)],
        route_class=ServiceRoute,  # POSTs that journal run control are synced before the reply
        generate_unique_id_function=S.operation_ids("jobs"),
    )
    max_body = svc.limits.max_body_bytes
    B = S.bodies(svc.limits, svc.settings.min_ttl_s)

    def launcher():
        return c.kube

    def job_of(request: Request) -> str | None:
        return getattr(request.state, "job_id", None)

    phases: dict[str, tuple[float, str, str | None]] = {}  # Job name → (when asked, phase, reason)

    async def phase_of(job_name: str) -> tuple[str, str | None]:
        """The Kubernetes Job's phase (and why), asked at most every PHASE_TTL_S (a worker polls
        its entry)."""
        kube = launcher()
        if kube is None:
            return "unknown", None
        hit = phases.get(job_name)
        if hit is not None and time.monotonic() - hit[0] < PHASE_TTL_S:
            return hit[1], hit[2]
        try:
            st = await anyio.to_thread.run_sync(kube.status, job_name)
        except Exception:  # noqa: BLE001 - an unreachable API server leaves the phase unknown
            log.warning("Kubernetes status of job %s failed", job_name, exc_info=True)
            return "unknown", None
        if len(phases) > 10_000:
            phases.clear()
        phases[job_name] = (time.monotonic(), st.get("phase", "unknown"), st.get("reason"))
        return phases[job_name][1], phases[job_name][2]

    async def entry(rec: dict) -> dict:
        """The job's entry; one not over is reconciled first (its worker gone without reporting).
        A job that is over does not ask Kubernetes."""
        k8s = rec.get("k8s")
        phase = reason = None
        if rec["state"] not in TERMINAL_STATES:
            if k8s is not None and k8s.get("job"):
                phase, reason = await phase_of(k8s["job"])
            await anyio.to_thread.run_sync(jobs.reconcile, rec, phase, reason)  # writes job.json
        elif k8s is not None and k8s.get("job") and k8s["job"] in phases:
            phase = phases[k8s["job"]][1]
        return jobs.entry(rec, phase)

    @r.post("/jobs", status_code=201, openapi_extra=body(B.SubmitJob), responses=L.SUBMIT_JOB_LINKS)
    async def submit_job(request: Request):
        """Submit a detached job: its payload is stored (never unpickled) and a job-scoped key minted;
        where=local answers the key, where=k8s hands it to a Kubernetes Job's Secret."""
        req = jobs.check_submit(
            (await read_model(request, B.SubmitJob, max_body)).model_dump(exclude_none=True)
        )
        kube = None
        if req["where"] == "k8s":
            kube = launcher()
            if kube is None:
                raise Conflict(
                    "where=k8s needs a service started with --jobs-namespace (OPENRL_JOBS_NAMESPACE); "
                    "this one runs where=local jobs only",
                    field="where",
                )
            req["k8s"] = await anyio.to_thread.run_sync(kube.validate, req["k8s"])
        rec, key = await anyio.to_thread.run_sync(jobs.create, tenant(request), req)
        out_k8s = None
        if kube is not None:
            try:
                out_k8s = await anyio.to_thread.run_sync(
                    lambda: kube.submit(
                        tenant=rec["tenant"],
                        job_id=rec["job_id"],
                        name=rec["name"],
                        kind=rec["kind"],
                        key=key,
                        request=req["k8s"],
                    )
                )
            except ApiError:
                await anyio.to_thread.run_sync(jobs.discard, rec)
                raise
            except Exception as e:
                await anyio.to_thread.run_sync(jobs.discard, rec)
                log.exception("submitting job %s to Kubernetes failed", rec["job_id"])
                raise InternalError(f"submitting the job to Kubernetes failed ({type(e).__name__})") from None
            await anyio.to_thread.run_sync(jobs.set_k8s, rec, out_k8s)
        out = jobs.entry(rec, "pending" if out_k8s is not None else None)
        if out_k8s is not None:
            out["k8s"] = dict(out_k8s)
        else:
            out["key"] = key  # shown once; only its digest is kept
        return json_response(out, status=201)

    @r.get("/jobs")
    async def list_jobs(request: Request):
        """The caller's jobs, oldest first (a job key sees its own job only)."""
        own = job_of(request)
        recs = [rec for rec in jobs.of_tenant(tenant(request)) if own is None or rec["job_id"] == own]
        return json_response({"jobs": [await entry(rec) for rec in recs]})

    @r.get("/jobs/{job_id}")
    async def get_job(job_id: str, request: Request):
        """One job, by id, else the newest job of that name."""
        return json_response(await entry(jobs.find(tenant(request), job_id)))

    @r.post("/jobs/{job_id}/state", openapi_extra=body(B.JobState))
    async def job_state(job_id: str, request: Request):
        """The job reports its state (pid, host, message); finished, failed or stopped revokes its key."""
        body = (await read_model(request, B.JobState, max_body)).model_dump(exclude_none=True)
        revoked = bool(getattr(request.state, "job_revoked", False))  # its own key, after its end
        rec = await anyio.to_thread.run_sync(jobs.report_state, tenant(request), job_id, body, revoked)
        return json_response(await entry(rec))

    @r.post("/jobs/{job_id}/control", openapi_extra=body(B.Control))
    async def job_control(job_id: str, request: Request):
        """Pause, resume or stop every run of the job (each as /runs/{id}/control does); the job's
        entry keeps the request, so a worker that has no run yet obeys it too."""
        b = await read_model(request, B.Control, max_body)
        who = tenant(request)
        control = {"action": b.action, "reason": b.reason}
        rec = jobs.find(who, job_id)
        if rec["state"] in TERMINAL_STATES:
            raise Conflict(
                f"job {rec['name']} is {rec['state']}; there is nothing to {control['action']}",
                field="action",
            )
        native = c.native
        sent = {k: v for k, v in control.items() if v is not None}
        # Recorded first: a run created from now on obeys it at creation (NativeRuns.create reads it);
        # one created before is in runs_of below.
        await anyio.to_thread.run_sync(jobs.set_control, rec, control)
        for run_id in jobs.runs_of(rec):
            try:
                native.control(who, run_id, sent)
            except (NotFound, Conflict):  # gone, or already done in its worker: nothing to control
                continue
        return json_response(await entry(rec))

    @r.post("/jobs/{job_id}/payloads", status_code=201, openapi_extra=body(B.AddJobPayload))
    async def add_payload(job_id: str, request: Request):
        """A new payload version (a hot-swapped reward); the job's worker picks it up at its next step."""
        body = (await read_model(request, B.AddJobPayload, max_body)).model_dump(exclude_none=True)
        version, created = await anyio.to_thread.run_sync(jobs.add_payload, tenant(request), job_id, body)
        # the same bytes as the newest version (a retried POST): that version, not a duplicate
        return json_response({"version": version}, status=201 if created else 200)

    @r.get("/jobs/{job_id}/payloads")
    async def payloads(job_id: str, request: Request, after: int = Query(0, ge=0, le=2**31)):
        """The payload versions after ``after`` (0: all), each with its bytes as base64."""
        out = await anyio.to_thread.run_sync(jobs.payloads, tenant(request), job_id, after)
        return json_response({"payloads": out})

    @r.delete("/jobs/{job_id}")
    async def delete_job(job_id: str, request: Request):
        """Forget the job and its payloads and revoke its key (its worker's next request is refused);
        a Kubernetes Job is deleted. Its runs stay."""
        rec = jobs.find(tenant(request), job_id)
        k8s = rec.get("k8s")
        if k8s and k8s.get("job"):  # first: if Kubernetes refuses, the job (and its key) stay to retry
            kube = launcher()
            if kube is None:
                log.warning("job %s: no Kubernetes launcher to delete Job %s", rec["job_id"], k8s["job"])
            else:
                await anyio.to_thread.run_sync(kube.delete, k8s["job"])
        rec = await anyio.to_thread.run_sync(jobs.delete, tenant(request), rec["job_id"])
        return json_response({"job_id": rec["job_id"], "name": rec["name"], "deleted": True})

    return r
