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

from openrl_service.api.auth import AuthMiddleware, KeyRing, redact_access_log
from openrl_service.api.http import json_response
from openrl_service.api.hub import build_hub_router
from openrl_service.api.hubauth import HubAuth, MintedKeys
from openrl_service.api.jobs import build_jobs_router
from openrl_service.api.keys import build_keys_router
from openrl_service.api.metrics import build_metrics_router
from openrl_service.api.native import build_native_router
from openrl_service.api.rest import build_rest_router
from openrl_service.api.tinker import build_router, health
from openrl_service.config import Settings
from openrl_service.engine.jobs import Jobs
from openrl_service.engine.service import TrainingService
from openrl_service.errors import ApiError
from openrl_service.lifecycle import Lifecycle

log = logging.getLogger("openrl_service")


def create_app(settings: Settings, *, service: TrainingService | None = None) -> FastAPI:
    svc = service or TrainingService(settings)
    life = Lifecycle(svc, grace_s=settings.drain_grace_s)
    minted = MintedKeys(settings.data_dir / "minted-keys.json", settings.max_keys_per_user)
    jobs = Jobs(settings.data_dir, settings.limits, svc.runs)
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

        sweeper = asyncio.create_task(sweep())
        snapshotter = asyncio.create_task(snapshots())
        try:
            yield
        finally:
            sweeper.cancel()
            snapshotter.cancel()
            starting.cancel()
            if hub is not None:
                await hub.aclose()
            await asyncio.get_running_loop().run_in_executor(None, svc.stop)

    app = FastAPI(
        title="openrl-service",
        version="0.1.0",
        lifespan=lifespan,
        description="Self-hosted LoRA training and sampling; speaks the Tinker wire protocol.",
    )
    app.state.service = svc
    app.state.lifecycle = life
    app.include_router(build_router(svc))
    app.include_router(build_hub_router(svc))
    app.include_router(build_rest_router(svc))
    app.include_router(build_native_router(svc))
    app.include_router(build_jobs_router(svc, jobs))
    app.include_router(build_metrics_router(svc))
    app.include_router(build_keys_router(minted, settings.limits.max_body_bytes))

    @app.get("/healthz")
    async def healthz():
        """The device-worker thread is alive (also while the service drains)."""
        return health(svc)

    @app.get("/readyz")
    async def readyz():
        """200 when the service takes work; else 503 and its state (starting, draining...)."""
        status, body = life.readiness()
        return json_response(body, status=status)

    @app.exception_handler(ApiError)
    async def service_error(request: Request, exc: ApiError):
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
        return json_response(
            {"error": f"{where}: {first.get('msg', 'invalid request')}", "category": "user", "field": where},
            status=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return json_response({"error": str(exc.detail), "category": "user"}, status=exc.status_code)

    app.add_middleware(
        AuthMiddleware,
        settings=settings,
        keys=KeyRing(settings.api_keys),
        minted=minted,
        hub=hub,
        jobs=jobs,
    )
    return app
