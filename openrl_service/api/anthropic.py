"""The Anthropic Messages API at ``<service>/anthropic/api`` (where hosted Tinker serves it, so the
``anthropic`` SDK and Claude Code run on a checkpoint): ``POST /v1/messages`` (text and ``tool_use`` blocks,
``stop_reason``, the SSE event stream the SDK parses) and ``POST /v1/messages/count_tokens``.

A request becomes the same chat as the equivalent ``/v1/chat/completions`` request (api/chat.py): the
same messages, tools and tokens, the same model names and tenancy (another tenant's checkpoint is a
404), sampled by the same engine. Keys come as ``x-api-key`` (Claude Code's ``ANTHROPIC_API_KEY``) or
``Authorization: Bearer`` (the SDK's ``ANTHROPIC_AUTH_TOKEN``). Sampling fields the SDK has no argument
for (``temperature``, ``top_p``, ``top_k``, ``seed``) are read from the body (``extra_body``). Errors use
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from openrl_service.api import chat
from openrl_service.api.http import read_json, tenant
from openrl_service.api.openai import Live, OpenAIRoute, _params, _run, _submit
from openrl_service.api.openai_replies import Decoded
from openrl_service.engine import prompts
from openrl_service.engine.inference import Inference
from openrl_service.engine.service import TrainingService
from openrl_service.errors import ApiError, UserError
from openrl_service.sampling.base import SampleJob

PREFIX = "/anthropic/api"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def is_anthropic_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str, retry_after_s: float | None = None) -> Response:
    resp = Response(orjson.dumps(error_body(status, message)), status, media_type="application/json")
    if retry_after_s is not None:  # 429 and 503: the SDK waits this long before its retry
        resp.headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return resp


# -- the request as a chat ------------------------------------------------------------------------
def openai_form(body: dict) -> tuple[list[dict], list[dict], Any]:
    """(messages, tools, tool_choice) in OpenAI's form: what the equivalent /v1 request sends."""
    messages: list[dict] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": chat.text_of(system, "system")})
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise UserError("messages must be a non-empty list of {role, content}", field="messages")
    for i, m in enumerate(items):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise UserError(f"{where} must be {{role: user|assistant, content}}", field=where)
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise UserError(f"{where}.content must be a string or a list of blocks", field=f"{where}.content")
        text, calls, results = [], [], []
        for j, block in enumerate(content):
            bw = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise UserError(
                        f"{bw}: a tool_use block needs a string name and an object input", field=bw
                    )
                calls.append(
                    {
                        "id": str(block.get("id") or f"toolu_{i}_{j}"),
                        "type": "function",
                        # as the equivalent OpenAI request sends them: a JSON string
                        "function": {"name": block["name"], "arguments": _json_text(block.get("input", {}))},
                    }
                )
            elif kind == "tool_result" and m["role"] == "user":
                result = block.get("content", "")
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": chat.text_of(result, f"{bw}.content"),
                    }
                )
            else:
                raise UserError(
                    f"{bw}: type {kind!r} is not supported here (text; tool_use from the assistant; "
                    f"tool_result from the user)",
                    field=bw,
                )
        if m["role"] == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
        else:
            messages.extend(results)
            if text or not results:
                messages.append({"role": "user", "content": "".join(text)})
    tools = []
    raw_tools = body.get("tools")
    if raw_tools is not None:
        if not isinstance(raw_tools, list):
            raise UserError("tools must be a list of {name, description, input_schema}", field="tools")
        for i, t in enumerate(raw_tools):
            if not isinstance(t, dict):
                raise UserError(
                    f"tools[{i}] must be {{name, description, input_schema}}", field=f"tools[{i}]"
                )
            fn: dict[str, Any] = {"name": t.get("name")}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            fn["parameters"] = t.get("input_schema")
            tools.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "none"):
            choice = kind
        elif kind == "any":
            choice = "required"
        else:
            raise UserError(
                "tool_choice must be {type: auto|any|tool|none} (tool: with a name)", field="tool_choice"
            )
    return messages, tools, choice


def _json_text(value: Any) -> str:
    """JSON as the chat template's ``tojson`` writes it (and ``json.dumps`` with ensure_ascii off)."""
    return json.dumps(value, ensure_ascii=False)


def _sampling_body(body: dict) -> dict:
    """The OpenAI-form sampling fields of an Anthropic body (``max_tokens`` is required there)."""
    if body.get("max_tokens") is None:
        raise UserError("max_tokens is required (the most tokens to generate)", field="max_tokens")
    out = {
        k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "seed") if body.get(k) is not None
    }
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise UserError("stop_sequences must be a list of non-empty strings", field="stop_sequences")
        out["stop"] = stops
    return out


