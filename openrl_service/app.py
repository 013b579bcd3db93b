"""create_app(settings): the FastAPI application — routers, auth, error handlers, the health checks
and the lifecycle (``app.state.lifecycle``: the state /readyz reports, the drain on SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from openrl_common.datadirs import CHALLENGE_RE, readyz_proof
from openrl_service.api.admin import AdminKey, TenantAdmin, build_admin_router, write_admin_key
from openrl_service.api.anthropic import build_anthropic_router, is_anthropic_path
from openrl_service.api.anthropic import error_response as anthropic_error
from openrl_service.api.auth import AuthMiddleware, KeyRing, redact_access_log
from openrl_service.api.http import json_response
from openrl_service.api.hub import build_hub_router
from openrl_service.api.hubauth import (
    HubAccounts,
    HubAuth,
    HubUsers,
    KnownIdentities,
    MintedKeys,
    recreated_message,
    user_of,
)
from openrl_service.api.jobs import build_jobs_router
from openrl_service.api.keys import build_keys_router
from openrl_service.api.metrics import build_metrics_router
from openrl_service.api.native import build_native_router
from openrl_service.api.openai import (
    api_error_response,
    build_openai_routers,
    error_response,
    is_openai_path,
)
from openrl_service.api.rest import build_rest_router
from openrl_service.api.tinker import build_router, health
from openrl_service.config import Settings
from openrl_service.container import Container
from openrl_service.engine.service import TrainingService
from openrl_service.errors import ApiError, UserError
from openrl_service.lifecycle import Lifecycle

log = logging.getLogger("openrl_service")


def create_app(settings: Settings, *, service: TrainingService | None = None) -> FastAPI:
    parts = Container.build(settings, service)
    svc = parts.service
    life = Lifecycle(svc, grace_s=settings.drain_grace_s)
    minted = MintedKeys(
        settings.data_dir / "minted-keys.json", settings.max_keys_per_user, settings.minted_key_ttl_s
    )
    admin = TenantAdmin(parts, minted)

    def retire_tenant(tenant: str, reason: str) -> None:
        """Retire the tenant of a JupyterHub account that was deleted and created again under the same
        name (``reason`` says so), before the new account's first request goes on.

        Called by HubAccounts (api/hubauth.py) on a worker thread, once per re-creation, with the
        tenant string the old and the new account share (``hub:<name>``). When it returns, nothing
        of the old account may be reachable through that tenant: its minted keys refused (done here:
        each says why), its runs, sessions, samplers and jobs ended (job keys are refused already:
        a job submitted before the new account was first seen is the old account's), and its data
        (checkpoints, job folders) moved out of the tenant's folder where an admin can inspect or
        remove it. It must be safe to call again after a failure: raising refuses the request with
        503 and the next request of the new account calls it again."""
        name = user_of(tenant) or tenant
        count = minted.revoke_tenant(tenant, recreated_message(name))
        log.warning("%s: revoked %d minted key(s) of tenant %r", reason, count, tenant)
        admin.retire(tenant, reason)  # sessions ended, jobs deleted, files moved to <data>/retired/

    hub_users = (
        HubUsers(settings.hub_api_url, settings.hub_api_token, settings.hub_user_recheck_s)
        if settings.hub_api_url and settings.hub_api_token
        else None
    )
    accounts = (
        HubAccounts(
            hub_users, KnownIdentities(settings.data_dir / "hub-identities.json"), retire_tenant, minted
        )
        if settings.hub_api_url
        else None
    )
    hub = (
        HubAuth(
            settings.hub_api_url,
            settings.hub_service_name,
            settings.hub_cache_ttl_s,
            failed_lookups_per_min=settings.hub_failed_lookups_per_min,
        )
        if settings.hub_api_url
        else None
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.futures.loop = asyncio.get_running_loop()
        redact_access_log()  # after the server configured logging
        svc.start()
        starting = asyncio.create_task(life.start())  # starting → ready once the model is loaded

        async def sweep():
            """Housekeeping: expired results and idle sessions every few seconds, expired checkpoints
            (a walk over the data folder) every five minutes."""
            last_disk_sweep = 0.0
            while True:
                await asyncio.sleep(min(10.0, max(0.5, settings.future_ttl_s / 4)))
                # One failed round (a full disk, a vanished folder) is logged; the next one still runs.
                try:
                    svc.engine.forget(svc.futures.sweep())
                    await asyncio.to_thread(svc.reap_idle_sessions)  # writes session records
                    if time.monotonic() - last_disk_sweep > 300:
                        last_disk_sweep = time.monotonic()
                        await asyncio.to_thread(svc.store.sweep_expired)
                except Exception:
                    log.exception("housekeeping round failed; retrying in the next round")

        async def snapshots():
            """Snapshot the state (and compact the journal) every OPENRL_SNAPSHOT_INTERVAL_S when
            anything changed."""
            interval = settings.snapshot_interval_s
            while interval > 0:
                await asyncio.sleep(interval)
                if life.taking_work and svc.durability.due():
                    await svc.durability.snapshot()

        async def verify_hub_token():
            """Ask the hub once at startup whether the service's own token may read users, so a wrong
            token is logged now rather than at a user's first request (lookups check it too)."""
            # verify() logs a token the hub refuses or one without read:users; an unreachable hub is
            # simply asked again at the first lookup
            with contextlib.suppress(Exception):
                await hub_users.verify()

        sweeper = asyncio.create_task(sweep())
        snapshotter = asyncio.create_task(snapshots())
        verifier = asyncio.create_task(verify_hub_token()) if hub_users is not None else None
        try:
            yield
        finally:
            sweeper.cancel()
            snapshotter.cancel()
            starting.cancel()
            if verifier is not None:
                verifier.cancel()
            if hub is not None:
                await hub.aclose()
            if hub_users is not None:
                await hub_users.aclose()
            await asyncio.get_running_loop().run_in_executor(None, svc.stop)

    app = FastAPI(
        title="openrl-service",
        version="0.1.0",
        lifespan=lifespan,
        description="Self-hosted LoRA training and sampling; speaks the Tinker wire protocol.",
    )
    app.state.service = svc
    app.state.parts = parts
    app.state.lifecycle = life
    app.include_router(build_router(svc))
    app.include_router(build_hub_router(svc))
    app.include_router(build_rest_router(svc))
    app.include_router(build_native_router(parts))
    app.include_router(build_jobs_router(parts))
    app.include_router(build_metrics_router(svc))
    app.include_router(build_keys_router(minted, settings.limits.max_body_bytes))
    app.state.admin = admin
    app.include_router(build_admin_router(admin))
    for router in build_openai_routers(svc, svc.inference):
        app.include_router(router)
    app.include_router(build_anthropic_router(svc, svc.inference))

    @app.get("/healthz")
    async def healthz():
        """The device-worker thread is alive (also while the service drains)."""
        return health(svc)

    @app.get("/readyz")
    async def readyz(request: Request, challenge: str | None = None):
        """200 when the service takes work; else 503 and its state (starting, draining...). With
        ``challenge`` (32-128 hex digits), a ``proof`` that this is the service started with its
        secret, on the port asked (openrl_common.datadirs: a kernel checks it before sending a key)."""
        status, body = life.readiness()
        if challenge is not None:
            if not CHALLENGE_RE.fullmatch(challenge):
                raise UserError("challenge must be 32 to 128 lowercase hex digits", field="challenge")
            port = (request.scope.get("server") or (None, settings.port))[1]
            body["proof"] = readyz_proof(settings.instance_secret, port, challenge)
        return json_response(body, status=status)

    @app.exception_handler(ApiError)
    async def service_error(request: Request, exc: ApiError):
        if is_anthropic_path(request.url.path):
            retry = getattr(exc, "retry_after_s", None)
            return anthropic_error(
                exc.status_code, exc.message, 2.0 if retry is None and exc.status_code == 503 else retry
            )
        if is_openai_path(request.url.path):
            return api_error_response(exc)
        resp = json_response(exc.to_json(), status=exc.status_code)
        if exc.status_code == 503:
            retry_after_s = getattr(exc, "retry_after_s", 2.0)
            resp.headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
            resp.headers["retry-after-ms"] = str(max(1, round(retry_after_s * 1000)))
        return resp

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if is_anthropic_path(request.url.path):
            return anthropic_error(400, f"{where}: {first.get('msg', 'invalid request')}")
        if is_openai_path(request.url.path):
            return error_response(400, f"{where}: {first.get('msg', 'invalid request')}", where)
        return json_response(
            {"error": f"{where}: {first.get('msg', 'invalid request')}", "category": "user", "field": where},
            status=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if is_anthropic_path(request.url.path):
            return anthropic_error(exc.status_code, str(exc.detail))
        if is_openai_path(request.url.path):
            return error_response(exc.status_code, str(exc.detail), None)
        return json_response({"error": str(exc.detail), "category": "user"}, status=exc.status_code)

    app.add_middleware(
        AuthMiddleware,
        settings=settings,
        keys=KeyRing(settings.api_keys),
        minted=minted,
        hub=hub,
        jobs=parts.jobs,
        accounts=accounts,
        admin=AdminKey(write_admin_key(settings.data_dir)),
    )
    return app
