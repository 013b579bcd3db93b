"""The OpenAI-compatible API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, served
again under ``/oai/api/v1`` (hosted Tinker's path: ``base_url=<service>/oai/api/v1`` works unchanged).

``model`` is a served base model (``openrl/tiny``, or hosted Tinker's ``<name>:peft:<context>``), a
``tinker://`` checkpoint the caller holds (sampler, training or external weights), or
``<base>;tinker://…``. The sampling is the Tinker path's (engine/inference.py): the same sampler and
engine, fused with other runs' sampling. Keys are the service's (``Authorization: Bearer <key>``, as the
OpenAI SDK sends it; hub tokens and minted keys too); another tenant's checkpoint is a 404.

What differs from OpenAI's API, on purpose: ``stream`` sends each choice's tokens once the batch has
decoded (the engine decodes a batch at a time, fused with other runs); ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, tools and response formats other than text are refused with a
400 naming the field rather than ignored. Errors use OpenAI's shape, ``{"error": {"message", "type",
"param", "code"}}``.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from openrl_service.api.http import read_json, tenant
from openrl_service.api.openai_replies import (
    Decoded,
    chat_chunks,
    chat_logprobs,
    completion_choices,
    completion_chunks,
    usage_of,
)
from openrl_service.checks import integer, number
from openrl_service.engine import prompts
from openrl_service.engine.inference import Inference, Target
from openrl_service.engine.service import TrainingService
from openrl_service.errors import ApiError, UserError
from openrl_service.sampling.base import SampleJob, SampleOutput, SamplingParams

PREFIXES = ("/v1", "/oai/api/v1")
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound (completions' logprobs: 5)
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}
# Accepted only at the value that changes nothing; any other value is refused with the reason.
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0}


def is_openai_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PREFIXES)


def error_payload(status: int, message: str, field: str | None) -> dict:
    """OpenAI's error shape; ``type`` from the status, ``code`` names a missing model."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = "model_not_found" if status == 404 and field == "model" else None
    return {"error": {"message": message, "type": kind, "param": field, "code": code}}


def error_response(
    status: int, message: str, field: str | None, retry_after_s: float | None = None
) -> Response:
    resp = Response(
        orjson.dumps(error_payload(status, message, field)), status, media_type="application/json"
    )
    if retry_after_s is not None:
        resp.headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
        resp.headers["retry-after-ms"] = str(max(1, round(retry_after_s * 1000)))
    return resp


def api_error_response(e: ApiError) -> Response:
    retry = getattr(e, "retry_after_s", None)
    if retry is None and e.status_code == 503:
        retry = 2.0
    return error_response(e.status_code, e.message, e.field, retry)


