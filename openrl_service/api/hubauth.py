"""JupyterHub users as tenants: a hub user's own API token, and the Tinker keys they mint with it.

A single-user server on JupyterHub has ``$JUPYTERHUB_API_TOKEN``. Started with ``--hub-api-url``, the
service accepts that token (``X-API-Key``, ``Authorization: Bearer`` or ``Authorization: token``) and
resolves it as jupyterhub's own ``HubAuth`` does: ``GET <hub>/user`` with the token itself (the
service's own hub token, below, is for checking accounts, not tokens). The reply names the user and the token's scopes; the token must carry
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
(mode 0600), so it survives restarts. It expires ``OPENRL_MINTED_KEY_TTL_S`` after it was minted.

A key lives no longer than the hub account it was minted for. An identity is the user's name *and*
the account's ``created`` time: with a hub token of its own (``$JUPYTERHUB_API_TOKEN``, read only with
``--hub-api-url``; scope ``read:users``) the service asks ``GET <hub>/users/<name>`` (:class:`HubUsers`,
cached at most ``OPENRL_HUB_USER_RECHECK_S``) whether the user still exists with the ``created`` the
key recorded at mint. A deleted user's minted keys, the keys of their detached jobs and their hub
tokens are refused within that bound (the data stays until an admin removes it); a key of an account
deleted and created again under the same name is refused, and so is a job submitted before the new
account was first seen. :class:`HubAccounts` keeps the accounts it has seen in
``<data>/hub-identities.json`` (name -> created, mode 0600): when a name comes back with another
``created``, the old tenant is retired (``retire_tenant``, see app.py) before the new account's
request goes on. Without a service token, keys rely on their expiry alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import quote

import httpx

from openrl_service.config import HUB_TENANT_PREFIX, hub_tenant
from openrl_service.keydigest import key_digest
from openrl_service.storage.files import write_private

log = logging.getLogger("openrl_service")

CACHE_SIZE = 10_000  # valid identities remembered (refusals never enter this cache)
REFUSED_CACHE_SIZE = 10_000  # refused tokens remembered, apart from the identities
NEGATIVE_TTL_S = 5.0  # a refused token is asked about again after this
FAILURE_WINDOW_S = 60.0  # failed lookups of an address count for this long
MAX_SOURCES = 10_000  # addresses whose failed lookups are remembered (the least recent go first)
HUB_TIMEOUT_S = 5.0
USERS_CACHE_SIZE = 100_000  # hub accounts whose state is remembered (only names of real keys and users)
EXPIRED_KEPT_S = 7 * 86400  # an expired or retired key's record is kept this long, to say why it fails


class HubUnavailable(Exception):
    """The hub could not answer (unreachable, timed out, or a 5xx)."""


@dataclass(frozen=True)
class HubIdentity:
    """Who a credential names: the tenant, and how it was shown (``hub`` token or ``minted`` key)."""

    tenant: str
    via: str
    user: str | None = None
    created: str | None = None  # the account's creation time, once known (an identity is name + created)


@dataclass(frozen=True)
class HubUser:
    """A hub account as the hub reports it now: its name and when it was created."""

    name: str
    created: str | None


@dataclass(frozen=True)
class Refusal:
    """A token the hub answered for, but that may not use this service (401 with this message)."""

    message: str


@dataclass(frozen=True)
class Throttled:
    """Too many failed lookups from this address: 429 with this message and Retry-After, hub not asked."""

    message: str
    retry_after_s: int


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
        digest = key_digest(token)
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

    def bind(self, token: str, created: str) -> None:
        """Remember the account ``token`` was found valid for (its ``created``): once that account is
        gone, a token of it that is still cached cannot pass for a new account of the same name."""
        digest = key_digest(token)
        hit = self._valid.get(digest)
        if hit is not None and hit[1].created is None:
            self._valid[digest] = (hit[0], replace(hit[1], created=created))

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
        created = model.get("created")  # present only when the token may read its own user model
        return HubIdentity(hub_tenant(name), "hub", name, created if isinstance(created, str) else None)


def user_of(tenant: str) -> str | None:
    """The hub user name of a ``hub:<name>`` tenant, else None."""
    return tenant[len(HUB_TENANT_PREFIX) :] if tenant.startswith(HUB_TENANT_PREFIX) else None


def lifetime(seconds: float) -> str:
    """``30 days``, ``12 hours``, ``3 s``: a key's lifetime as its expiry message says it."""
    for unit, size in (("day", 86400), ("hour", 3600)):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return f"{seconds:g} s"


