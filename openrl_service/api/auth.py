"""API keys → tenants, Host/Origin checks and the body-size limit, as one ASGI middleware.

Every route except the health checks needs a key (``X-API-Key: tml-…`` as the Tinker SDK sends
it, or ``Authorization: Bearer tml-…``): a configured API key, a key a JupyterHub user minted, or, with
``--hub-api-url``, a hub user's own API token (api/hubauth.py); on ``/metrics`` the key is optional: a scrape without one
gets aggregates only (no tenant's identifiers), one with a valid key also that tenant's series. Keys
are kept only as SHA-256 digests and compared in constant time. Requests naming a foreign Host
(DNS rebinding) or a foreign Origin (a web page posting to a loopback service) are refused, except
on the health checks and ``/metrics`` (probes and scrapes name the pod IP); the service sends no
CORS headers at all.
"""

from __future__ import annotations

import functools
import hmac
import logging
import secrets
from pathlib import Path
from urllib.parse import urlsplit

import orjson

from openrl_common.files import write_atomic
from openrl_service.api.admin import ADMIN_KEY_PREFIX, ADMIN_PREFIX, ADMIN_TENANT, AdminKey
from openrl_service.api.hubauth import (
    HubAccounts,
    HubAuth,
    HubUnavailable,
    MintedKeys,
    Refusal,
    Throttled,
)
from openrl_service.api.openai import error_payload, is_openai_path
from openrl_service.config import LOOPBACK_HOSTS, Settings
from openrl_service.engine.jobs import JOB_KEY_PREFIX, JobRefusal, Jobs
from openrl_service.keydigest import key_digest

log = logging.getLogger("openrl_service")

PUBLIC_PATHS = {"/healthz", "/readyz", "/api/v1/healthz"}
SIGNED_PREFIX = "/api/v1/downloads/"
UPLOAD_PREFIX = "/api/v1/uploads/"  # signed upload URLs (engine/uploads.py): their own bound per file
METRICS_PATH = "/metrics"  # key optional: an anonymous scrape sets no tenant
DEFAULT_TENANT = "default"


class KeyRing:
    def __init__(self, keys: dict[str, str]):
        self._by_digest = {key_digest(k): t for k, t in keys.items()}

    def tenant(self, key: str | None) -> str | None:
        if not key:
            return None
        d = key_digest(key)
        found = None
        for known, tenant in self._by_digest.items():
            if hmac.compare_digest(known, d):
                found = tenant
        return found

    def __len__(self) -> int:
        return len(self._by_digest)


def ensure_generated_key(data_dir: Path) -> tuple[str, Path, bool]:
    """The key `serve` creates when none is configured: ``<data>/api-key``, mode 0600, reused later.
    Returns (key, its file, whether it was created just now)."""
    path = Path(data_dir) / "api-key"
    if path.is_file():
        key = path.read_text().strip()
        if key.startswith("tml-"):
            return key, path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    key = "tml-" + secrets.token_urlsafe(32)
    # A new file (mode 0600 from the start) renamed over the old name: a crash leaves the old file or
    # the whole new key, never an empty one, and a second name for the old file is not written through.
    write_atomic(path, key + "\n", mode=0o600)
    return key, path, True


class RedactDownloadTokens(logging.Filter):
    """Keeps signed download tokens out of the access log: a token alone authorises its download, so
    whoever reads the log could fetch the file. The log line keeps the route."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_redact(a) if isinstance(a, str) else a for a in record.args)
        return True


def _redact(text: str) -> str:
    for prefix in (SIGNED_PREFIX, UPLOAD_PREFIX):
        at = text.find(prefix)
        if at >= 0:
            return text[: at + len(prefix)] + "<token>"
    return text


def redact_access_log() -> None:
    """Install :class:`RedactDownloadTokens` on uvicorn's access logger (once)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactDownloadTokens) for f in access.filters):
        access.addFilter(RedactDownloadTokens())


def allowed_hosts(settings: Settings) -> set[str] | None:
    """Host names a request may name; None means any (a non-loopback bind without a list)."""
    hosts = {h.lower() for h in settings.allowed_hosts}
    if "*" in hosts:
        return None
    if settings.loopback:
        return hosts | {h.strip("[]") for h in LOOPBACK_HOSTS}
    if settings.host in ("0.0.0.0", "::", ""):
        return hosts or None
    return hosts | {settings.host.lower()} | {h.strip("[]") for h in LOOPBACK_HOSTS}