# -- the router -----------------------------------------------------------------------------------
def build_anthropic_router(svc: TrainingService, inference: Inference) -> APIRouter:
    r = APIRouter(prefix=PREFIX, route_class=OpenAIRoute, tags=["anthropic"])
    max_body = svc.limits.max_body_bytes

    async def prepared(request: Request, sampling: bool):
        body = await read_json(request, max_body)
        who = tenant(request)
        target = await run_in_threadpool(inference.resolve, who, body.get("model"))
        base = target.model.base
        if not getattr(base.tokenizer, "chat_template", None):
            raise UserError(f"model: {base.name} has no chat template", field="model")
        params = None
        if sampling:
            try:
                params, _ = _params(_sampling_body(body), svc, target, chat=True)
            except UserError as e:
                if e.field == "stop":  # the limit on how many, under its Anthropic name
                    raise UserError(
                        e.message.replace("stop", "stop_sequences", 1), field="stop_sequences"
                    ) from None
                raise
        messages, raw_tools, raw_choice = openai_form(body)
        messages = chat.openai_messages(messages)
        tools = chat.checked_tools(raw_tools)
        mode, name = chat.tool_choice(raw_choice, tools)
        prompts.check_messages(base, messages, "messages")
        prompts.check_text(base, len(orjson.dumps(tools)), "tools")
        prompt = await prompts.off_loop(lambda: chat.render(base, messages, tools, mode, name))
        return body, who, target, params, prompt

    @r.post("/v1/messages/count_tokens", operation_id="anthropic_count_tokens")
    async def count_tokens(request: Request):
        """The prompt's tokens for these messages, system prompt and tools (what ``usage.input_tokens``
        of the same /v1/messages request reports)."""
        _, _, _, _, prompt = await prepared(request, sampling=False)
        return Response(orjson.dumps({"input_tokens": len(prompt.tokens)}), media_type="application/json")

    @r.post("/v1/messages", operation_id="anthropic_messages")
    async def messages(request: Request):
        """A message: ``model``, ``max_tokens``, ``messages``, ``system``, ``tools`` + ``tool_choice``,
        ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stream``."""
        body, who, target, params, prompt = await prepared(request, sampling=True)
        job = inference.check(
            target,
            prompt.tokens,
            1,
            SampleJob(prompt=prompt.tokens, num_samples=1, params=params, adapter=None),
            prompt_field="messages",
        )
        head = {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": target.id,
        }
        if body.get("stream"):
            live = Live([job])
            rec = await _submit(svc, inference, who, target, live.jobs)
            return StreamingResponse(
                _events(svc, head, live, rec, prompt, target.model.base.tokenizer),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        (out,) = await _run(svc, inference, who, target, [job])
        tok = target.model.base.tokenizer
        reply = await prompts.off_loop(lambda: _reply(out.sequences[0], tok, job, prompt))
        return Response(orjson.dumps({**head, **reply}), media_type="application/json")

    return r


def _stop_sequence(seq, tok: Any, params) -> str | None:
    """The stop sequence that ended the reply, if one did."""
    if seq.stop_reason != "stop" or not params.stop_strings:
        return None
    text = tok.decode(seq.tokens, skip_special_tokens=True)
    found = [(text.find(s), s) for s in params.stop_strings if s in text]
    return min(found)[1] if found else None


def _reply(seq, tok: Any, job: SampleJob, prompt: chat.ChatPrompt) -> dict:
    d = Decoded(seq, tok, job.params, None)
    content, calls, finish = chat.reply_parts(d.text, d.finish_reason, prompt)
    blocks: list[dict] = []
    if content or not calls:
        blocks.append({"type": "text", "text": content or ""})
    blocks += [
        {"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": c.arguments} for c in calls
    ]
    stop_sequence = _stop_sequence(seq, tok, job.params) if finish == "stop" else None
    return {
        "content": blocks,
        "stop_reason": "stop_sequence" if stop_sequence else STOP_REASONS[finish],
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": len(prompt.tokens), "output_tokens": d.generated},
    }


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _event(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


async def _events(
    svc: TrainingService, head: dict, live: Live, rec, prompt: chat.ChatPrompt, tok: Any
) -> AsyncIterator[bytes]:
    """Anthropic's event stream: message_start, the text block's deltas as tokens decode, tool_use
    blocks, message_delta (stop_reason, usage), message_stop; an error mid-reply as an error event."""
    job = live.jobs[0]
    start = {**head, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {"input_tokens": len(prompt.tokens), "output_tokens": 0}
    yield _event("message_start", {"message": start})
    gate = chat.LiveText(tok, job.params, prompt)
    text_open = False
    try:
        async for _, new in live.texts(svc, rec, {(0, 0): gate}):
            if not text_open:
                yield _event(
                    "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
                )
                text_open = True
            yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": new}})
        (out,) = live.outputs
        reply = await prompts.off_loop(lambda: _reply(out.sequences[0], tok, job, prompt))
        index = 0
        if text_open and not any(b["type"] == "text" for b in reply["content"]):
            yield _event("content_block_stop", {"index": 0})
            index = 1
        for block in reply["content"]:
            if block["type"] == "text":
                rest = gate.rest(block["text"])
                if not text_open:
                    yield _event(
                        "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
                    )
                    text_open = True
                if rest:
                    yield _event(
                        "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": rest}}
                    )
                yield _event("content_block_stop", {"index": 0})
                index = 1
                continue
            opened = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            yield _event("content_block_start", {"index": index, "content_block": opened})
            partial = orjson.dumps(block["input"]).decode()
            yield _event(
                "content_block_delta",
                {"index": index, "delta": {"type": "input_json_delta", "partial_json": partial}},
            )
            yield _event("content_block_stop", {"index": index})
            index += 1
        delta = {"stop_reason": reply["stop_reason"], "stop_sequence": reply["stop_sequence"]}
        yield _event(
            "message_delta", {"delta": delta, "usage": {"output_tokens": reply["usage"]["output_tokens"]}}
        )
        yield _event("message_stop", {})
    except Exception as e:  # noqa: BLE001 - the reply has begun: the error goes in the stream
        status = e.status_code if isinstance(e, ApiError) else 500
        message = e.message if isinstance(e, ApiError) else f"sampling failed: {type(e).__name__}"
        yield _event("error", {"error": error_body(status, message)["error"]})