def write_json_private(path: Path, value) -> None:
    """``value`` as JSON in ``path`` (0600, atomic: storage/files.py)."""
    write_private(path, json.dumps(value).encode())


class MintedKeys:
    """Tinker keys (``tml-…``) minted by hub users: digests only, on disk, listed and revocable.

    A record: ``id, digest, tenant, name, created`` (mint time, epoch s), ``prefix``, ``hub_user`` and
    ``hub_created`` (the account it was minted for), and ``revoked`` (why, once its account was
    retired). Expired and retired records are kept ``EXPIRED_KEPT_S`` to say why a key fails."""

    def __init__(self, path: Path, max_per_tenant: int, ttl_s: float = 30 * 86400):
        self.path = Path(path)
        self.max_per_tenant = max_per_tenant
        self.ttl_s = float(ttl_s)
        self._lock = threading.Lock()
        self._records: dict[str, dict] = {}  # id -> record
        self._by_digest: dict[str, str] = {}  # SHA-256 of a key -> id
        if self.path.is_file():
            for rec in json.loads(self.path.read_text() or "[]"):
                self._records[rec["id"]] = rec
                self._by_digest[rec["digest"]] = rec["id"]

    def find(self, key: str | None) -> dict | None:
        """The record of a minted key (expired or retired ones included), or None."""
        if not key or not key.startswith("tml-"):
            return None
        # A dict lookup by the key's SHA-256: timing tells at most how a digest begins, which says
        # nothing about any key.
        key_id = self._by_digest.get(key_digest(key))
        rec = self._records.get(key_id) if key_id is not None else None
        return dict(rec) if rec is not None else None

    def expires(self, rec: dict) -> float:
        return rec["created"] + self.ttl_s

    def refusal(self, rec: dict, now: float | None = None) -> str | None:
        """Why the key of ``rec`` no longer works on its own (retired, expired), or None."""
        if rec.get("revoked"):
            return rec["revoked"]
        if self.expires(rec) <= (time.time() if now is None else now):
            return (
                f"key expired after {lifetime(self.ttl_s)} (OPENRL_MINTED_KEY_TTL_S); "
                "mint a new one with %openrl token"
            )
        return None

    def tenant(self, key: str | None) -> str | None:
        """The tenant of a key that works on its own (known, not expired, not retired), or None."""
        rec = self.find(key)
        return rec["tenant"] if rec is not None and self.refusal(rec) is None else None

    def mint(
        self, tenant: str, name: str | None, hub_user: str | None = None, hub_created: str | None = None
    ) -> tuple[dict, str]:
        if not tenant.startswith(HUB_TENANT_PREFIX):
            raise ValueError("only JupyterHub users mint keys")
        key = "tml-" + secrets.token_urlsafe(32)
        rec = {
            "id": secrets.token_hex(8),
            "digest": key_digest(key),
            "tenant": tenant,
            "name": name,
            "created": round(time.time(), 3),
            "prefix": key[:8],
            "hub_user": hub_user or user_of(tenant),
            "hub_created": hub_created,
        }
        with self._lock:
            mine = [r for r in self._records.values() if r["tenant"] == tenant and self.refusal(r) is None]
            if len(mine) >= self.max_per_tenant:
                raise OverflowError(
                    f"{tenant} already has {len(mine)} keys, the most allowed (OPENRL_MAX_KEYS_PER_USER="
                    f"{self.max_per_tenant}); revoke one first"
                )
            self._records[rec["id"]] = rec
            self._by_digest[rec["digest"]] = rec["id"]
            self._save()
        return self.public(rec), key

    def list(self, tenant: str) -> list[dict]:
        """A tenant's keys that still work (not expired, not retired)."""
        return sorted(
            (
                self.public(r)
                for r in list(self._records.values())
                if r["tenant"] == tenant and self.refusal(r) is None
            ),
            key=lambda r: r["created"],
        )

    def revoke(self, tenant: str, key_id: str) -> bool:
        with self._lock:
            rec = self._records.get(key_id)
            if rec is None or rec["tenant"] != tenant or rec.get("revoked"):
                return False
            del self._records[key_id]
            self._by_digest.pop(rec["digest"], None)
            self._save()
        return True

    def revoke_tenant(self, tenant: str, why: str) -> int:
        """Refuse every key of ``tenant`` from now on, saying ``why``; how many were still working."""
        with self._lock:
            hit = [r for r in self._records.values() if r["tenant"] == tenant and not r.get("revoked")]
            for rec in hit:
                rec["revoked"] = why
            if hit:
                self._save()
        return len(hit)

    def bind(self, key_id: str, hub_created: str) -> None:
        """Bind a key minted before keys recorded their account (no ``hub_created``) to ``hub_created``."""
        with self._lock:
            rec = self._records.get(key_id)
            if rec is not None and not rec.get("hub_created"):
                rec["hub_created"] = hub_created
                self._save()

    def public(self, rec: dict) -> dict:
        """A minted key's record as the API shows it: never the digest, never the key."""
        return {**public(rec), "expires": round(self.expires(rec), 3)}

    def _save(self) -> None:
        horizon = time.time() - self.ttl_s - EXPIRED_KEPT_S
        for key_id in [i for i, r in self._records.items() if r["created"] < horizon]:
            self._by_digest.pop(self._records.pop(key_id)["digest"], None)
        write_json_private(self.path, list(self._records.values()))


