"""Errors of the notebook side. The tree separates "you asked for something impossible" from
"the service (or the way to it) failed":

    OpenRLError
    ├── UsageError            the caller asked for something impossible (a bad flag, a missing extra)
    ├── RequestError          the service refused the request (4xx); the message names the field
    │   ├── AuthenticationError   missing or wrong key (401)
    │   └── NotFoundError         unknown or foreign run, sample or checkpoint (404)
    ├── ServiceError          the service failed or could not be reached
    │   ├── ServiceUnavailable    connection refused / timed out / 503, after retries
    │   └── ServerError           5xx with an incident id
    ├── RunPaused             wait() on a run that paused on an error (fix it, then resume())
    ├── RunFailed             wait() on a run that cannot continue
    └── RunTimeout            wait() gave up after its timeout (also a TimeoutError); the run goes on

Every message says which service, what failed and, where there is one, what to do.
"""

from __future__ import annotations


class OpenRLError(Exception):
    """Base of every error raised by openrl_jupyter."""

    def _render_traceback_(self) -> list[str]:
        """IPython shows an expected failure as one red line, not a traceback."""
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class UsageError(OpenRLError):
    """The caller asked for something impossible (a bad flag, a missing extra, no URL)."""


class RequestError(OpenRLError):
    """The service refused the request; nothing was changed."""

    def __init__(self, message: str, *, status: int, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field


class AuthenticationError(RequestError):
    """Missing or wrong API key."""


class NotFoundError(RequestError):
    """Unknown object, or one that belongs to another tenant."""


class ServiceError(OpenRLError):
    """The service failed, or could not be reached."""


class ServiceUnavailable(ServiceError):
    """Connection refused, timed out, or the service said it is not ready (after retries)."""


class ServerError(ServiceError):
    """The service answered 5xx."""


class RunPaused(OpenRLError):
    """``wait()`` on a run that paused on an error (its message is the error); fix, then resume()."""


class RunFailed(OpenRLError):
    """``wait()`` on a run that cannot continue (e.g. the service lost it)."""


class RunTimeout(OpenRLError, TimeoutError):
    """``wait()``/``pause(wait=True)`` gave up after its timeout; the run goes on."""
