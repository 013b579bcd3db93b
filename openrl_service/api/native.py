"""The notebook API (``/openrl/v1``): JSON + Server-Sent Events over the same engine, auth and limits.

    POST   /openrl/v1/runs                          create a run        {name?, base_model?, rank?, seed?, ...}
    GET    /openrl/v1/runs                          the caller's runs (?include=all: its Tinker-SDK runs too)
    GET    /openrl/v1/runs/{run_id}                 one run
    DELETE /openrl/v1/runs/{run_id}                 free it (checkpoints stay)
    POST   /openrl/v1/runs/{run_id}/heartbeat       keep it alive while the notebook is idle {state?}
    POST   /openrl/v1/runs/{run_id}/control         pause / resume / stop a run {action, reason?}
    POST   /openrl/v1/runs/{run_id}/sample          text prompts → completions with sample ids
    POST   /openrl/v1/runs/{run_id}/train_step      sample ids + advantages → loss, ratio/KL/clip stats
    POST   /openrl/v1/runs/{run_id}/sft_step        {prompt, completion} examples → cross-entropy + AdamW
    POST   /openrl/v1/runs/{run_id}/checkpoints     save {name} → tinker:// path the Tinker SDK loads
    GET    /openrl/v1/runs/{run_id}/checkpoints     list
    POST   /openrl/v1/runs/{run_id}/metrics         client-reported metrics of a step (rewards)
    POST   /openrl/v1/render                        chat messages (+ tools) → the template's token ids
    POST   /openrl/v1/decode                        token ids → text
    GET    /openrl/v1/runs/{run_id}/metrics         all of them
    GET    /openrl/v1/events                        SSE: telemetry ticks and run events (schema version 1)

Every POST except heartbeat takes an ``X-Idempotency-Key`` header: re-sent with the same key, it
answers the first reply and does nothing again (see :mod:`openrl_service.api.idempotency`). While the
service drains (SIGTERM) those POSTs answer 503 + Retry-After, and event streams end once it has
drained (see :mod:`openrl_service.lifecycle`).
The OpenAPI schema is served at /openapi.json.
"""

from __future__ import annotations

import asyncio
import contextlib

import anyio
import orjson
from fastapi import APIRouter, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent

from openrl_service.api import chat
from openrl_service.api import links as L
from openrl_service.api import schemas as S
from openrl_service.api.http import (
    ServiceRoute,
    answers_while_starting,
    json_response,
    new_work,
    read_json,
    read_model,
)
from openrl_service.api.idempotency import idempotent
from openrl_service.api.openapi_bodies import body
from openrl_service.container import Container
from openrl_service.engine import prompts
from openrl_service.engine.catalog import Catalog
from openrl_service.engine.job_checks import JOB_META_KEY
from openrl_service.errors import UserError
from openrl_service.lifecycle import State

TICK_S = 1.0