def public(rec: dict) -> dict:
    """A minted key's record as the API shows it: never the digest, never the key."""
    return {k: rec[k] for k in ("id", "tenant", "name", "created", "prefix")}


class HubUsers:
    """The service's own view of hub accounts: ``GET <api_url>/users/<name>`` with the service's hub
    token (scope ``read:users``), each answer (an account, or none) reused for ``recheck_s``.

    Before its first lookup it asks ``GET <api_url>/user`` who the token is: a token the hub refuses,
    or one without ``read:users`` (for which the hub answers 404 for every user, as for a deleted
    one), makes every lookup a HubUnavailable naming the fix (503), never a false "no longer exists"."""

    def __init__(self, api_url: str, token: str, recheck_s: float):
        self.api_url = api_url.rstrip("/")
        self._token = token
        self.recheck_s = max(0.0, float(recheck_s))
        self._cache: OrderedDict[str, tuple[float, HubUser | None]] = OrderedDict()
        self._inflight: dict[str, asyncio.Future] = {}
        self._verified = False
        self._misconfigured: tuple[float, str] | None = None  # (until, message)
        self._client: httpx.AsyncClient | None = None

    def __repr__(self) -> str:  # never the token
        return f"<HubUsers {self.api_url} recheck {self.recheck_s:g} s>"

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=HUB_TIMEOUT_S, trust_env=False, headers={"Authorization": f"token {self._token}"}
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _get(self, path: str) -> httpx.Response:
        try:
            r = await self._http().get(f"{self.api_url}{path}")
        except httpx.HTTPError as e:
            raise HubUnavailable(
                f"JupyterHub API at {self.api_url} is unreachable ({type(e).__name__})"
            ) from None
        if r.status_code >= 500:
            raise HubUnavailable(f"JupyterHub API at {self.api_url} answered {r.status_code}")
        return r

    async def verify(self) -> None:
        """That the token is the hub's and may read users; raises HubUnavailable saying what is wrong."""
        if self._verified:
            return
        now = time.monotonic()
        if self._misconfigured is not None and self._misconfigured[0] > now:
            raise HubUnavailable(self._misconfigured[1])
        r = await self._get("/user")
        problem = None
        if r.status_code in (401, 403):
            problem = "the hub does not accept the service's own token ($JUPYTERHUB_API_TOKEN)"
        elif r.status_code != 200:
            problem = f"the hub answered {r.status_code} when asked who the service's token is"
        else:
            try:
                scopes = list(r.json().get("scopes") or [])
            except (ValueError, AttributeError, TypeError):
                scopes = []
            if "read:users" not in scopes:
                problem = (
                    "the service's own hub token ($JUPYTERHUB_API_TOKEN) lacks the scope read:users "
                    "(grant it to the openrl hub service in a role: k8s/jupyterhub/values.yaml)"
                )
        if problem is not None:
            message = f"{problem}; keys of JupyterHub users cannot be checked at {self.api_url}"
            if self._misconfigured is None or self._misconfigured[1] != message:
                log.error("%s", message)
            self._misconfigured = (now + max(5.0, self.recheck_s), message)
            raise HubUnavailable(message)
        self._verified, self._misconfigured = True, None
        log.info("the service's hub token may read users at %s", self.api_url)

    async def lookup(self, name: str, *, fresh: bool = False) -> HubUser | None:
        """The account ``name`` as the hub has it (None: no such user), reused for ``recheck_s``
        unless ``fresh``; raises HubUnavailable."""
        now = time.monotonic()
        hit = self._cache.get(name)
        if hit is not None and hit[0] > now and not fresh:
            return hit[1]
        pending = self._inflight.get(name)
        if pending is not None:
            return await asyncio.shield(pending)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[name] = fut
        try:
            answer = await self._ask(name)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()
            raise
        finally:
            self._inflight.pop(name, None)
        fut.set_result(answer)
        self._cache[name] = (time.monotonic() + self.recheck_s, answer)
        self._cache.move_to_end(name)
        while len(self._cache) > USERS_CACHE_SIZE:
            self._cache.popitem(last=False)
        return answer

    async def _ask(self, name: str) -> HubUser | None:
        await self.verify()
        r = await self._get(f"/users/{quote(name, safe='')}")
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            self._verified = False  # the token changed under us: say so on the next lookup
            raise HubUnavailable(f"JupyterHub API at {self.api_url} answered {r.status_code} for a user")
        try:
            model = r.json()
            created = model.get("created")
        except (ValueError, AttributeError):
            raise HubUnavailable(f"JupyterHub API at {self.api_url} gave an unreadable answer") from None
        return HubUser(name, created if isinstance(created, str) else None)


