"""Idempotent POSTs over HTTP: the ``X-Idempotency-Key`` header of a request, handed to the engine's
store of replies (:mod:`openrl_service.engine.replies`, where what is remembered and for how long is
described), and a remembered reply as a response again."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from openrl_service.engine.replies import HEADER, IdempotentReplies


def _respond(body: bytes, status: int, media_type: str | None) -> Response:
    return Response(body, status_code=status, media_type=media_type)


async def idempotent(
    replies: IdempotentReplies,
    request: Request,
    tenant: str,
    make: Callable[[tuple | None], Awaitable[Response]],
) -> Response:
    """``make(identity)``'s response, or the first reply of this request's X-Idempotency-Key."""
    key = request.headers.get(HEADER)
    body = await request.body() if key is not None else b""
    return await replies.reply(tenant, request.method, request.url.path, key, body, make, _respond)
