"""openrl_jupyter: RL post-training of LLMs from a notebook.

    %load_ext openrl_jupyter
    %openrl connect --local

or, in plain Python, ``openrl_jupyter.connect(...)``, ``@openrl_jupyter.reward("name")`` (or
``@openrl_jupyter.env("name")`` for a multi-turn environment) and ``session.train(...)``. It stays
light: it imports and works without torch.
"""

from openrl_jupyter import env  # the module; calling it, oj.env(NAME), is the decorator env.env
from openrl_jupyter._exceptions import (
    AuthenticationError,
    NotFoundError,
    OpenRLError,
    RequestError,
    ServerError,
    ServiceError,
    ServiceUnavailable,
    UsageError,
)
from openrl_jupyter.client import AsyncClient, Client
from openrl_jupyter.rewards import reward
from openrl_jupyter.run import Run, RunState
from openrl_jupyter.session import Session, connect, disconnect, get_session

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "Client",
    "NotFoundError",
    "OpenRLError",
    "RequestError",
    "Run",
    "RunState",
    "ServerError",
    "ServiceError",
    "ServiceUnavailable",
    "Session",
    "UsageError",
    "__version__",
    "connect",
    "disconnect",
    "env",
    "get_session",
    "reward",
]


def load_ipython_extension(ipython) -> None:
    """``%load_ext openrl_jupyter``: register the ``%openrl`` / ``%%openrl`` magics."""
    from openrl_jupyter.magics import OpenRLMagics

    ipython.register_magics(OpenRLMagics)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext openrl_jupyter``: close the sessions (embedded services stop)."""
    from openrl_jupyter import session

    for name in list(session.sessions()):
        session.disconnect(name)


def _jupyter_server_extension_points() -> list[dict]:
    """The Jupyter server extension (the OpenRL panel's endpoints); jupyter_server is imported only
    by the server, so ``import openrl_jupyter`` in a kernel stays light."""
    from openrl_jupyter.server import OpenRLServer

    return [{"module": "openrl_jupyter.server", "app": OpenRLServer}]


def _jupyter_labextension_paths() -> list[dict]:
    """The prebuilt JupyterLab extension (built into openrl_jupyter/labextension)."""
    return [{"src": "labextension", "dest": "openrl-jupyter-labextension"}]