class KnownIdentities:
    """``<data>/hub-identities.json``: the hub accounts this service has seen, ``{name: {"created",
    "since"}}`` (mode 0600, replaced atomically). ``since`` (epoch s) is when this account was first
    seen after an earlier one of the same name; 0 for the first account of a name."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._names: dict[str, dict] = (
            json.loads(self.path.read_text() or "{}") if self.path.is_file() else {}
        )

    def get(self, name: str) -> dict | None:
        entry = self._names.get(name)
        return dict(entry) if entry is not None else None

    def record(self, name: str, created: str, since: float) -> None:
        with self._lock:
            self._names[name] = {"created": created, "since": since}
            write_json_private(self.path, self._names)


RetireTenant = Callable[[str, str], None]  # (tenant, reason); see app.py's retire_tenant


class HubAccounts:
    """Binds credentials to hub accounts (name + ``created``): whether a hub user's token, minted key
    or job key may go on, and the retirement of a tenant whose account was created again.

    ``users`` is None without a service token: then only what a hub token's own model says is known
    (keys rely on their expiry). ``retire`` runs on a worker thread, before the request goes on."""

    def __init__(
        self,
        users: HubUsers | None,
        known: KnownIdentities,
        retire: RetireTenant,
        minted: MintedKeys | None = None,
    ):
        self.users = users
        self.known = known
        self.retire = retire
        self.minted = minted
        self._lock = asyncio.Lock()

    async def admit(self, identity: HubIdentity) -> HubUser | Refusal:
        """A hub token's user, checked: the account it belongs to (None ``created`` when unknown)."""
        name = identity.user or ""
        created = identity.created
        if self.users is not None:
            # A token not yet tied to an account may be a new account's: ask the hub now, not a
            # cached answer that may still describe a deleted account of the same name.
            user = await self.users.lookup(name, fresh=identity.created is None)
            if created is not None and (user is None or user.created != created):
                user = await self.users.lookup(name, fresh=True)  # the token's answer is newer
            if user is None:
                return Refusal(f"the JupyterHub user {name!r} no longer exists")
            if created is not None and user.created is not None and created != user.created:
                return Refusal(
                    f"the JupyterHub user {name!r} was deleted and created again: "
                    "this token belonged to the earlier account"
                )
            created = user.created or created
        if created is not None:
            await self.observe(name, created)
        return HubUser(name, created)

    async def check_minted(self, rec: dict) -> Refusal | None:
        """Whether a minted key's account still exists as the one it was minted for."""
        name = rec.get("hub_user") or user_of(rec["tenant"]) or ""
        if self.users is None:
            return None
        user = await self.users.lookup(name)
        if user is None:
            return Refusal(
                f"the JupyterHub user {name!r} no longer exists: keys minted for that account stopped working"
            )
        if user.created is None:
            return None
        await self.observe(name, user.created)
        bound = rec.get("hub_created")
        if bound is None:  # minted before keys recorded their account: bound to the one seen now
            if self.minted is not None:
                await asyncio.to_thread(self.minted.bind, rec["id"], user.created)
            return None
        if bound != user.created:
            return Refusal(recreated_message(name))
        return None

    async def check_job(self, tenant: str, job_created: float) -> Refusal | None:
        """Whether a job's key may go on: its hub user exists, and submitted it as this account."""
        name = user_of(tenant)
        if name is None or self.users is None:
            return None
        user = await self.users.lookup(name)
        if user is None:
            return Refusal(
                f"the JupyterHub user {name!r} no longer exists: the keys of that account's jobs "
                "stopped working"
            )
        if user.created is None:
            return None
        await self.observe(name, user.created)
        known = self.known.get(name)
        if known is not None and job_created < known["since"]:
            return Refusal(
                f"this job was submitted by an earlier JupyterHub account named {name!r} (deleted and "
                "created again): its key stopped working"
            )
        return None

    async def observe(self, name: str, created: str) -> None:
        """Record the account ``name`` was seen as; when it had another ``created`` before, retire the
        old tenant first. Raises HubUnavailable when the retirement fails (503: asked again later)."""
        known = self.known.get(name)
        if known is not None and known["created"] == created:
            return
        async with self._lock:
            known = self.known.get(name)
            if known is not None and known["created"] == created:
                return
            if known is None:
                await asyncio.to_thread(self.known.record, name, created, 0.0)
                return
            tenant = hub_tenant(name)
            reason = f"the JupyterHub user {name!r} was deleted and created again"
            try:
                await asyncio.to_thread(self.retire, tenant, reason)
            except Exception as e:
                log.exception("retiring tenant %r failed", tenant)
                raise HubUnavailable(
                    f"retiring the tenant of the earlier JupyterHub account {name!r} failed "
                    f"({type(e).__name__}); asked again on the next request"
                ) from None
            # Jobs submitted before now belong to the earlier account (a millisecond's margin: job
            # records keep times to the millisecond).
            since = math.floor(time.time() * 1000) / 1000 - 0.001
            await asyncio.to_thread(self.known.record, name, created, since)
            log.warning(
                "retired tenant %r: %s (created %s, now %s)", tenant, reason, known["created"], created
            )


def recreated_message(name: str) -> str:
    return (
        f"the JupyterHub user {name!r} was deleted and created again: keys minted for the earlier "
        "account stopped working; mint a new one with %openrl token"
    )