def build_native_router(c: Container) -> APIRouter:
    svc, native = c.service, c.native
    r = APIRouter(
        prefix="/openrl/v1",
        tags=["native"],
        route_class=ServiceRoute,
        generate_unique_id_function=S.operation_ids("native"),
    )
    cat = Catalog(svc)
    max_body = svc.limits.max_body_bytes
    B = S.bodies(svc.limits, svc.settings.min_ttl_s)
    replies = native.replies

    def tenant(request: Request) -> str:
        return request.state.tenant

    def job_of(request: Request) -> str | None:
        """The job whose key made the request (engine/jobs.py), else None."""
        return getattr(request.state, "job_id", None)

    async def once(request: Request, make):
        """``make()``, or the first reply of this request's X-Idempotency-Key."""
        return await idempotent(replies, request, tenant(request), make)

    async def post(request: Request, run_id: str, op, model, status: int = 200):
        """An idempotent POST on a run: ``op(tenant, run_id, body, identity)`` as JSON, ``body`` the
        fields of ``model`` that were given."""

        async def make(identity):
            given = (await read_model(request, model, max_body)).model_dump(exclude_none=True)
            out = await op(tenant(request), run_id, given, identity)
            return json_response(out, status=status)

        return await once(request, make)

    @r.post(
        "/runs",
        status_code=201,
        openapi_extra=body(B.CreateRun, required=False),
        responses=L.CREATE_RUN_LINKS,
    )
    @new_work
    async def create_run(request: Request):
        """Create a LoRA run on the served model (defaults from its capability entry)."""

        async def make(identity):
            given = (await read_model(request, B.CreateRun, max_body)).model_dump(exclude_none=True)
            out = await native.create(tenant(request), given, identity, job=job_of(request))
            return json_response(out, status=201)

        return await once(request, make)

    @r.get("/runs")
    async def list_runs(request: Request, include: str | None = None):
        """The caller's live notebook runs; ``?include=all`` adds its Tinker-SDK training runs. Each
        with its control state, last activity, orphaned, last reward / loss and device share."""
        if include not in (None, "all"):
            raise UserError(f"include must be 'all' (or absent); got {include[:100]!r}", field="include")
        runs = native.list(tenant(request), include_all=include == "all")
        if job_of(request) is not None:  # a job's key sees the job's runs only
            runs = [e for e in runs if e["user_metadata"].get(JOB_META_KEY) == job_of(request)]
        return json_response({"runs": runs})

    @r.get("/runs/{run_id}")
    async def get_run(run_id: str, request: Request):
        """One run: name, model, rank, step, control... (a Tinker-SDK run of the caller too)."""
        return json_response(native.entry(tenant(request), run_id))

    @r.post("/runs/{run_id}/heartbeat", openapi_extra=body(B.Heartbeat, required=False))
    async def heartbeat(run_id: str, request: Request):
        """Keep the run alive (no request for ``idle_timeout_s`` finishes it); ``{"state"}`` reports
        the notebook Run's state. Answers the run, with its control state for the notebook to obey."""
        given = (await read_model(request, B.Heartbeat, max_body)).model_dump(exclude_none=True)
        return json_response(native.describe(native.heartbeat(tenant(request), run_id, given)))

    @r.post("/runs/{run_id}/control", openapi_extra=body(B.Control))
    async def control(run_id: str, request: Request):
        """Pause, resume or stop a run, notebook or Tinker SDK (the side panel's buttons); answers
        its entry. A notebook run obeys at its next step; a Tinker-SDK run's next op is refused."""
        given = (await read_model(request, B.Control, max_body)).model_dump(exclude_none=True)
        return json_response(native.control(tenant(request), run_id, given))

    @r.delete("/runs/{run_id}")
    async def delete_run(run_id: str, request: Request):
        """Free a run's adapter and optimizer; its checkpoints stay."""
        await native.delete(tenant(request), run_id)
        return json_response({"run_id": run_id, "deleted": True})

    @r.post("/runs/{run_id}/sample", openapi_extra=body(B.NativeSample), responses=L.NATIVE_SAMPLE_LINKS)
    @new_work
    async def sample(run_id: str, request: Request):
        """Completions of text prompts from the run's current weights, each with a sample id."""
        return await post(request, run_id, native.sample, B.NativeSample)

    @r.post("/runs/{run_id}/train_step", openapi_extra=body(B.TrainStep))
    @new_work
    async def train_step(run_id: str, request: Request):
        """One RL step over named samples and their advantages: loss + AdamW."""
        return await post(request, run_id, native.train_step, B.TrainStep)

    @r.post("/runs/{run_id}/sft_step", openapi_extra=body(B.SftStep))
    @new_work
    async def sft_step(run_id: str, request: Request):
        """One supervised step (a warm start): cross-entropy on prompt/completion pairs + AdamW."""
        return await post(request, run_id, native.sft_step, B.SftStep)

    @r.post(
        "/runs/{run_id}/checkpoints",
        status_code=201,
        openapi_extra=body(B.SaveCheckpoint),
        responses=L.NATIVE_SAVE_LINKS,
    )
    @new_work
    async def save(run_id: str, request: Request):
        """Save weights + optimizer; the path loads with the Tinker SDK."""
        return await post(request, run_id, native.save_checkpoint, B.SaveCheckpoint, status=201)

    @r.get("/runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str, request: Request):
        """The run's checkpoints, newest first."""
        native.get(tenant(request), run_id)
        listing = await anyio.to_thread.run_sync(cat.list_checkpoints, tenant(request), run_id)  # reads disk
        return json_response(listing)

    @r.post(
        "/runs/{run_id}/metrics",
        status_code=201,
        openapi_extra=body(B.AddMetrics),
    )
    @new_work
    async def add_metrics(run_id: str, request: Request):
        """Store client-side metrics of a step (reward mean/std/min/max, reward name and version...)."""
        return await post(request, run_id, native.add_metrics, B.AddMetrics, status=201)

    @r.get("/runs/{run_id}/metrics")
    async def get_metrics(run_id: str, request: Request):
        """Every metrics row stored for the run (none for a Tinker-SDK run: its client keeps them; a
        job's ended run: the rows kept with it)."""
        return json_response({"metrics": native.metrics(tenant(request), run_id)})

    @r.post("/render")
    async def render(request: Request):
        """Chat messages (and tools) as the model's chat template renders them, for an environment's
        next observation: ``{model?, messages, tools?, add_generation_prompt?}`` → ``{tokens,
        stop_tokens, tool_family}``. The same rendering as /v1/chat/completions."""
        body = await read_json(request, max_body)
        base = svc.served(body.get("model"), "model").base
        messages = chat.openai_messages(body.get("messages"))
        tools = chat.checked_tools(body.get("tools"))
        prompts.check_messages(base, messages, "messages")
        prompts.check_text(base, len(orjson.dumps(tools)), "tools")
        prompt = await prompts.off_loop(
            lambda: chat.render(base, messages, tools, "auto" if tools else "none", None)
        )
        return json_response(
            {
                "tokens": prompt.tokens,
                "stop_tokens": list(base.eos_token_ids),
                "tool_family": base.tool_family,
            }
        )

    @r.post("/decode")
    async def decode(request: Request):
        """Token ids as text: ``{model?, tokens}`` → ``{text}`` (special tokens kept, as sampled)."""
        body = await read_json(request, max_body)
        base = svc.served(body.get("model"), "model").base
        tokens = body.get("tokens")
        if (
            not isinstance(tokens, list)
            or len(tokens) > base.context_length
            or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < base.vocab_size for t in tokens
            )
        ):
            raise UserError(
                f"tokens must be a list of at most {base.context_length} token ids in [0, {base.vocab_size})",
                field="tokens",
            )
        text = await prompts.off_loop(lambda: base.tokenizer.decode(tokens, skip_special_tokens=False))
        return json_response({"text": text})

    @r.get("/events", response_class=EventSourceResponse)
    @answers_while_starting  # a stream of live ticks: what recovery restores shows in the next one
    async def events(request: Request):
        """Server-Sent Events: a telemetry tick every second plus run events, each with a schema version."""
        who = tenant(request)
        queue = native.events.subscribe(who)
        still = getattr(request.state, "still_authorised", None)
        ended = ServerSentEvent(
            event="error",
            raw_data=orjson.dumps(
                {
                    "error": "the credential of this stream no longer works (revoked, expired, or its user is gone)"
                }
            ).decode(),
        )
        try:
            yield ServerSentEvent(retry=2000)
            loop = asyncio.get_running_loop()
            next_tick = loop.time()
            while True:
                wait = next_tick - loop.time()
                if wait > 0:
                    with contextlib.suppress(asyncio.TimeoutError):
                        event = await asyncio.wait_for(queue.get(), timeout=wait)
                        if still is not None and not await still():
                            yield ended
                            return
                        yield ServerSentEvent(event="run", raw_data=orjson.dumps(event).decode())
                        continue
                next_tick = loop.time() + TICK_S  # ticks keep their pace however busy the runs are
                if still is not None and not await still():
                    yield ended
                    return
                yield ServerSentEvent(event="tick", raw_data=orjson.dumps(native.tick(who)).decode())
                if await request.is_disconnected() or stopped(request):
                    return
        finally:
            native.events.unsubscribe(queue)

    return r


def stopped(request: Request) -> bool:
    """The service has drained and is closing: streams end so its connections can close."""
    lifecycle = getattr(request.app.state, "lifecycle", None)
    return lifecycle is not None and lifecycle.state is State.STOPPED
