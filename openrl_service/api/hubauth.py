"""JupyterHub users as tenants: a hub user's own API token, and the Tinker keys they mint with it.

A single-user server on JupyterHub has ``$JUPYTERHUB_API_TOKEN``. Started with ``--hub-api-url``, the
service accepts that token (``X-API-Key``, ``Authorization: Bearer`` or ``Authorization: token``) and
resolves it as jupyterhub's own ``HubAuth`` does: ``GET <hub>/user`` with the token itself, so the
service holds no hub credential. The reply names the user and the token's scopes; the token must carry
``access:services!service=<name>`` (granted by a hub role and by ``Spawner.server_token_scopes``, see
k8s/jupyterhub/values.yaml), and the tenant is ``hub:<username>``. Answers are cached for
``hub_cache_ttl_s`` (keyed by the token's SHA-256); an unreachable hub is never cached and gives 503
naming it, while API keys keep working.

A flood of made-up tokens must not cost the hub, nor the users, anything: refusals are cached apart
from identities (at most 5 s, at most ``REFUSED_CACHE_SIZE`` of them), so no number of them evicts a
valid identity; failed lookups are counted per client address, and past
``OPENRL_HUB_FAILED_LOOKUPS_PER_MIN`` in the last minute that address gets 429 + Retry-After for any
token not already known, without the hub being asked (lookups under way count too, so a concurrent
flood is held to the same number). A token the hub once said is valid is never throttled: its
answer is refreshed from the hub when it expires, whatever its address did.

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
import math
import os
import secrets
import tempfile
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import httpx

from openrl_service.config import HUB_TENANT_PREFIX, hub_tenant

log = logging.getLogger("openrl_service")

CACHE_SIZE = 10_000  # valid identities remembered (refusals never enter this cache)
REFUSED_CACHE_SIZE = 10_000  # refused tokens remembered, apart from the identities
NEGATIVE_TTL_S = 5.0  # a refused token is asked about again after this
FAILURE_WINDOW_S = 60.0  # failed lookups of an address count for this long
MAX_SOURCES = 10_000  # addresses whose failed lookups are remembered (the least recent go first)
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


@dataclass(frozen=True)
class Throttled:
    """Too many failed lookups from this address: 429 with this message and Retry-After, hub not asked."""

    message: str
    retry_after_s: int


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


def has_access(scopes: list[str], service: str) -> bool:
    """Whether the token's expanded scopes grant access to the hub service ``service``: the
    unfiltered ``access:services`` or the one filtered to this service."""
    return "access:services" in scopes or f"access:services!service={service}" in scopes


class FailedLookups:
    """Failed hub lookups per client address over the last ``window_s``, plus the lookups under way
    (each may fail): past ``limit`` the address waits. Memory is bounded: ``limit`` stamps an
    address, ``MAX_SOURCES`` addresses."""

    def __init__(self, limit: int, window_s: float = FAILURE_WINDOW_S, max_sources: int = MAX_SOURCES):
        self.limit = max(1, int(limit))
        self.window_s = window_s
        self.max_sources = max_sources
        self._failed: OrderedDict[str, deque[float]] = OrderedDict()
        self._pending: dict[str, int] = {}

    def wait_s(self, source: str, now: float) -> float | None:
        """Seconds ``source`` must wait before its next lookup, or None when it may look up now."""
        stamps = self._failed.get(source)
        while stamps and stamps[0] <= now - self.window_s:
            stamps.popleft()
        used = len(stamps or ()) + self._pending.get(source, 0)
        if used < self.limit:
            return None
        return max(1.0, stamps[0] + self.window_s - now) if stamps else 1.0

    def begin(self, source: str) -> None:
        self._pending[source] = self._pending.get(source, 0) + 1

    def end(self, source: str, *, failed: bool, now: float) -> None:
        left = self._pending.get(source, 1) - 1
        if left > 0:
            self._pending[source] = left
        else:
            self._pending.pop(source, None)
        if failed:
            stamps = self._failed.get(source)
            if stamps is None:
                stamps = self._failed[source] = deque(maxlen=self.limit)
            stamps.append(now)
            self._failed.move_to_end(source)
            while len(self._failed) > self.max_sources:
                self._failed.popitem(last=False)


class HubAuth:
    """Resolves hub tokens through ``GET <api_url>/user``: identities and refusals cached apart, per
    token digest; failed lookups limited per client address (see the module docstring)."""

    def __init__(self, api_url: str, service_name: str, ttl_s: float, *, failed_lookups_per_min: int = 30):
        self.api_url = api_url.rstrip("/")
        self.service_name = service_name
        self.ttl_s = max(0.0, float(ttl_s))
        self.scope = f"access:services!service={service_name}"
        # digest -> (fresh until, identity); an entry past its time still says "known valid"
        self._valid: OrderedDict[str, tuple[float, HubIdentity]] = OrderedDict()
        self._refused: OrderedDict[str, tuple[float, Refusal]] = OrderedDict()
        self.failures = FailedLookups(failed_lookups_per_min)
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

    async def resolve(self, token: str, source: str | None = None) -> HubIdentity | Refusal | Throttled:
        """The identity ``token`` names at the hub, a :class:`Refusal`, or :class:`Throttled` when
        ``source`` (the client address; None: not limited) failed too often; raises HubUnavailable."""
        digest = _sha(token)
        now = time.monotonic()
        known = self._valid.get(digest)
        if known is not None:
            self._valid.move_to_end(digest)
            if known[0] > now:
                return known[1]
        else:
            refused = self._refused.get(digest)
            if refused is not None and refused[0] > now:
                return refused[1]
            wait = self.failures.wait_s(source, now) if source is not None else None
            if wait is not None:
                limit = self.failures.limit
                return Throttled(
                    f"too many failed JupyterHub token lookups from {source}: {limit} in the last minute "
                    f"(OPENRL_HUB_FAILED_LOOKUPS_PER_MIN={limit}); tokens already known to be valid still "
                    f"work; retry in {math.ceil(wait)} s",
                    math.ceil(wait),
                )
        # Concurrent requests with the same new token ask the hub once.
        pending = self._inflight.get(digest)
        if pending is not None:
            return await asyncio.shield(pending)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[digest] = fut
        counted = source is not None and known is None
        if counted:
            self.failures.begin(source)
        answer = None
        try:
            answer = await self._ask(token)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            self._inflight.pop(digest, None)
            if counted:
                self.failures.end(source, failed=isinstance(answer, Refusal), now=time.monotonic())
        fut.set_result(answer)
        self._remember(digest, answer)
        return answer

    def _remember(self, digest: str, answer: HubIdentity | Refusal) -> None:
        now = time.monotonic()
        if isinstance(answer, HubIdentity):
            self._refused.pop(digest, None)
            self._valid[digest] = (now + self.ttl_s, answer)
            self._valid.move_to_end(digest)
            while len(self._valid) > CACHE_SIZE:
                self._valid.popitem(last=False)
            return
        self._valid.pop(digest, None)  # a token revoked at the hub is no longer known valid
        ttl = min(self.ttl_s, NEGATIVE_TTL_S)
        if ttl > 0:
            self._refused[digest] = (now + ttl, answer)
            self._refused.move_to_end(digest)
            while len(self._refused) > REFUSED_CACHE_SIZE:
                self._refused.popitem(last=False)

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
