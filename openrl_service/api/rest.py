"""Tinker's RestClient surface (``/api/v1``): training runs, checkpoints, sessions, weights, downloads.

A thin façade over :class:`~openrl_service.engine.catalog.Catalog`; every object belongs to the
caller's tenant and another tenant gets 404. Catalog calls read and write files, so they run in the
thread pool (``off``): a slow disk never holds the event loop and its long-polls.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from starlette.concurrency import run_in_threadpool as off

from openrl_service.api import schemas as S
from openrl_service.api.http import ServiceRoute, json_response, read_json, read_model, tenant
from openrl_service.api.openapi_bodies import body
from openrl_service.engine.catalog import Catalog
from openrl_service.engine.service import TrainingService
from openrl_service.errors import NotFound, UserError

CKPT = "/training_runs/{run_id}/checkpoints/{kind}/{name}"


def _int(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{name} must be an integer; got {raw!r}", field=name) from None


def _base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def build_rest_router(svc: TrainingService) -> APIRouter:
    r = APIRouter(
        prefix="/api/v1", route_class=ServiceRoute, generate_unique_id_function=S.operation_ids("rest")
    )
    cat = Catalog(svc)
    max_body = svc.limits.max_body_bytes
    B = S.bodies(svc.limits, svc.settings.min_ttl_s)

    # -- training runs -------------------------------------------------------------------------
    @r.get("/training_runs")
    async def list_training_runs(request: Request):
        """The caller's training runs, newest first, paged by limit/offset."""
        return json_response(
            await off(
                cat.list_training_runs,
                tenant(request),
                _int(request, "limit", 20),
                _int(request, "offset", 0),
                request.query_params.get("project_id"),
            )
        )

    @r.get("/training_runs/{run_id}")
    async def get_training_run(run_id: str, request: Request):
        """One training run with its latest checkpoints."""
        return json_response(await off(cat.training_run, tenant(request), run_id))

    @r.get("/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(run_id: str, request: Request):
        """A run's live checkpoints, newest first."""
        return json_response(await off(cat.list_checkpoints, tenant(request), run_id))

    @r.delete(CKPT)
    async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request):
        """Delete a checkpoint."""
        await off(cat.delete, tenant(request), run_id, kind, name)
        return Response(status_code=204)

    @r.post(CKPT + "/publish")
    async def publish(run_id: str, kind: str, name: str, request: Request):
        """Mark a checkpoint public (recorded; this service shares nothing across tenants)."""
        await off(cat.set_public, tenant(request), run_id, kind, name, True)
        return Response(status_code=204)

    @r.delete(CKPT + "/publish")
    async def unpublish(run_id: str, kind: str, name: str, request: Request):
        """Mark a checkpoint private again."""
        await off(cat.set_public, tenant(request), run_id, kind, name, False)
        return Response(status_code=204)

    @r.put(CKPT + "/ttl", openapi_extra=body(B.SetTtl))
    async def set_ttl(run_id: str, kind: str, name: str, request: Request):
        """Set (seconds from now) or clear (null) a checkpoint's expiry."""
        b = await read_model(request, B.SetTtl, max_body)
        await off(cat.set_ttl, tenant(request), run_id, kind, name, b.ttl_seconds)
        return Response(status_code=204)

    @r.get(CKPT + "/external_weights_urls")
    async def external_urls(run_id: str, kind: str, name: str, request: Request):
        """Signed download URLs for a checkpoint's files (valid for an hour, no key needed)."""
        return json_response(
            await off(cat.external_urls, tenant(request), run_id, kind, name, _base_url(request))
        )

    @r.get("/checkpoints")
    async def list_user_checkpoints(request: Request):
        """All the caller's checkpoints across runs, newest first, paged."""
        return json_response(
            await off(
                cat.list_user_checkpoints,
                tenant(request),
                _int(request, "limit", 100),
                _int(request, "offset", 0),
            )
        )

    @r.post("/weights_info", openapi_extra=body(B.WeightsInfo))
    async def weights_info(request: Request):
        """Base model and LoRA layout of a checkpoint."""
        b = await read_model(request, B.WeightsInfo, max_body)
        return json_response(await off(cat.weights_info, tenant(request), b.tinker_path))

    @r.post("/exports", openapi_extra=body(S.Export))
    async def export(request: Request):
        """Build (or reuse) an export of a checkpoint: a PEFT adapter folder, or with ``merged`` a Hugging
        Face model folder; answers its files with signed download URLs (an hour) and their SHA-256."""
        b = await read_model(request, S.Export, max_body)
        return json_response(
            await off(cat.export, tenant(request), b.tinker_path, b.merged, _base_url(request))
        )

    @r.post("/copy_weights", openapi_extra=body(B.CopyWeights))
    async def copy_weights(request: Request):
        """Copy a checkpoint into a session's run slot or a new session of a project."""
        b = await read_model(request, B.CopyWeights, max_body)
        return json_response(await off(cat.copy, tenant(request), b.model_dump(exclude_none=True)))

    # -- sessions ------------------------------------------------------------------------------
    @r.get("/sessions")
    async def list_sessions(request: Request):
        """The caller's session ids, newest first, paged."""
        return json_response(
            await off(
                cat.list_sessions, tenant(request), _int(request, "limit", 20), _int(request, "offset", 0)
            )
        )

    @r.post("/sessions/search", openapi_extra=body(B.SearchSessions, required=False))
    async def search_sessions(request: Request):
        """Sessions matching id, display name, metadata, project or status; newest first."""
        b = await read_model(request, B.SearchSessions, max_body)
        return json_response(await off(cat.search_sessions, tenant(request), b.model_dump(exclude_none=True)))

    @r.get("/sessions/{session_id}")
    async def get_session(session_id: str, request: Request):
        """A session's runs, samplers and metadata."""
        return json_response(await off(cat.get_session, tenant(request), session_id))

    @r.put("/sessions/{session_id}/project", openapi_extra=body(B.AssignProject))
    async def assign_project(session_id: str, request: Request):
        """Move a session and its runs to a project."""
        b = await read_model(request, B.AssignProject, max_body)
        await off(cat.assign_project, tenant(request), session_id, b.project_id)
        return Response(status_code=204)

    @r.get("/sessions/{session_id}/trace_export")
    async def trace_export(session_id: str, request: Request):
        """A Perfetto-readable trace of the session's executed ops, behind a signed URL."""
        return json_response(await off(cat.trace_export, tenant(request), session_id, _base_url(request)))

    # -- downloads (signed; no key) ------------------------------------------------------------
    # -- external weights uploads (Tinker 0.39) and checkpoint search ---------------------------
    @r.post("/external_weights_upload_start")
    async def external_weights_upload_start(request: Request):
        """Start an upload of a PEFT adapter trained elsewhere: signed PUT URLs per file."""
        body = await read_json(request, max_body)
        return json_response(await off(cat.uploads.start, tenant(request), body, _base_url(request)))

    @r.put("/uploads/{token}")
    async def upload_file(token: str, request: Request):
        """One file of an upload (the signed URL is the authorisation), written as it arrives."""
        up, name = cat.uploads.target(cat.verify(token, "upload"))
        size = await cat.uploads.receive(up, name, request.stream())
        return json_response({"file": name, "size_bytes": size})

    @r.post("/external_weights_upload_finish")
    async def external_weights_upload_finish(request: Request):
        """Check the uploaded files against the base model and LoRA config; make the checkpoint."""
        body = await read_json(request, max_body)
        return json_response(await off(cat.uploads.finish, tenant(request), body))

    @r.post("/checkpoints/search")
    async def search_checkpoints(request: Request):
        """The caller's checkpoints, newest first, filtered and paged by cursor (Tinker 0.39)."""
        body = await read_json(request, max_body) if await request.body() else {}
        return json_response(await off(cat.search_checkpoints, tenant(request), body))

    @r.get("/downloads/{token}")
    async def download(token: str):
        """A file behind a signed, expiring URL."""
        path, name = await off(cat.resolve_download, token)
        if not path.is_file():
            raise NotFound("the file behind this link is gone", field="url")
        return FileResponse(path, filename=name)

    return r
