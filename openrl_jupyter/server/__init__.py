"""The Jupyter server extension behind the OpenRL panel: endpoints at ``<base_url>openrl/…`` that talk
to the openrl service with the key held in the server process (never sent to the browser).

    GET  openrl/health              connected?, service URL, model(s), readiness, device utilisation
    GET  openrl/runs                the tenant's runs (the service's /openrl/v1/runs?include=all)
    GET  openrl/runs/<id>           one run, its metrics history and recent samples
    POST openrl/runs/<id>/control   {"action": "pause" | "resume" | "stop", "reason": "..."}
    GET  openrl/events              the service's event stream (SSE), relayed

Enabled by ``pip install`` (``jupyter-config/server-config/openrl_jupyter.json``); configured with
``c.OpenRLServer.url`` / ``.token``, else ``$OPENRL_URL`` + ``$OPENRL_TOKEN`` (or the JupyterHub
server's own token), else the service ``%openrl connect --local`` advertises (see ``connection``).
"""

from __future__ import annotations

from openrl_jupyter.server.app import OpenRLServer

__all__ = ["OpenRLServer"]


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "openrl_jupyter.server", "app": OpenRLServer}]
