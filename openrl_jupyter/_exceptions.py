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
    ├── RewardCellError       a %%openrl reward cell raised; shown as the user's own lines only
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


class RewardCellError(OpenRLError):
    """A ``%%openrl reward NAME`` cell raised (or did not compile). IPython shows the user's frames
    only, those in the cell and below it: the magic that ran it is not the user's to read."""

    def __init__(self, name: str, error: BaseException, filename: str):
        super().__init__(
            f"the %%openrl reward {name} cell failed ({type(error).__name__}); nothing was registered"
        )
        self.error = error
        self.filename = filename

    def _render_traceback_(self) -> list[str]:
        import traceback

        tb = self.error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != self.filename:
            tb = tb.tb_next  # the magic's own frames, above the cell
        lines = traceback.format_exception(type(self.error), self.error, tb)
        if tb is None and not isinstance(self.error, SyntaxError):  # raised outside the cell: its line only
            lines = traceback.format_exception_only(type(self.error), self.error)
        return [line.rstrip("\n") for line in lines] + [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


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
