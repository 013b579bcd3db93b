"""The operator's routes: list tenants and what they hold, remove one (``openrl-service admin``).

    GET    /openrl/v1/admin/tenants           → {"tenants": [{tenant, folder, checkpoint_bytes,
                                                  live_sessions, live_runs, jobs, minted_keys,
                                                  device_seconds, device_seconds_total,
                                                  device_quota_refusals}]}
    DELETE /openrl/v1/admin/tenants/{tenant}  → 200 {tenant, sessions_ended, checkpoint_bytes,
                                                  jobs_deleted, keys_revoked}

The operator is whoever can read the data dir: at every start the service writes a new admin key to
``<data>/admin-key`` (mode 0600) and the lock file names its URL, so ``openrl-service admin`` run on the
same volume (``kubectl exec`` into the pod) needs nothing else. The admin key is good for these routes
only (the auth middleware refuses it anywhere else) and no tenant's key reaches them.

Removing a tenant ends its sessions (runs and samplers leave the device), deletes its jobs (their
Kubernetes Jobs too, and their run-scoped keys stop working), revokes the Tinker keys it minted, and
deletes its folders (checkpoints, session and run records, traces, job folders); journaled, so a
restart does not bring any of it back. A JupyterHub account that was deleted and re-created under the
same name is retired the same way, its files moved to ``<data>/retired/<when>/`` instead (api/hubauth.py).
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, Request

from openrl_service.api import schemas as S
from openrl_service.api.http import ServiceRoute, json_response
from openrl_service.config import TENANT_RE, folder_tenant, tenant_folder
from openrl_service.container import Container
from openrl_service.errors import Forbidden, NotFound
from openrl_service.keydigest import key_digest
from openrl_service.storage.files import write_private

log = logging.getLogger("openrl_service")

ADMIN_KEY_FILE = "admin-key"
ADMIN_PREFIX = "/openrl/v1/admin/"
ADMIN_TENANT = "@admin"  # not a tenant name any key can have: no data can ever belong to it
ADMIN_KEY_PREFIX = "tml-admin-"


def write_admin_key(data_dir: Path) -> str:
    """A new admin key for this run of the service, in ``<data>/admin-key`` (0600 from the start)."""
    key = ADMIN_KEY_PREFIX + secrets.token_urlsafe(32)
    write_private(Path(data_dir) / ADMIN_KEY_FILE, (key + "\n").encode())
    return key


class AdminKey:
    """The one admin credential of this process, kept as a digest and compared in constant time."""

    def __init__(self, key: str):
        self._digest = key_digest(key)

    def matches(self, key: str | None) -> bool:
        return bool(key) and hmac.compare_digest(self._digest, key_digest(key))


class TenantAdmin:
    """What the operator sees of each tenant, and the removal across the engine, jobs and minted keys."""

    def __init__(self, parts: Container, minted: Any):
        self.parts = parts
        self.svc = parts.service
        self.jobs = parts.jobs
        self.minted = minted

    def _folder_tenant(self, folder: Path) -> str | None:
        tenant = folder_tenant(folder.name)
        if tenant is not None:
            return tenant
        for record in sorted((folder / "sessions").glob("*.json"))[:1]:  # a long name's digest folder
            try:
                return json.loads(record.read_text())["tenant"]
            except (OSError, ValueError, KeyError):
                return None
        return None

    def tenants(self) -> list[dict]:
        svc = self.svc
        names = {t for t in map(self._folder_tenant, svc.store.tenant_folders()) if t}
        names |= {s.tenant for s in list(svc.sessions.values())}
        names |= {r["tenant"] for r in list(self.jobs.jobs.values())}
        names |= {
            r["tenant"] for r in list(getattr(self.minted, "_records", {}).values()) if not r.get("revoked")
        }
        rows = []
        for t in sorted(names):
            rows.append(
                {
                    "tenant": t,
                    "folder": tenant_folder(t),
                    "checkpoint_bytes": svc.store.tenant_bytes(t),
                    "live_sessions": sum(
                        1 for s in list(svc.sessions.values()) if s.tenant == t and not s.finished
                    ),
                    "live_runs": sum(1 for r in list(svc.runs.values()) if r.tenant == t),
                    "jobs": sum(1 for r in list(self.jobs.jobs.values()) if r["tenant"] == t),
                    "minted_keys": len(self.minted.list(t)) if self.minted is not None else 0,
                    # device-seconds in the quota's window, since the start, and 429s for the quota
                    **svc.device_time.row(t),
                }
            )
        return rows

    def remove(self, tenant: str, *, move_to: str | None = None, why: str | None = None) -> dict:
        """Remove ``tenant`` everywhere (see the module docstring); NotFound when nothing is known of it.
        ``why``: what its keys' 401s say from then on."""
        why = why or f"tenant {tenant!r} was removed by the service's operator: its keys no longer work"
        if not any(row["tenant"] == tenant for row in self.tenants()) and not self.svc.store.tenant_bytes(
            tenant
        ):
            raise NotFound(
                f"no tenant {tenant!r} on this service (openrl-service admin tenants lists them)",
                field="tenant",
            )
        jobs_deleted = 0
        for rec in [r for r in list(self.jobs.jobs.values()) if r["tenant"] == tenant]:
            k8s = rec.get("k8s") or {}
            kube = self.parts.kube
            if k8s.get("job") and kube is not None:
                try:
                    kube.delete(k8s["job"])
                except Exception:  # noqa: BLE001 - its key is revoked below; the Job's TTL removes it
                    log.warning(
                        "removing %s: deleting Kubernetes Job %s failed", tenant, k8s["job"], exc_info=True
                    )
            self.jobs.delete(tenant, rec["job_id"], why)
            jobs_deleted += 1
        keys_revoked = 0
        if self.minted is not None:  # refused from now on, saying why
            keys_revoked = self.minted.revoke_tenant(tenant, why)
        done = self.svc.remove_tenant(tenant, move_to=move_to)
        return {**done, "jobs_deleted": jobs_deleted, "keys_revoked": keys_revoked}

    def retire(self, tenant: str, reason: str) -> dict:
        """A JupyterHub account deleted and re-created under the same name: the old one's everything
        leaves (its files kept under ``<data>/retired/``), so the new account inherits nothing."""
        folder = self.svc.settings.data_dir / "retired" / time.strftime("%Y%m%dT%H%M%S")
        log.warning("retiring tenant %s: %s; its files go to %s", tenant, reason, folder)
        name = tenant.removeprefix("hub:")
        why = f"it belonged to an earlier JupyterHub account named {name!r} (deleted, then created again)"
        try:
            return self.remove(tenant, move_to=str(folder), why=why)
        except NotFound:
            return {"tenant": tenant, "sessions_ended": 0, "checkpoint_bytes": 0, "moved_to": None}


