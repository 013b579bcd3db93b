"""HTTP plumbing every router shares: bounded (zstd) bodies, JSON in and out, typed fields, 429s.

``rest.py``, ``hub.py``, ``native.py`` and the Tinker router (``tinker.py``) build on these; nothing
here knows the Tinker protocol.
"""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import orjson
import zstandard
from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from openrl_service import crashpoints
from openrl_service.engine.ops import QueueFull
from openrl_service.errors import PayloadTooLarge, UnsupportedMediaType, UserError


def json_bytes(data: Any) -> bytes:
    return orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)


def json_response(data: Any, status: int = 200) -> Response:
    return Response(json_bytes(data), status_code=status, media_type="application/json")


def backpressure_response(e: QueueFull) -> Response:
    """429 with the JSON error (naming the limit) and when to retry, in seconds and milliseconds."""
    resp = json_response(e.to_json(), status=429)
    resp.headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
    resp.headers["retry-after-ms"] = str(max(1, round(e.retry_after_s * 1000)))
    return resp


def new_work(endpoint):
    """Mark a route that queues new work: while the service drains it answers 503 + Retry-After before
    reading the request (see :mod:`openrl_service.lifecycle`). Put it under the ``@router.post``."""
    endpoint.takes_new_work = True
    return endpoint


class BackpressureRoute(APIRoute):
    """A route whose :class:`QueueFull` becomes :func:`backpressure_response` (the app-wide error
    handler knows no Retry-After for 429), and which, if marked :func:`new_work`, is refused while
    the service drains."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        gated = getattr(self.endpoint, "takes_new_work", False)

        async def route(request: Request) -> Response:
            if gated:
                lifecycle = getattr(request.app.state, "lifecycle", None)
                if lifecycle is not None:
                    lifecycle.refuse_new_work()
            try:
                response = await handler(request)
            except QueueFull as e:
                return backpressure_response(e)
            if request.method != "GET":
                await acknowledge(request, gated)
            return response

        return route


async def acknowledge(request: Request, gated: bool) -> None:
    """Before a reply leaves: make the journal records of what the request changed durable (one
    fsync shared by every request waiting; InsufficientStorage, 507, when the disk is full)."""
    svc = getattr(request.app.state, "service", None)
    if svc is None:
        return
    await svc.durability.sync()
    if gated and crashpoints.armed("after_ack"):  # recovery tests: die just after this reply is sent
        asyncio.get_running_loop().call_later(0.2, crashpoints.hit, "after_ack")


def _too_large(max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"decompressed body exceeds {max_bytes} bytes (OPENRL_MAX_BODY_BYTES)", field="body"
    )


def inflate_zstd(body: bytes, max_bytes: int) -> bytes:
    """Decompress in bounded chunks: a frame that declares (or inflates to) more than the limit is refused
    before it is allocated."""
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as e:
        raise UserError(
            f"body: Content-Encoding zstd but the body is not valid zstd ({e})", field="body"
        ) from e
    if declared > max_bytes:
        raise _too_large(max_bytes)
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            while chunk := reader.read(1 << 20):
                out += chunk
                if len(out) > max_bytes:
                    raise _too_large(max_bytes)
    except zstandard.ZstdError as e:
        raise UserError(
            f"body: Content-Encoding zstd but the body is not valid zstd ({e})", field="body"
        ) from e
    return bytes(out)


async def read_body(request: Request, max_bytes: int) -> bytes:
    body = await request.body()
    if request.headers.get("content-encoding", "").lower() == "zstd":
        body = inflate_zstd(body, max_bytes)
    return body


_TOKEN = re.compile(r"^[a-z0-9!#$&^_.-]+$")  # RFC 6838 restricted-name characters (lower-cased)


def is_json_media_type(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON: ``application/json`` or ``application/<name>+json``
    (RFC 6839), any parameters (charset) ignored. Not "text/json", not "application/jsonp", not a
    type that merely contains "json" somewhere."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    if kind != "application":
        return False
    if subtype == "json":
        return True
    name, plus, suffix = subtype.rpartition("+")
    return bool(plus) and suffix == "json" and bool(_TOKEN.match(name))


async def read_json(request: Request, max_bytes: int) -> dict:
    """The request's body as a JSON object (an empty body: ``{}``). A body under another media type
    is refused (415) before it is parsed: a browser can post a form or text/plain cross-site without
    a CORS preflight, never application/json."""
    content_type = request.headers.get("content-type")
    body = await read_body(request, max_bytes)
    if body and not is_json_media_type(content_type):
        raise UnsupportedMediaType(
            "Content-Type must be application/json (or application/<name>+json): this route takes a "
            f"JSON body; got {(content_type or '(none)')[:100]!r}",
            field="Content-Type",
        )
    try:
        data = orjson.loads(body) if body else {}
    except orjson.JSONDecodeError as e:
        raise UserError(f"request body is not valid JSON: {e}", field="body") from e
    if not isinstance(data, dict):
        raise UserError("request body must be a JSON object", field="body")
    return data


def field(data: dict, name: str, kind: type | tuple, *, required: bool = True, default: Any = None) -> Any:
    value = data.get(name, default)
    if value is None:
        if required:
            raise UserError(f"{name} is required", field=name)
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (bool not in kinds and isinstance(value, bool)) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise UserError(f"{name} must be {names}; got {type(value).__name__}", field=name)
    return value


def tenant(request: Request) -> str:
    """The tenant the API key named (set by the auth middleware)."""
    return request.state.tenant