class OpenAIRoute(APIRoute):
    """POSTs are refused while the service starts, recovers or drains, as every route that queues work
    is; GETs until it has recovered. Errors (these routes' and the lifecycle's) reach the app's handlers, which answer in OpenAI's
    shape on these paths (app.py: ``api_error_response``, 429 and 503 with Retry-After)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            lifecycle = getattr(request.app.state, "lifecycle", None)
            if lifecycle is not None:
                if request.method == "POST":
                    lifecycle.refuse_new_work()
                else:  # the models list names sampler checkpoints the journal may still restore
                    lifecycle.refuse_until_recovered()
            return await handler(request)

        return route


# -- request fields -----------------------------------------------------------------------------
def _refuse_unsupported(body: dict, chat: bool) -> None:
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise UserError(f"{name} is not supported by this service (send 0 or leave it out)", field=name)
    if body.get("logit_bias"):
        raise UserError("logit_bias is not supported by this service", field="logit_bias")
    if chat:
        if body.get("tools") or body.get("functions"):
            field = "tools" if body.get("tools") else "functions"
            raise UserError(f"{field}: tool calling is not supported by this service", field=field)
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise UserError(
                "response_format: only {'type': 'text'} is supported by this service", field="response_format"
            )
    elif body.get("suffix") is not None:
        raise UserError("suffix (insertion) is not supported by this service", field="suffix")


def _params(body: dict, svc: TrainingService, target: Target, chat: bool) -> tuple[SamplingParams, int]:
    """SamplingParams and ``n`` from an OpenAI body; errors name the OpenAI field and the limit."""
    lim = svc.limits
    _refuse_unsupported(body, chat)
    n = body.get("n")
    n = 1 if n is None else integer(n, "n", 1, lim.max_num_samples, setting="OPENRL_MAX_NUM_SAMPLES")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise UserError(
            "best_of must equal n (or be left out): this service returns every sample", field="best_of"
        )
    max_tokens, field = body.get("max_tokens"), "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens, field = body["max_completion_tokens"], "max_completion_tokens"
    if max_tokens is None and not chat:
        max_tokens = 16  # OpenAI's default for /completions; chat's default is as many as fit
    if max_tokens is not None:
        max_tokens = integer(max_tokens, field, 1, lim.max_tokens, setting="OPENRL_MAX_TOKENS")
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else number(temperature, "temperature", 0, 2)
    top_p = body.get("top_p")
    top_p = 1.0 if top_p is None else number(top_p, "top_p", 0, 1, lo_open=True)
    top_k = body.get("top_k")  # vLLM's extension
    top_k = -1 if top_k in (None, -1, 0) else integer(top_k, "top_k", 1, setting="or -1 for off")
    seed = body.get("seed")
    if seed is not None:
        seed = integer(seed, "seed", -(2**63), 2**63 - 1) % 2**62
    stop = body.get("stop")
    items = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise UserError("stop must be a non-empty string or a list of non-empty strings", field="stop")
    if len(items) > lim.max_stop_sequences:
        raise UserError(
            f"stop: at most {lim.max_stop_sequences} sequences (OPENRL_MAX_STOP_SEQUENCES); got {len(items)}",
            field="stop",
        )
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=seed,
        stop_token_ids=tuple(target.model.base.eos_token_ids),  # the end of a turn always ends it
        stop_strings=tuple(items),
    )
    return params, n


def _logprobs_k(body: dict, chat: bool, limit: int) -> int | None:
    """How many alternatives per token to return (0: the chosen token's only), None: no logprobs."""
    if chat:
        if not body.get("logprobs"):
            if body.get("top_logprobs"):
                raise UserError("top_logprobs needs logprobs: true", field="top_logprobs")
            return None
        k = body.get("top_logprobs")
        return (
            0
            if k is None
            else integer(k, "top_logprobs", 0, min(MAX_LOGPROBS, limit), setting="OPENRL_MAX_TOPK")
        )
    k = body.get("logprobs")
    if k is None or k is False:
        return None
    return integer(k, "logprobs", 0, min(MAX_LOGPROBS, limit), setting="OPENRL_MAX_TOPK")


def _chat_text(messages: Any) -> list[dict]:
    """Messages with string content (text parts joined), checked."""
    if not isinstance(messages, list) or not messages:
        raise UserError("messages must be a non-empty list of {role, content}", field="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(f"messages[{i}] must be an object with a string role", field=f"messages[{i}]")
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise UserError(
                        f"messages[{i}].content[{j}]: only text parts are supported by this service",
                        field=f"messages[{i}].content",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise UserError(
                f"messages[{i}].content must be a string or text parts", field=f"messages[{i}].content"
            )
        out.append({"role": m["role"], "content": content})
    return out


def _prompt_items(body: dict, base: Any) -> list:
    """/completions' ``prompt`` as a list of items (a string, a list of strings, a list of token ids or
    a list of those), each string's length checked against the context before anything is encoded."""
    p = body.get("prompt")
    if (
        isinstance(p, str)
        or isinstance(p, list)
        and p
        and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
    ):
        p = [p]
    if not isinstance(p, list) or not p:
        raise UserError("prompt must be a string, a list of strings, or token ids", field="prompt")
    for i, item in enumerate(p):
        if isinstance(item, str):
            prompts.check_text(base, len(item), f"prompt[{i}]" if len(p) > 1 else "prompt")
    return p


def _prompts(p: list, tok: Any, vocab: int) -> list[list[int]]:
    """The items of :func:`_prompt_items` as token ids (on a worker thread: it tokenises)."""
    out = []
    for i, item in enumerate(p):
        if isinstance(item, str):
            ids = list(tok.encode(item, add_special_tokens=False))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            if any(not 0 <= t < vocab for t in item):
                raise UserError(f"prompt[{i}]: token ids must be in [0, {vocab})", field="prompt")
            ids = list(item)
        else:
            raise UserError(f"prompt[{i}] must be a string or a list of token ids", field="prompt")
        if not ids:
            raise UserError(f"prompt[{i}] encodes to no tokens", field="prompt")
        out.append(ids)
    return out


# -- the router -----------------------------------------------------------------------------------
def build_openai_routers(svc: TrainingService, inference: Inference) -> list[APIRouter]:
    return [_router(svc, inference, prefix) for prefix in PREFIXES]


def _router(svc: TrainingService, inference: Inference, prefix: str) -> APIRouter:
    r = APIRouter(prefix=prefix, route_class=OpenAIRoute, tags=[f"openai{prefix.replace('/', '-')}"])
    max_body = svc.limits.max_body_bytes

    def op_id(name: str) -> str:
        return f"openai{prefix.replace('/', '_')}_{name}"

    @r.get("/models", operation_id=op_id("list_models"))
    async def list_models(request: Request):
        """The served base models and the caller's sampler and training checkpoints (newest first)."""
        return _json({"object": "list", "data": await run_in_threadpool(_models, svc, tenant(request))})

    @r.get("/models/{model:path}", operation_id=op_id("get_model"))
    async def get_model(model: str, request: Request):
        """One model: a served base model or a checkpoint the caller holds (404 otherwise)."""
        target = await run_in_threadpool(inference.resolve, tenant(request), model)
        return _json(_model_card(target, svc))

    @r.post("/completions", operation_id=op_id("completions"))
    async def completions(request: Request):
        """Text completion: ``prompt`` (strings or token ids), ``n``, ``max_tokens`` (default 16),
        ``temperature``, ``top_p``, ``stop``, ``seed``, ``logprobs`` (0-20), ``echo``, ``stream``."""
        body = await read_json(request, max_body)
        who = tenant(request)
        target = await run_in_threadpool(inference.resolve, who, body.get("model"))
        tok = target.model.base.tokenizer
        params, n = _params(body, svc, target, chat=False)
        k = _logprobs_k(body, False, svc.limits.max_topk)
        echo = body.get("echo") or False
        if not isinstance(echo, bool):
            raise UserError("echo must be true or false", field="echo")
        items = _prompt_items(body, target.model.base)
        if len(items) > svc.limits.max_datums:
            raise UserError(
                f"prompt: at most {svc.limits.max_datums} prompts per call (OPENRL_MAX_DATUMS); got {len(items)}",
                field="prompt",
            )

        def checked_jobs() -> list[SampleJob]:  # tokenised and checked on a worker thread
            return [
                inference.check(
                    target,
                    p,
                    n,
                    SampleJob(
                        prompt=p,
                        num_samples=n,
                        params=params if params.seed is None else _seeded(params, i),
                        adapter=None,
                        prompt_logprobs=bool(echo and k is not None),
                        topk_prompt_logprobs=k if echo and k else 0,
                        topk_sample_logprobs=k or 0,
                    ),
                )
                for i, p in enumerate(_prompts(items, tok, target.model.base.vocab_size))
            ]

        jobs = await prompts.off_loop(checked_jobs)
        outs = await _run(svc, inference, who, target, jobs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        # detokenising thousands of choices is work too: off the event loop
        choices, completion_tokens = await prompts.off_loop(
            lambda: completion_choices(jobs, outs, tok, n, k, echo)
        )
        usage = usage_of(sum(len(j.prompt) for j in jobs), completion_tokens)
        head = {"id": rid, "object": "text_completion", "created": created, "model": target.id}
        if body.get("stream"):
            return _stream(completion_chunks(head, choices, usage, tok, _include_usage(body)))
        for c in choices:
            c.pop("_decoded")
            c.pop("_prefix")
        return _json({**head, "choices": choices, "usage": usage, "system_fingerprint": _fingerprint(svc)})

    @r.post("/chat/completions", operation_id=op_id("chat_completions"))
    async def chat_completions(request: Request):
        """Chat: ``messages`` through the model's chat template, ``n``, ``max_tokens`` /
        ``max_completion_tokens`` (default: as many as fit), ``temperature``, ``top_p``, ``stop``,
        ``seed``, ``logprobs`` + ``top_logprobs`` (0-20), ``stream``."""
        body = await read_json(request, max_body)
        who = tenant(request)
        target = await run_in_threadpool(inference.resolve, who, body.get("model"))
        base = target.model.base
        tok = base.tokenizer
        params, n = _params(body, svc, target, chat=True)
        k = _logprobs_k(body, True, svc.limits.max_topk)
        messages = _chat_text(body.get("messages"))
        if not getattr(tok, "chat_template", None):
            raise UserError(
                f"model: {base.name} has no chat template; use /completions with a prompt", field="model"
            )
        prompts.check_messages(base, messages, "messages")
        prompt = await prompts.off_loop(lambda: _chat_prompt(messages, tok, base.name))
        job = inference.check(
            target,
            prompt,
            n,
            SampleJob(prompt=prompt, num_samples=n, params=params, adapter=None, topk_sample_logprobs=k or 0),
            prompt_field="messages",
        )
        (out,) = await _run(svc, inference, who, target, [job])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        decoded = await prompts.off_loop(lambda: [Decoded(seq, tok, job.params, k) for seq in out.sequences])
        usage = usage_of(len(prompt), sum(d.generated for d in decoded))
        head = {"id": rid, "object": "chat.completion", "created": created, "model": target.id}
        if body.get("stream"):
            head["object"] = "chat.completion.chunk"
            return _stream(chat_chunks(head, decoded, usage, tok, k, _include_usage(body)))
        choices = await prompts.off_loop(
            lambda: [
                {
                    "index": j,
                    "message": {"role": "assistant", "content": d.text, "refusal": None},
                    "logprobs": None if k is None else chat_logprobs(d, tok),
                    "finish_reason": d.finish_reason,
                }
                for j, d in enumerate(decoded)
            ]
        )
        return _json({**head, "choices": choices, "usage": usage, "system_fingerprint": _fingerprint(svc)})

    return r


def _chat_prompt(messages: list[dict], tok: Any, model: str) -> list[int]:
    """The chat template's text for ``messages``, tokenised (on a worker thread)."""
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - the template refused these messages (roles, order)
        raise UserError(f"messages: {model}'s chat template refused them: {e}", field="messages") from None
    return list(tok.encode(text, add_special_tokens=False))


def _seeded(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th prompt's seed (prompts of one call draw differently, as the notebook API's do)."""
    return dataclasses.replace(params, seed=(params.seed + 7_919 * i) % 2**62)


async def _run(
    svc: TrainingService, inference: Inference, who: str, target: Target, jobs: list[SampleJob]
) -> list[SampleOutput]:
    """Queue the jobs as one op and wait for its outputs (503 if the worker dies or the service drains).
    A checkpoint's files are hashed first, on a pool thread, not on the device worker that loads them."""
    if target.ref is not None and not inference.cached(who, target):
        await prompts.off_loop(lambda: svc.verify_checkpoint(who, target.ref.path))
    rec = inference.submit(who, target, jobs)
    try:
        while not await svc.futures.wait(rec, 1.0):
            if svc.futures.held:
                raise ApiError("openrl-service is shutting down; send the request again once it is back")
            svc.engine.require_alive()
        if rec.error is not None:
            raise rec.error
        return rec.result
    finally:
        svc.futures.drop(rec)


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


def _fingerprint(svc: TrainingService) -> str:
    return f"openrl-{svc.settings.sampler}"


def _json(data: Any) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")


def _stream(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        chunks,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


# -- models -------------------------------------------------------------------------------------
def _model_card(target: Target, svc: TrainingService) -> dict:
    base = target.model.base
    card = {"id": target.id, "object": "model", "created": 0, "owned_by": "openrl-service"}
    if target.ref is not None:
        card.update(root=target.ref.path, parent=base.name)
    card["max_model_len"] = target.context_length
    return card


def _models(svc: TrainingService, who: str) -> list[dict]:
    """Base models first, then the caller's checkpoints newest first (at most 1,000)."""
    data = [
        {
            "id": m.name,
            "object": "model",
            "created": 0,
            "owned_by": "openrl-service",
            "max_model_len": m.base.context_length,
        }
        for m in svc.models.values()
    ]
    found = [m for run in svc.store.list_runs(who) for m in svc.store.list_checkpoints(who, run["run_id"])]
    found.sort(key=lambda m: (m.get("created_at") or 0, m["tinker_path"]), reverse=True)
    for m in found[:1000]:
        data.append(
            {
                "id": m["tinker_path"],
                "object": "model",
                "created": int(m.get("created_at") or 0),
                "owned_by": who,
                "root": m["tinker_path"],
                "parent": m.get("base_model"),
            }
        )
    return data
