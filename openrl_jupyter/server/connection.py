"""Which openrl service the Jupyter server talks to, with which key, and how its errors read.

Where the URL and key come from (first match wins, as for ``%openrl connect``:
:mod:`openrl_jupyter.credentials`): ``c.OpenRLServer.url`` / ``.token`` > ``$OPENRL_URL`` +
``$OPENRL_TOKEN`` > ``$TINKER_BASE_URL`` + ``$TINKER_API_KEY`` (the key only for that URL) > the
single-user server's ``$JUPYTERHUB_API_TOKEN`` (sent only to a configured URL) > the newest live
discovery file ``<runtime dir>/openrl-local-<pid>.json`` written by ``%openrl connect --local``. It is resolved on
each request, so a service started in a notebook after the server shows up without a restart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx

from openrl_jupyter import credentials
from openrl_jupyter.local import discovered

NOT_CONFIGURED = (
    "no openrl service configured: set c.OpenRLServer.url (and .token) or OPENRL_URL and OPENRL_TOKEN "
    "for the Jupyter server, or run %openrl connect --local in a notebook"
)


@dataclass(frozen=True)
class Target:
    """A service to talk to. ``source`` says where it came from (shown; the key never is)."""

    url: str
    token: str | None = field(repr=False)
    source: str  # "config", "OPENRL_URL", "TINKER_BASE_URL", "discovery"
    credential: str  # where the key came from: config, OPENRL_TOKEN, TINKER_API_KEY, hub, discovery, none


def resolve(
    *,
    url: str | None,
    token: str | None,
    runtime_dir: str | None,
    env: Mapping[str, str] | None = None,
) -> Target | None:
    """The service this server talks to now, or None (then the panel shows how to connect)."""
    found = credentials.find(url, token, given_is_configured=True, env=env)
    if found.url is not None:
        source = "config" if found.url_from == "given" else found.url_from
        credential = "config" if found.key_from == "given" else found.key_from
        return Target(found.url.rstrip("/"), found.token, source, credential)
    found = discovered(runtime_dir)
    if found is None:
        return None
    return Target(found["url"].rstrip("/"), found.get("token") or None, "discovery", "discovery")


class ServiceError(Exception):
    """The service could not answer: ``status`` for the browser, ``message`` names the service."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def headers(target: Target) -> dict[str, str]:
    return {"X-API-Key": target.token} if target.token else {}


def unreachable(target: Target, exc: httpx.HTTPError) -> ServiceError:
    """A transport failure as the browser sees it: 503 (cannot connect, timed out) or 502."""
    where = f"openrl service at {target.url}"
    if isinstance(exc, httpx.TimeoutException):
        return ServiceError(503, f"{where}: no answer in time ({type(exc).__name__}); is it overloaded?")
    if isinstance(exc, (httpx.ConnectError, httpx.UnsupportedProtocol, httpx.InvalidURL)):
        return ServiceError(503, f"{where}: cannot connect ({type(exc).__name__}: {exc}); is it running?")
    return ServiceError(502, f"{where}: the connection failed ({type(exc).__name__}: {exc})")


def refused(target: Target, response: httpx.Response) -> ServiceError:
    """An error reply as the browser sees it (the service's own message, naming the service).

    401/403 (a refused key) become 502: the browser's Jupyter login is fine, the server's key is not,
    and a 401/403 would read as the browser's own session having expired."""
    status = response.status_code
    try:
        body = response.json()
        message = body.get("error") or body.get("detail") or body.get("message")
    except (ValueError, AttributeError):
        message = None
    message = str(message or " ".join(response.text.split())[:160] or response.reason_phrase)
    where = f"openrl service at {target.url}"
    if 300 <= status < 400:
        location = response.headers.get("location", "?")
        return ServiceError(502, f"{where}: redirected to {location}; is this an openrl service?")
    if status in (401, 403):
        hint = "check c.OpenRLServer.token / OPENRL_TOKEN" if target.source != "discovery" else ""
        return ServiceError(
            502, f"{where}: the key was refused (HTTP {status}: {message})" + (f"; {hint}" if hint else "")
        )
    if status == 404:
        return ServiceError(404, f"{where}: {message}")
    if status in (429, 503):
        return ServiceError(503, f"{where}: busy or not ready (HTTP {status}: {message}); retry shortly")
    if status >= 500:
        return ServiceError(502, f"{where}: the service failed (HTTP {status}: {message}); see its log")
    return ServiceError(400 if status < 400 else status, f"{where}: {message}")


def decode(target: Target, response: httpx.Response):
    """The JSON of a successful reply; a ServiceError otherwise."""
    if response.status_code >= 300:
        raise refused(target, response)
    try:
        return response.json()
    except ValueError:
        raise ServiceError(
            502, f"openrl service at {target.url}: the reply is not JSON; is this an openrl service?"
        ) from None
