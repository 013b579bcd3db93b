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

import asyncio
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

from openrl_service.api import chat
from openrl_service.api.http import read_json, tenant
from openrl_service.api.openai_replies import (
    Decoded,
    chat_chunks,
    chat_logprobs,
    completion_choices,
    completion_chunks,
    sse,
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
        if body.get("functions") or body.get("function_call"):
            field = "functions" if body.get("functions") else "function_call"
            raise UserError(f"{field} is OpenAI's deprecated form: send tools and tool_choice", field=field)
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
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": target.id}
        if body.get("stream") and k is None:
            live = Live(jobs)
            rec = await _submit(svc, inference, who, target, live.jobs)
            return _stream(_live_completions(svc, head, live, rec, n, tok, echo, _include_usage(body)))
        outs = await _run(svc, inference, who, target, jobs)
        # detokenising thousands of choices is work too: off the event loop
        choices, completion_tokens = await prompts.off_loop(
            lambda: completion_choices(jobs, outs, tok, n, k, echo)
        )
        usage = usage_of(sum(len(j.prompt) for j in jobs), completion_tokens)
        if body.get("stream"):
            return _stream(completion_chunks(head, choices, usage, tok, _include_usage(body)))
        for c in choices:
            c.pop("_decoded")
            c.pop("_prefix")
        return _json({**head, "choices": choices, "usage": usage, "system_fingerprint": _fingerprint(svc)})

    @r.post("/chat/completions", operation_id=op_id("chat_completions"))
    async def chat_completions(request: Request):
        """Chat: ``messages`` through the model's chat template, ``tools`` + ``tool_choice`` (auto, none,
        required, a named function; calls come back as ``tool_calls``), ``n``, ``max_tokens`` /
        ``max_completion_tokens`` (default: as many as fit), ``temperature``, ``top_p``, ``stop``,
        ``seed``, ``logprobs`` + ``top_logprobs`` (0-20), ``stream`` (tokens as they are decoded)."""
        body = await read_json(request, max_body)
        who = tenant(request)
        target = await run_in_threadpool(inference.resolve, who, body.get("model"))
        base = target.model.base
        tok = base.tokenizer
        params, n = _params(body, svc, target, chat=True)
        k = _logprobs_k(body, True, svc.limits.max_topk)
        messages = chat.openai_messages(body.get("messages"))
        tools = chat.checked_tools(body.get("tools"))
        mode, name = chat.tool_choice(body.get("tool_choice"), tools)
        if not getattr(tok, "chat_template", None):
            raise UserError(
                f"model: {base.name} has no chat template; use /completions with a prompt", field="model"
            )
        if body.get("stream") and k is not None and tools and mode != "none":
            raise UserError(
                "logprobs: a streamed reply with tools carries no logprobs here; leave one out",
                field="logprobs",
            )
        prompts.check_messages(base, messages, "messages")
        prompts.check_text(base, len(orjson.dumps(tools)), "tools")
        prompt = await prompts.off_loop(lambda: chat.render(base, messages, tools, mode, name))
        job = inference.check(
            target,
            prompt.tokens,
            n,
            SampleJob(
                prompt=prompt.tokens, num_samples=n, params=params, adapter=None, topk_sample_logprobs=k or 0
            ),
            prompt_field="messages",
        )
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": target.id}
        if body.get("stream"):
            head["object"] = "chat.completion.chunk"
            if k is None:
                live = Live([job])
                rec = await _submit(svc, inference, who, target, live.jobs)
                return _stream(_live_chat(svc, head, live, rec, prompt, n, tok, _include_usage(body)))
            (out,) = await _run(svc, inference, who, target, [job])
            decoded = await prompts.off_loop(
                lambda: [Decoded(seq, tok, job.params, k) for seq in out.sequences]
            )
            usage = usage_of(len(prompt.tokens), sum(d.generated for d in decoded))
            return _stream(chat_chunks(head, decoded, usage, tok, k, _include_usage(body)))
        (out,) = await _run(svc, inference, who, target, [job])
        decoded = await prompts.off_loop(lambda: [Decoded(seq, tok, job.params, k) for seq in out.sequences])
        usage = usage_of(len(prompt.tokens), sum(d.generated for d in decoded))
        choices = await prompts.off_loop(
            lambda: [_chat_choice(j, d, prompt, tok, k) for j, d in enumerate(decoded)]
        )
        return _json({**head, "choices": choices, "usage": usage, "system_fingerprint": _fingerprint(svc)})

    return r


def _seeded(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th prompt's seed (prompts of one call draw differently, as the notebook API's do)."""
    return dataclasses.replace(params, seed=(params.seed + 7_919 * i) % 2**62)


async def _submit(
    svc: TrainingService, inference: Inference, who: str, target: Target, jobs: list[SampleJob]
):
    """Queue the jobs as one op (a full queue is a 429 here, before any reply is sent). A checkpoint's
    files are hashed first, on a pool thread, not on the device worker that loads them."""
    if target.ref is not None and not inference.cached(who, target):
        await prompts.off_loop(lambda: svc.verify_checkpoint(who, target.ref.path))
    return inference.submit(who, target, jobs)


async def _wait(svc: TrainingService, rec) -> list[SampleOutput]:
    """The op's outputs (503 if the worker dies or the service drains)."""
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


async def _run(
    svc: TrainingService, inference: Inference, who: str, target: Target, jobs: list[SampleJob]
) -> list[SampleOutput]:
    """Queue the jobs as one op and wait for its outputs."""
    return await _wait(svc, await _submit(svc, inference, who, target, jobs))


class Live:
    """Tokens as the sampler chooses them, for a streamed reply: each job's ``on_token`` puts
    (job, row, token) on a queue the reply's generator reads on the event loop."""

    def __init__(self, jobs: list[SampleJob]):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.jobs = [dataclasses.replace(j, on_token=self._hook(i)) for i, j in enumerate(jobs)]

    def _hook(self, i: int):
        def on_token(row: int, token: int) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, row, token))

        return on_token

    async def tokens(self, svc: TrainingService, rec) -> AsyncIterator[list[tuple[int, int, int]]]:
        """Batches of (job, row, token) as they come, until the op is done; then ``self.outputs``."""
        done = asyncio.ensure_future(_wait(svc, rec))
        try:
            while True:
                getter = asyncio.ensure_future(self.queue.get())
                finished, _ = await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in finished:
                    getter.cancel()
                    break
                batch = [getter.result()]
                while not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                yield batch
            rest = []
            while not self.queue.empty():
                rest.append(self.queue.get_nowait())
            if rest:
                yield rest
            self.outputs = done.result()
        finally:
            done.cancel()

    async def texts(
        self, svc: TrainingService, rec, gates: dict
    ) -> AsyncIterator[tuple[tuple[int, int], str]]:
        """((job, row), new text) as tokens arrive, each row's text through its ``gates[(job, row)]``
        (a chat.LiveText); a long row's text is decoded off the event loop. Then ``self.outputs``."""
        async for batch in self.tokens(svc, rec):
            touched: list[tuple[int, int]] = []
            for i, row, token in batch:
                gates[(i, row)].add(token)
                if (i, row) not in touched:
                    touched.append((i, row))
            for key in touched:
                gate = gates[key]
                text = await prompts.off_loop(gate.ready) if len(gate.tokens) > 256 else gate.ready()
                if text:
                    yield key, text


