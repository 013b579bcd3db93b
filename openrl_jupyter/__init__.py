"""openrl_jupyter: the notebook side of openrl (client today; magics, widgets and background runs next).

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
    "__version__",
]
