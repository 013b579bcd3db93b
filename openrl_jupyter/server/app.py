"""``OpenRLServer``: the extension app: its configuration, its HTTP client, its routes.

# jupyter_server_config.py
c.OpenRLServer.url = "http://openrl-gateway.openrl.svc.cluster.local:8000"
c.OpenRLServer.token = "tml-..."      # never sent to the browser
"""

from __future__ import annotations

import httpx
from jupyter_server.extension.application import ExtensionApp
from traitlets import Float, Unicode

from openrl_jupyter.server import handlers
from openrl_jupyter.server.connection import Target, resolve


class OpenRLServer(ExtensionApp):
    """The OpenRL panel's server side: talks to one openrl service with a key kept in this process."""

    name = "openrl_jupyter"
    load_other_extensions = True

    url = Unicode(
        None,
        allow_none=True,
        config=True,
        help="The openrl service's URL (else $OPENRL_URL, else the one %openrl connect --local started).",
    )
    token = Unicode(
        None,
        allow_none=True,
        config=True,
        help="The key for the service (else $OPENRL_TOKEN, else $JUPYTERHUB_API_TOKEN). Stays in the "
        "server: never in a response, a page or a log.",
    )
    refresh_s = Float(
        2.0, config=True, help="How often the panel refreshes its lists, in seconds (its default)."
    )
    timeout_s = Float(10.0, config=True, help="How long to wait for the service's answer, in seconds.")

    _http: httpx.AsyncClient | None = None
    _announced: tuple | None = None

    def initialize_handlers(self) -> None:
        self.handlers.extend(handlers.routes(self))

    @property
    def http(self) -> httpx.AsyncClient:
        """One client for all requests (made on first use, inside the server's event loop)."""
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False)
        return self._http

    def target(self) -> Target | None:
        """The service to talk to now (resolved per request: a discovery file may appear or go)."""
        target = resolve(url=self.url, token=self.token, runtime_dir=self.runtime_dir)
        seen = None if target is None else (target.url, target.source, target.credential)
        if seen != self._announced:  # log the URL and where things came from; never the key
            self._announced = seen
            if target is None:
                self.log.info("openrl: no service configured")
            else:
                self.log.info(
                    "openrl: service at %s (from %s, key from %s)",
                    target.url,
                    target.source,
                    target.credential,
                )
        return target

    async def stop_extension(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
