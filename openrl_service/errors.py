"""Errors the service raises, and how each one reaches a client.

    ApiError                      the base; never shown with a traceback
    ├── UserError                 the caller asked for something impossible (HTTP 400 / "user" result)
    │   ├── NotFound              unknown or foreign object: run, sampler, checkpoint, future (404)
    │   ├── Gone                  existed once, has expired (410)
    │   ├── QuotaExceeded         a per-tenant quota is full (403, naming it and how to free it)
    │   ├── PayloadTooLarge       request body over the limit (413)
    │   ├── RestoredError         an error read back from the recovery journal (its own status)
    │   └── UnsupportedMediaType  a JSON route got another Content-Type (415)
    ├── Unauthorized              missing or wrong API key (401)
    ├── NotReady                  the model is still loading (503, retried by clients)
    ├── ShuttingDown              (lifecycle.py) the service is draining (503 + Retry-After)
    └── InternalError             the service failed; the message carries an id, never internals

A ``UserError`` names the field and, where one applies, the limit and its setting, e.g.
``num_samples must be <= 64 (OPENRL_MAX_NUM_SAMPLES); got 500``.
"""

from __future__ import annotations


class ApiError(Exception):
    status_code = 500
    category = "server"
    takes_field = True  # openrl_common.checks names the field it refuses

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field

    def to_json(self) -> dict:
        body = {"error": self.message, "category": self.category}
        if self.field:
            body["field"] = self.field
        return body


class UserError(ApiError):
    status_code = 400
    category = "user"


class NotFound(UserError):
    status_code = 404


class Forbidden(UserError):
    status_code = 403


class Conflict(UserError):
    status_code = 409


class QuotaExceeded(Forbidden):
    """A per-tenant quota (sessions, runs, checkpoint bytes) is full; the message names the setting and
    what frees room. A 403, not a 409: the Tinker SDK retries a 409 for about a minute before it gives
    up, and a full quota does not empty itself by waiting."""


class Gone(UserError):
    status_code = 410


class PayloadTooLarge(UserError):
    status_code = 413


class OutOfMemory(PayloadTooLarge):
    """An op ran out of device memory (``torch.OutOfMemoryError``): that op failed, nothing of it was
    applied, and what it took is freed; the service and other runs carry on (engine/scheduler.py)."""


class UnsupportedMediaType(UserError):
    status_code = 415


class Unauthorized(ApiError):
    status_code = 401
    category = "user"


class NotReady(ApiError):
    status_code = 503

    def __init__(self, message: str, *, retry_after_s: float = 2.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InternalError(ApiError):
    status_code = 500


class RestoredError(UserError):
    """An error result (or a rejected argument) kept in the recovery journal: the same JSON and
    status as the error it was (a UserError, so code that treats a rejected argument as one keeps
    doing so after a restart)."""

    def __init__(self, body: dict, status_code: int):
        super().__init__(str(body.get("error", "")), field=body.get("field"))
        self.body = dict(body)
        self.status_code = status_code
        self.category = str(body.get("category", "server"))

    def to_json(self) -> dict:
        return dict(self.body)
