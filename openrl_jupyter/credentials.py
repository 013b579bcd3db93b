"""Where the notebook side finds its service and key: one order for ``%openrl connect``,
``openrl_jupyter.connect()`` and the Jupyter server extension (first match wins).

- URL: the one given (on the line, as an argument, or the server extension's ``c.OpenRLServer.url``)
  > ``$OPENRL_URL`` > configuration (``c.OpenRLMagics.url``) > ``$TINKER_BASE_URL``.
- key: the one given (``token=``, ``c.OpenRLServer.token``) > ``$OPENRL_TOKEN`` > configuration
  (``c.OpenRLMagics.token_file``) > ``$TINKER_API_KEY``, only when ``$TINKER_BASE_URL`` names the
  service connected to (it often holds a hosted Tinker key, which must never go anywhere else) > the
  JupyterHub single-user server's own token, only to a URL the hub or the configuration named
  (``$OPENRL_URL``, configuration; never a URL typed on a line).

``openrl-service serve`` prints ``export TINKER_BASE_URL=… TINKER_API_KEY=…``: the Tinker SDK and a
notebook both connect with those lines alone.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

from openrl_jupyter.hub import hub_token


@dataclass(frozen=True)
class Found:
    url: str | None
    token: str | None = field(repr=False)
    url_from: str  # given, OPENRL_URL, config, TINKER_BASE_URL, none
    key_from: str  # given, OPENRL_TOKEN, config, TINKER_API_KEY, hub, none


def same_service(a: str | None, b: str | None) -> bool:
    """Whether two service URLs name the same service: scheme and host in any case, the default port
    written or not, a trailing slash or not."""
    if not a or not b:
        return False

    def norm(u: str) -> tuple:
        parts = urllib.parse.urlsplit(u.strip())
        scheme = parts.scheme.lower()
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
        return scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/")

    try:
        return norm(a) == norm(b)
    except ValueError:  # an unparsable port
        return False


def find(
    url: str | None = None,
    token: str | None = None,
    *,
    config_url: str | None = None,
    config_token: str | None = None,
    given_is_configured: bool = False,
    env: Mapping[str, str] | None = None,
) -> Found:
    """The service and key, in the order above. ``given_is_configured``: the given URL is an
    operator's configuration (the server extension's), so the hub's token may go to it."""
    env = os.environ if env is None else env
    tinker_url = env.get("TINKER_BASE_URL") or None
    sources = [("given", url), ("OPENRL_URL", env.get("OPENRL_URL")), ("config", config_url)]
    sources.append(("TINKER_BASE_URL", tinker_url))
    url_from, chosen = next(((k, v) for k, v in sources if v), ("none", None))
    configured = url_from in ("OPENRL_URL", "config") or (url_from == "given" and given_is_configured)
    if token:
        key_from = "given"
    elif env.get("OPENRL_TOKEN"):
        token, key_from = env["OPENRL_TOKEN"], "OPENRL_TOKEN"
    elif config_token:
        token, key_from = config_token, "config"
    elif env.get("TINKER_API_KEY") and same_service(tinker_url, chosen):
        token, key_from = env["TINKER_API_KEY"], "TINKER_API_KEY"
    elif configured and hub_token(env):
        token, key_from = hub_token(env), "hub"
    else:
        token, key_from = None, "none"
    return Found(chosen, token, url_from, key_from)
