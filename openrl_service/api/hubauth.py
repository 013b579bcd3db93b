"""JupyterHub users as tenants: a hub user's own API token, and the Tinker keys they mint with it.

A single-user server on JupyterHub has ``$JUPYTERHUB_API_TOKEN``. Started with ``--hub-api-url``, the
service accepts that token (``X-API-Key``, ``Authorization: Bearer`` or ``Authorization: token``) and
resolves it as jupyterhub's own ``HubAuth`` does: ``GET <hub>/user`` with the token itself, so the
service holds no hub credential. The reply names the user and the token's scopes; the token must carry
``access:services!service=<name>`` (granted by a hub role and by ``Spawner.server_token_scopes``, see
k8s/jupyterhub/values.yaml), and the tenant is ``hub:<username>``. Answers are cached for
``hub_cache_ttl_s`` (keyed by the token's SHA-256), refusals for at most 5 s; an unreachable hub is never
cached and gives 503 naming it, while API keys keep working.

The Tinker SDK only sends keys that start with ``tml-``, so a hub user mints one
(``POST /api/v1/keys``, authenticated by the hub token): it authenticates as the same ``hub:<name>``
tenant, is listed and revocable, and is stored as a SHA-256 digest only in ``<data>/minted-keys.json``
(mode 0600), so it survives restarts.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import httpx

from openrl_service.config import HUB_TENANT_PREFIX, hub_tenant

log = logging.getLogger("openrl_service")

CACHE_SIZE = 10_000  # tokens remembered (positive and negative answers together)
NEGATIVE_TTL_S = 5.0  # a refused token is asked about again after this
HUB_TIMEOUT_S = 5.0


class HubUnavailable(Exception):
    """The hub could not answer (unreachable, timed out, or a 5xx)."""


@dataclass(frozen=True)
class HubIdentity:
    """Who a credential names: the tenant, and how it was shown (``hub`` token or ``minted`` key)."""

    tenant: str
    via: str
    user: str | None = None


@dataclass(frozen=True)
class Refusal:
    """A token the hub answered for, but that may not use this service (401 with this message)."""

    message: str


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


def has_access(scopes: list[str], service: str) -> bool:
    """Whether the token's expanded scopes grant access to the hub service ``service``: the
    unfiltered ``access:services`` or the one filtered to this service."""
    return "access:services" in scopes or f"access:services!service={service}" in scopes


class HubAuth:
    """Resolves hub tokens through ``GET <api_url>/user``; answers cached per token digest."""

    def __init__(self, api_url: str, service_name: str, ttl_s: float):
        self.api_url = api_url.rstrip("/")
        self.service_name = service_name
        self.ttl_s = max(0.0, float(ttl_s))
        self.scope = f"access:services!service={service_name}"
        self._cache: OrderedDict[str, tuple[float, HubIdentity | Refusal]] = OrderedDict()
        self._client: httpx.AsyncClient | None = None
        self._inflight: dict[str, asyncio.Future] = {}

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=HUB_TIMEOUT_S, trust_env=False)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def resolve(self, token: str) -> HubIdentity | Refusal:
        """The identity ``token`` names at the hub, or a :class:`Refusal`; raises HubUnavailable."""
        digest = _sha(token)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            self._cache.move_to_end(digest)
            return hit[1]
        # Concurrent requests with the same new token ask the hub once.
        pending = self._inflight.get(digest)
        if pending is not None:
            return await asyncio.shield(pending)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[digest] = fut
        try:
            answer = await self._ask(token)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            self._inflight.pop(digest, None)
        fut.set_result(answer)
        ttl = self.ttl_s if isinstance(answer, HubIdentity) else min(self.ttl_s, NEGATIVE_TTL_S)
        if ttl > 0:
            self._cache[digest] = (time.monotonic() + ttl, answer)
            self._cache.move_to_end(digest)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return answer

    async def _ask(self, token: str) -> HubIdentity | Refusal:
        url = f"{self.api_url}/user"
        try:
            r = await self._http().get(url, headers={"Authorization": f"token {token}"})
        except httpx.HTTPError as e:
            raise HubUnavailable(
                f"JupyterHub API at {self.api_url} is unreachable ({type(e).__name__})"
            ) from None
        if r.status_code in (401, 403, 404):
            return Refusal("wrong API key or JupyterHub token (the hub does not know this token)")
        if r.status_code != 200:
            raise HubUnavailable(f"JupyterHub API at {self.api_url} answered {r.status_code}")
        try:
            model = r.json()
            name = model["name"]
            scopes = list(model.get("scopes") or [])
            kind = model.get("kind", "user")
        except (ValueError, KeyError, TypeError):
            raise HubUnavailable(f"JupyterHub API at {self.api_url} gave an unreadable answer") from None
        if kind != "user" or not isinstance(name, str) or not name:
            return Refusal("this JupyterHub token belongs to a service, not a user")
        if not has_access(scopes, self.service_name):
            return Refusal(
                f"JupyterHub token of user {name!r} lacks the scope {self.scope} "
                "(grant it through a hub role and Spawner.server_token_scopes)"
            )
        return HubIdentity(hub_tenant(name), "hub", name)


class MintedKeys:
    """Tinker keys (``tml-…``) minted by hub users: digests only, on disk, listed and revocable."""

    def __init__(self, path: Path, max_per_tenant: int):
        self.path = Path(path)
        self.max_per_tenant = max_per_tenant
        self._lock = threading.Lock()
        self._records: dict[str, dict] = {}  # id -> {id, digest, tenant, name, created, prefix}
        if self.path.is_file():
            for rec in json.loads(self.path.read_text() or "[]"):
                self._records[rec["id"]] = rec

    def tenant(self, key: str | None) -> str | None:
        if not key or not key.startswith("tml-"):
            return None
        d = _sha(key)
        found = None
        for rec in list(self._records.values()):
            if hmac.compare_digest(rec["digest"], d):
                found = rec["tenant"]
        return found

    def mint(self, tenant: str, name: str | None) -> tuple[dict, str]:
        if not tenant.startswith(HUB_TENANT_PREFIX):
            raise ValueError("only JupyterHub users mint keys")
        key = "tml-" + secrets.token_urlsafe(32)
        rec = {
            "id": secrets.token_hex(8),
            "digest": _sha(key),
            "tenant": tenant,
            "name": name,
            "created": round(time.time(), 3),
            "prefix": key[:8],
        }
        with self._lock:
            mine = [r for r in self._records.values() if r["tenant"] == tenant]
            if len(mine) >= self.max_per_tenant:
                raise OverflowError(
                    f"{tenant} already has {len(mine)} keys, the most allowed (OPENRL_MAX_KEYS_PER_USER="
                    f"{self.max_per_tenant}); revoke one first"
                )
            self._records[rec["id"]] = rec
            self._save()
        return public(rec), key

    def list(self, tenant: str) -> list[dict]:
        return sorted(
            (public(r) for r in list(self._records.values()) if r["tenant"] == tenant),
            key=lambda r: r["created"],
        )

    def revoke(self, tenant: str, key_id: str) -> bool:
        with self._lock:
            rec = self._records.get(key_id)
            if rec is None or rec["tenant"] != tenant:
                return False
            del self._records[key_id]
            self._save()
        return True

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(list(self._records.values()), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def public(rec: dict) -> dict:
    """A minted key's record as the API shows it: never the digest, never the key."""
    return {k: rec[k] for k in ("id", "tenant", "name", "created", "prefix")}