def _host_only(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class _TooLarge(Exception):
    pass


def credential(headers: dict[str, str]) -> str | None:
    """The key or token a request shows: ``X-API-Key``, else ``Authorization: Bearer|token <it>``."""
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    scheme, _, value = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() in ("bearer", "token") and value.strip():
        return value.strip()
    return None


def unauthorised(headers: dict[str, str], kind: str = "API key") -> str:
    """Why a request's credential is refused, from what it sent (never echoing it): none at all, an
    Authorization header of another form, or a key this service does not have."""
    how = "send it as X-API-Key: <key> or Authorization: Bearer <key>"
    if headers.get("x-api-key", "").strip():
        sent = "the X-API-Key header"
    elif headers.get("authorization", "").strip():
        scheme, _, value = headers["authorization"].strip().partition(" ")
        if scheme.lower() not in ("bearer", "token"):
            return (
                f"missing {kind}: the Authorization header is not 'Bearer <key>' (its scheme is "
                f"{scheme[:20]!r}); {how}"
            )
        if not value.strip():
            return f"missing {kind}: the Authorization header names no key after {scheme[:20]!r}; {how}"
        sent = f"the Authorization: {scheme[:20]} header"
    else:
        return f"missing {kind}: {how}"
    key = credential(headers) or ""
    shape = f"a {'tml- key' if key.startswith('tml-') else 'value'} of {len(key)} characters"
    return (
        f"wrong {kind}: {sent} holds {shape} that this service does not know (revoked, from another "
        "service, or mistyped); check the key you exported (TINKER_API_KEY or OPENRL_TOKEN)"
    )


class AuthMiddleware:
    def __init__(
        self,
        app,
        *,
        settings: Settings,
        keys: KeyRing,
        minted: MintedKeys | None = None,
        hub: HubAuth | None = None,
        jobs: Jobs | None = None,
        accounts: HubAccounts | None = None,
        admin: AdminKey | None = None,
    ):
        self.app = app
        self.jobs = jobs
        self.accounts = accounts
        self.admin = admin
        self.settings = settings
        self.keys = keys
        self.minted = minted
        self.hub = hub
        self.hosts = allowed_hosts(settings)
        self.explicit_hosts = {h.lower() for h in settings.allowed_hosts}
        self.max_body = settings.limits.max_body_bytes

    def _origin_ok(self, origin: str) -> bool:
        """Same-origin only: the service's own host names on its own port, or an --allowed-host name.
        "null" (sandboxed frames, file:// pages) and other local ports (another local web app) are refused."""
        if origin == "null":
            return False
        parts = urlsplit(origin)
        host = (parts.hostname or "").lower()
        if host in self.explicit_hosts:
            return True
        try:
            port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        except ValueError:
            return False
        return host in self.hosts and port == self.settings.port

    async def _still(self, scope, headers: dict[str, str], path: str, tenant: str) -> bool:
        """Whether the request's credential still names ``tenant`` (an unreachable hub: yes, for now)."""
        try:
            who = await self._authenticate(scope, headers, path)
        except HubUnavailable:
            return True
        return isinstance(who, dict) and who.get("tenant") == tenant

    async def _authenticate(self, scope, headers: dict[str, str], path: str) -> dict | _Refused:
        """Who the request's credential names (``tenant``, ``auth_via`` and its details for
        ``request.state``), or why it is refused; raises HubUnavailable when the hub must answer and
        cannot."""
        key = credential(headers)
        # The operator's key (api/admin.py): the admin routes only, and nothing else reaches them.
        if self.admin is not None and key and key.startswith(ADMIN_KEY_PREFIX) and self.admin.matches(key):
            if not path.startswith(ADMIN_PREFIX):
                return _Refused(403, "the admin key is for the admin routes (/openrl/v1/admin/) only")
            return {"tenant": ADMIN_TENANT, "auth_via": "admin"}
        # A job's key (engine/jobs.py): its scope holds (the jobs API itself needs auth on).
        if self.jobs is not None and key and key.startswith(JOB_KEY_PREFIX):
            job = self.jobs.access(key, scope.get("method", "GET"), path)
            if isinstance(job, JobRefusal):
                return _Refused(job.status, job.message)
            if job is not None:
                if self.accounts is not None:
                    rec = self.jobs.jobs.get(job.job_id) or {}
                    refusal = await self.accounts.check_job(job.tenant, float(rec.get("created") or 0))
                    if refusal is not None:
                        return _Refused(401, refusal.message)
                # job_revoked: only a repeat of its terminal report
                return {
                    "tenant": job.tenant,
                    "auth_via": "job",
                    "job_id": job.job_id,
                    "job_revoked": job.revoked,
                }
        if not self.settings.auth_enabled:
            return {"tenant": DEFAULT_TENANT, "auth_via": "none"}
        tenant = self.keys.tenant(key)
        if tenant is not None:
            return {"tenant": tenant, "auth_via": "api_key"}
        rec = self.minted.find(key) if self.minted is not None else None
        if rec is not None:
            why = self.minted.refusal(rec)
            if why is None and self.accounts is not None:
                refusal = await self.accounts.check_minted(rec)
                why = refusal.message if refusal is not None else None
            if why is not None:
                return _Refused(401, why)
            return {"tenant": rec["tenant"], "auth_via": "minted"}
        # tml- keys are ours (configured or minted); only other tokens are the hub's to judge
        if key and not key.startswith("tml-") and self.hub is not None:
            source = (scope.get("client") or ("unknown",))[0]  # the TCP peer, never a header
            answer = await self.hub.resolve(key, source)
            if isinstance(answer, Throttled):
                return _Refused(429, answer.message, answer.retry_after_s)
            if isinstance(answer, Refusal):
                return _Refused(401, answer.message)
            user = await self.accounts.admit(answer) if self.accounts is not None else None
            if isinstance(user, Refusal):
                return _Refused(401, user.message)
            created = user.created if user is not None else answer.created
            if created is not None:
                self.hub.bind(key, created)
            return {
                "tenant": answer.tenant,
                "auth_via": "hub",
                "hub_user": answer.user,
                "hub_created": created,
            }
        kind = "API key or JupyterHub token" if self.hub is not None else "API key"
        return _Refused(401, unauthorised(headers, kind))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        _error = functools.partial(_refuse, path=path)  # the OpenAI routes answer in OpenAI's shape
        admin_path = path.startswith(ADMIN_PREFIX)
        if admin_path and headers.get("origin"):  # the operator's command sends none; a page would
            return await _error(send, 403, "the admin routes take no cross-origin requests", "origin")
        # Probes and scrapes name the pod IP as Host (kubelet, Prometheus); nothing a rebinding page
        # could use sits behind these paths, so they answer any Host. Nor do the admin routes: the admin
        # command reaches the service on loopback while it may be bound to 0.0.0.0 with only cluster
        # names allowed, and their key is not a browser's.
        if self.hosts is not None and path not in PUBLIC_PATHS and path != METRICS_PATH and not admin_path:
            host = _host_only(headers.get("host", ""))
            if host not in self.hosts:
                return await _error(
                    send,
                    400,
                    f"Host {headers.get('host', '')!r} is not allowed by this service "
                    "(start it with --allowed-host NAME to add one)",
                    "host",
                )
            origin = headers.get("origin")
            if origin and not self._origin_ok(origin):
                return await _error(send, 403, f"cross-origin requests from {origin} are refused", "origin")
        # Signed download links carry their own authorisation (an HMAC over tenant, file and expiry).
        anonymous_scrape = (
            path == METRICS_PATH and "x-api-key" not in headers and "authorization" not in headers
        )
        signed = path.startswith((SIGNED_PREFIX, UPLOAD_PREFIX))
        if path not in PUBLIC_PATHS and not signed and not anonymous_scrape:
            try:
                who = await self._authenticate(scope, headers, path)
            except HubUnavailable as e:
                return await _error(
                    send, 503, f"{e}; API keys still work", "hub", category="server", retry_after_s=5
                )
            if isinstance(who, _Refused):
                return await _error(
                    send, who.status, who.message, "X-API-Key", retry_after_s=who.retry_after_s
                )
            state = scope.setdefault("state", {})
            state.update(who)
            # Long responses (the event stream) ask again before each event: a key revoked (or a hub
            # user deleted) while the stream is open must not keep receiving the tenant's events.
            state["still_authorised"] = functools.partial(self._still, scope, headers, path, who["tenant"])
        if path.startswith(UPLOAD_PREFIX):  # the route bounds each file by its adapter's exact size
            return await self.app(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await _error(
                send,
                413,
                f"request body of {int(length)} bytes exceeds {self.max_body} bytes (OPENRL_MAX_BODY_BYTES)",
                "body",
            )
        seen = 0
        max_body = self.max_body

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_body:
                    raise _TooLarge()
            return message

        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _error(
                    send, 413, f"request body exceeds {max_body} bytes (OPENRL_MAX_BODY_BYTES)", "body"
                )


class _Refused:
    """A credential refused: the status (401, 403, 429), the message, and a Retry-After for 429."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None):
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


async def _refuse(
    send,
    status: int,
    message: str,
    field: str | None,
    category: str = "user",
    retry_after_s: int | None = None,
    *,
    path: str = "",
) -> None:
    if is_openai_path(path):
        payload = error_payload(status, message, field)
    else:
        payload = {"error": message, "category": category}
        if field:
            payload["field"] = field
    body = orjson.dumps(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