def build_admin_router(admin: TenantAdmin) -> APIRouter:
    r = APIRouter(
        prefix="/openrl/v1/admin",
        tags=["admin"],
        route_class=ServiceRoute,  # not before recovery: a tenant's sessions may still be in the journal
        generate_unique_id_function=S.operation_ids("admin"),
    )

    def operator(request: Request) -> None:
        if getattr(request.state, "auth_via", None) != "admin":
            raise Forbidden(
                "the admin routes take the service's admin key (<data-dir>/admin-key), not a tenant's key; "
                "run `openrl-service admin` where the data dir is",
                field="X-API-Key",
            )

    @r.get("/tenants")
    async def list_tenants(request: Request):
        """Every tenant with files, sessions, jobs or minted keys here, and what each holds."""
        operator(request)
        return json_response({"tenants": await anyio.to_thread.run_sync(admin.tenants)})

    @r.delete("/tenants/{tenant}")
    async def remove_tenant(tenant: str, request: Request):
        """End the tenant's sessions and delete its checkpoints, records, traces, jobs and minted keys."""
        operator(request)
        return json_response(await anyio.to_thread.run_sync(admin.remove, tenant))

    return r


def valid_tenant_argument(tenant: str) -> bool:
    """What ``openrl-service admin remove`` accepts: an API-key tenant or ``hub:<name>``."""
    try:
        tenant_folder(tenant)
    except ValueError:
        return False
    return bool(TENANT_RE.match(tenant)) or tenant.startswith("hub:")
