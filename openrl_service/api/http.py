"""HTTP plumbing every router shares: bounded (zstd) bodies, JSON in and out, typed fields, 429s.

``rest.py``, ``hub.py``, ``native.py`` and the Tinker router (``tinker.py``) build on these; nothing
here knows the Tinker protocol.
"""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any, TypeVar

import orjson
import zstandard
from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

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
    """Mark a route that queues new work: while the service starts, recovers or drains it answers 503
    + Retry-After before reading the request (see :mod:`openrl_service.lifecycle`). Put it under the
    ``@router.post``."""
    endpoint.takes_new_work = True
    return endpoint


def answers_while_starting(endpoint):
    """Mark a route that answers while the service starts or recovers its journal: one that knows
    what it cannot know yet (``retrieve_future``'s try_again, a heartbeat for a session not restored
    yet) or that reads no state the journal restores. Every other route of a :class:`ServiceRoute`
    router answers 503 + Retry-After until recovery is done: a run, session or checkpoint that the
    journal is about to bring back must never read as a 404 or an empty list, which a client would
    take as final."""
    endpoint.answers_while_starting = True
    return endpoint


class ServiceRoute(APIRoute):
    """The routes that read or change the engine's state. Until the service is ready (the model loaded
    and the journal replayed) they answer 503 + Retry-After, unless marked :func:`answers_while_starting`;
    a :func:`new_work` route is refused while the service drains too. A :class:`QueueFull` becomes
    :func:`backpressure_response` (the app-wide error handler knows no Retry-After for 429), and what a
    request other than a GET changed is made durable before its reply leaves (:func:`acknowledge`)."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        gated = getattr(self.endpoint, "takes_new_work", False)
        early = getattr(self.endpoint, "answers_while_starting", False)

        async def route(request: Request) -> Response:
            lifecycle = getattr(request.app.state, "lifecycle", None)
            if lifecycle is not None:
                if gated:
                    lifecycle.refuse_new_work()
                elif not early:
                    lifecycle.refuse_until_recovered()
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


M = TypeVar("M", bound=BaseModel)


async def read_model(request: Request, model: type[M], max_bytes: int) -> M:
    """The request's JSON body as ``model`` (:mod:`openrl_service.api.schemas`); a body it refuses is
    a 400 naming the first refused field."""
    return parse(model, await read_json(request, max_bytes))


def parse(model: type[M], data: dict) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise refusal(e) from None


async def read_op(request: Request, model: type[M], max_bytes: int) -> tuple[dict, M | None]:
    """The body of an op a run orders by ``seq_id``: (the JSON object, the model or None). A refused
    ``model_id`` or ``seq_id`` is a 400; any other refusal leaves None, and the engine, given the body as
    sent, fails the op in its slot with the reason (a 400 would leave a gap the run's later ops wait
    behind)."""
    data = await read_json(request, max_bytes)
    try:
        return data, model.model_validate(data)
    except ValidationError as e:
        slot = [err for err in e.errors(include_url=False) if _field_of(err) in ("model_id", "seq_id", "")]
        if slot:  # no run or no place in its order: nothing to keep, a 400
            raise refusal(e, slot[0]) from None
        seq_id = data.get("seq_id")
        if not (isinstance(data.get("model_id"), str) and type(seq_id) is int and seq_id >= 0):
            raise refusal(e) from None  # (a form without a slot, e.g. load_weights making a new run)
        return data, None


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_TAG = re.compile(r"^(str|int|float|bool|none|constrained-\w+|\w+\[.*\]|function-\w+\[.*\])$")


def _is_tag(part: Any) -> bool:
    """Whether a step of an error's location names a member of a union (``str``,
    ``list[function-wrap[check()]]``, ``constrained-str``) rather than a field or a key."""
    return isinstance(part, str) and bool(_TAG.match(part))


def _first(errors: list) -> dict:
    """The error to report: the first; where it is one member's failure of a union, the one of that
    union's members that got furthest (a chat message missing its content, not "not a string")."""
    first = errors[0]
    loc = first["loc"]
    cut = next((i for i, p in enumerate(loc) if _is_tag(p)), None)
    if cut is None:
        return first
    same = [e for e in errors if e["loc"][:cut] == loc[:cut]]
    return max(same, key=lambda e: len(e["loc"]))


def _kind(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _field_of(err: dict) -> str:
    """The path of the value an error refuses (``""``: the body as a whole)."""
    path = _path(tuple(p for p in err["loc"] if not _is_tag(p)))
    extra = (err.get("ctx") or {}).get("field")
    if extra:
        path = f"{path}.{extra}" if path else extra
    return path


def refusal(e: ValidationError, err: dict | None = None) -> UserError:
    """A request model's refusal as the 400 every route gives: the first refused field's path (or
    ``err``'s) and why."""
    err = err or _first(e.errors(include_url=False))
    ctx = err.get("ctx") or {}
    path = _field_of(err)
    value = err.get("input")
    shown = repr(value) if len(repr(value)) <= 100 else repr(value)[:100] + "…"
    kind = err["type"]
    got = _kind(value)
    length = len(value) if isinstance(value, (str, list, dict)) else 0
    reasons = {
        "missing": lambda: "is required",
        "string_type": lambda: f"must be a string; got {got}",
        "bool_type": lambda: f"must be true or false; got {got} {shown}",
        "model_type": lambda: f"must be a JSON object; got {got}",
        "model_attributes_type": lambda: f"must be a JSON object; got {got}",
        "dict_type": lambda: f"must be a JSON object; got {got}",
        "list_type": lambda: f"must be a list; got {got}",
        "int_type": lambda: f"must be an integer; got {shown}",
        "float_type": lambda: f"must be a finite number; got {shown}",
        "literal_error": lambda: f"must be one of {ctx.get('expected')}; got {shown}",
        "string_too_short": lambda: f"must have at least {ctx.get('min_length')} characters",
        "string_too_long": lambda: f"must have at most {ctx.get('max_length')} characters; got {length}",
        "string_pattern_mismatch": lambda: f"must match {ctx.get('pattern')}; got {shown}",
        "too_short": lambda: f"must have at least {ctx.get('min_length')} items; got {length}",
        "too_long": lambda: f"must have at most {ctx.get('max_length')} items; got {length}",
        "extra_forbidden": lambda: "is not a field this takes",
    }
    if kind in ("explained", "form", "too_large"):
        why = str(ctx.get("why"))
    elif kind in reasons:
        why = reasons[kind]()
    else:
        why = err["msg"]
    error = PayloadTooLarge if kind == "too_large" else UserError
    if not path:
        return error(f"request body {why}", field="body")
    return error(f"{path} {why}" if why.startswith(("must", "is ")) else f"{path}: {why}", field=path)


def tenant(request: Request) -> str:
    """The tenant the API key named (set by the auth middleware)."""
    return request.state.tenant
