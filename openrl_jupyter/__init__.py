"""openrl_jupyter: the notebook side of openrl (client and sessions today; magics, widgets and
background runs next).

It stays light: it imports and works without torch.
"""

from openrl_jupyter._exceptions import (
    AuthenticationError,
    NotFoundError,
    OpenRLError,
    RequestError,
    ServerError,
    ServiceError,
    ServiceUnavailable,
)
from openrl_jupyter.client import AsyncClient, Client
from openrl_jupyter.session import Session, UsageError, connect, disconnect, get_session

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "Client",
    "NotFoundError",
    "OpenRLError",
    "RequestError",
    "ServerError",
    "ServiceError",
    "ServiceUnavailable",
    "Session",
    "UsageError",
    "__version__",
    "connect",
    "disconnect",
    "get_session",
]