def stream_error(e: BaseException) -> bytes:
    """An error after the reply began (OpenAI's shape, as its SDK reads it from the stream)."""
    if isinstance(e, ApiError):
        return sse(error_payload(e.status_code, e.message, e.field))
    return sse(error_payload(500, f"sampling failed: {type(e).__name__}", None))


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


# -- chat replies -----------------------------------------------------------------------------------
def _tool_calls(calls: list, with_index: bool = False) -> list[dict]:
    return [
        {
            **({"index": i} if with_index else {}),
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments_json()},
        }
        for i, c in enumerate(calls)
    ]


def _chat_choice(j: int, d: Decoded, prompt: chat.ChatPrompt, tok: Any, k: int | None) -> dict:
    content, calls, finish = chat.reply_parts(d.text, d.finish_reason, prompt)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = _tool_calls(calls)
    return {
        "index": j,
        "message": message,
        "logprobs": None if k is None else chat_logprobs(d, tok),
        "finish_reason": finish,
    }


async def _live_chat(
    svc: TrainingService,
    head: dict,
    live: Live,
    rec,
    prompt: chat.ChatPrompt,
    n: int,
    tok: Any,
    with_usage: bool,
) -> AsyncIterator[bytes]:
    """Each choice's content as it is decoded (what may yet be a stop string or a tool call held
    back), then its tool calls, its finish_reason, usage and [DONE]; an error mid-reply as an event."""
    params = live.jobs[0].params

    def chunk(j: int, delta: dict, finish: str | None = None) -> bytes:
        return sse(
            {**head, "choices": [{"index": j, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        )

    gates = {(0, j): chat.LiveText(tok, params, prompt) for j in range(n)}
    for j in range(n):
        yield chunk(j, {"role": "assistant", "content": ""})
    try:
        async for (_, j), text in live.texts(svc, rec, gates):
            yield chunk(j, {"content": text})
        (out,) = live.outputs
        decoded = await prompts.off_loop(lambda: [Decoded(seq, tok, params, None) for seq in out.sequences])
        for j, d in enumerate(decoded):
            content, calls, finish = chat.reply_parts(d.text, d.finish_reason, prompt)
            rest = gates[(0, j)].rest(content or "")
            if rest:
                yield chunk(j, {"content": rest})
            if calls:
                yield chunk(j, {"tool_calls": _tool_calls(calls, with_index=True)})
            yield chunk(j, {}, finish)
        if with_usage:
            usage = usage_of(len(prompt.tokens), sum(d.generated for d in decoded))
            yield sse({**head, "choices": [], "usage": usage})
    except Exception as e:  # noqa: BLE001 - the reply has begun: the error goes in the stream
        yield stream_error(e)
    yield b"data: [DONE]\n\n"


async def _live_completions(
    svc: TrainingService, head: dict, live: Live, rec, n: int, tok: Any, echo: bool, with_usage: bool
) -> AsyncIterator[bytes]:
    """Each choice's text as it is decoded (after its echoed prompt), then finish reasons, usage, [DONE]."""

    def chunk(index: int, text: str, finish: str | None = None) -> bytes:
        return sse(
            {**head, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}
        )

    jobs = live.jobs
    gates = {(i, r): chat.LiveText(tok, job.params, None) for i, job in enumerate(jobs) for r in range(n)}
    if echo:
        for i, job in enumerate(jobs):
            text = await prompts.off_loop(lambda job=job: tok.decode(job.prompt, skip_special_tokens=True))
            for r in range(n):
                yield chunk(i * n + r, text)
    try:
        async for (i, row), text in live.texts(svc, rec, gates):
            yield chunk(i * n + row, text)
        completion_tokens = 0
        for i, (job, out) in enumerate(zip(jobs, live.outputs, strict=True)):
            for r, seq in enumerate(out.sequences):
                d = await prompts.off_loop(lambda seq=seq, job=job: Decoded(seq, tok, job.params, None))
                completion_tokens += d.generated
                rest = gates[(i, r)].rest(d.text)
                if rest:
                    yield chunk(i * n + r, rest)
                yield chunk(i * n + r, "", d.finish_reason)
        if with_usage:
            usage = usage_of(sum(len(j.prompt) for j in jobs), completion_tokens)
            yield sse({**head, "choices": [], "usage": usage})
    except Exception as e:  # noqa: BLE001 - the reply has begun: the error goes in the stream
        yield stream_error(e)
    yield b"data: [DONE]\n\n"
