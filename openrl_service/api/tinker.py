"""The Tinker wire protocol (``/api/v1``): JSON and protobuf in, futures out, results by long-poll.

Conventions the SDK depends on (see docs/architecture.md):
- permanent errors at submit time are 400/404 with a JSON body naming the field;
- failures *of the work* come back from ``retrieve_future`` as ``{"error", "category"}``;
- forward/backward and sample results are protobuf when the client accepts it;
- ``retrieve_future`` holds the request up to ``long_poll_s`` before answering ``try_again``, whose
  ``queue_state`` is ``paused_capacity`` (with a ``queue_state_reason`` naming the limit) while the
  request waits behind more than its run's queue limit, else ``active``: the SDK logs the pause and
  keeps polling, and the request runs once, in order;
- a sample request over a queue limit is refused with 429, ``Retry-After`` (and ``retry-after-ms``)
  and a JSON error naming the limit; nothing was queued, so the SDK's resubmission is safe;
- while the service drains (SIGTERM), every route marked ``@new_work`` answers 503 + ``Retry-After``
  and ``retrieve_future`` keeps answering (``try_again`` until the op has run; see lifecycle.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from google.protobuf.message import DecodeError
from starlette.concurrency import run_in_threadpool

from openrl_service import progress
from openrl_service.api import links as L
from openrl_service.api import proto
from openrl_service.api import schemas as S
from openrl_service.api.codec import PROTO, decode_datums, encode_result, loss_config
from openrl_service.api.http import (
    ServiceRoute,
    answers_while_starting,
    json_response,
    new_work,
    parse,
    read_body,
    read_model,
    read_op,
    tenant,
)
from openrl_service.api.openapi_bodies import PROTOBUF_BODY, body
from openrl_service.engine.job_checks import check_unlabelled
from openrl_service.engine.service import TrainingService
from openrl_service.engine.stability import spans_of
from openrl_service.errors import NotFound, UserError
from openrl_service.training.optim_params import optim_params, optimizer_kind

# api/native.py still imports these from here; the merge points it at api.http and drops this line.
__all__ = ["build_router", "health"]

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}


def build_router(svc: TrainingService) -> APIRouter:
    r = APIRouter(
        prefix="/api/v1", route_class=ServiceRoute, generate_unique_id_function=S.operation_ids("tinker")
    )
    max_body = svc.limits.max_body_bytes
    B = S.bodies(svc.limits, svc.settings.min_ttl_s)

    def idem(request: Request) -> str | None:
        return request.headers.get("x-idempotency-key")

    # -- bootstrap and sessions ----------------------------------------------------------------
    @r.post("/client/config")
    @answers_while_starting
    async def client_config(request: Request):
        """Flags the SDK reads at start-up."""
        return json_response(CLIENT_CONFIG)

    @r.post("/client/dynamic_config")
    @answers_while_starting
    async def dynamic_config(request: Request):
        """Flags the SDK re-reads periodically."""
        return json_response(
            {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}
        )

    @r.post("/create_session", openapi_extra=body(B.CreateSession), responses=L.CREATE_SESSION_LINKS)
    @new_work
    async def create_session(request: Request):
        """Start a session (one ServiceClient)."""
        b = await read_model(request, B.CreateSession, max_body)
        sess = await run_in_threadpool(  # writes (and fsyncs) the session record
            svc.create_session,
            tenant(request),
            tags=b.tags,
            user_metadata=unlabelled(b.user_metadata),
            display_name=b.display_name,
            project_id=b.project_id,
        )
        return json_response({"type": "create_session", "session_id": sess.session_id})

    @r.post("/session_heartbeat", openapi_extra=body(B.SessionHeartbeat))
    @answers_while_starting
    async def heartbeat(request: Request):
        """Keep a session alive; 410 once it is finished."""
        session_id = (await read_model(request, B.SessionHeartbeat, max_body)).session_id
        if coming_up(request) and session_id not in svc.sessions:
            return json_response({"type": "session_heartbeat"})  # restarting: it may be recovered yet
        if not svc.heartbeat(tenant(request), session_id):
            return json_response({"error": "session is finished", "category": "user"}, status=410)
        return json_response({"type": "session_heartbeat"})

    @r.post("/sessions/{session_id}/finish", openapi_extra=body(B.Finish, required=False))
    async def finish(session_id: str, request: Request):
        """End a session; its runs and samplers leave device memory, checkpoints stay."""
        b = await read_model(request, B.Finish, max_body)
        reason = (b.reason and b.reason.type) or "success"
        await run_in_threadpool(  # writes (and fsyncs) the session record
            svc.finish_session, tenant(request), session_id, reason=reason
        )
        return json_response({"type": "session_finish", "session_id": session_id})

    @r.post("/telemetry")
    @answers_while_starting
    async def telemetry(request: Request):
        """Accept (and drop) SDK telemetry."""
        return json_response({"status": "accepted"})

    @r.get("/get_server_capabilities")
    async def capabilities(request: Request):
        """The served model, its context length and RL defaults."""
        return json_response({"supported_models": svc.capabilities()})

    # -- training ------------------------------------------------------------------------------
    @r.post("/create_model", openapi_extra=body(B.CreateModel), responses=L.CREATE_MODEL_LINKS)
    @new_work
    async def create_model(request: Request):
        """Create a training run (LoRA; rank 0: a full fine-tune); future → {model_id}."""
        b = await read_model(request, B.CreateModel, max_body)
        lora = b.lora_config or B.LoraConfig()
        spec = svc.checks.lora_spec(
            32 if lora.rank is None else lora.rank,
            lora.train_attn is not False,
            lora.train_mlp is not False,
            lora.train_unembed is not False,
            optimizer=optimizer_kind(
                b.optimizer_config.model_dump(exclude_none=True) if b.optimizer_config else None
            ),
        )
        rec = svc.create_model(
            tenant(request),
            session_id=b.session_id,
            model_seq_id=b.model_seq_id,
            base_model=b.base_model,
            spec=spec,
            seed=lora.seed,
            user_metadata=unlabelled(b.user_metadata),
            idem=idem(request),
        )
        return json_response(rec.reply())

    @r.post("/get_info", openapi_extra=body(B.ModelId))
    async def get_info(request: Request):
        """A run's model name, LoRA rank and tokenizer id."""
        b = await read_model(request, B.ModelId, max_body)
        return json_response(svc.get_info(tenant(request), b.model_id))

    @r.post("/forward_backward", openapi_extra=PROTOBUF_BODY, responses=L.SUBMIT_LINKS)
    @new_work
    async def forward_backward(request: Request):
        """Protobuf ForwardBackwardRequest; future → protobuf ForwardBackwardOutput."""
        body = await read_body(request, max_body)
        if PROTO not in request.headers.get("content-type", ""):
            raise UserError(f"forward_backward takes a protobuf body (Content-Type: {PROTO})", field="body")
        msg = proto.ForwardBackwardRequest()
        try:
            msg.ParseFromString(body)
        except DecodeError as e:
            raise UserError(f"body is not a valid ForwardBackwardRequest protobuf ({e})", field="body") from e
        if not msg.model_id:
            raise UserError("model_id is required", field="model_id")
        base = svc.base_of_run(tenant(request), msg.model_id)
        try:
            data: Any = decode_datums(
                msg,
                max_n=base.context_length,
                max_k=min(base.vocab_size, svc.limits.max_target_k),
                max_cells=svc.limits.max_request_tokens,
            )
            config = loss_config(msg)
            if msg.loss_fn == "stable_reinforce":  # the sampler's recorded logprobs, by provenance
                run = svc.run(tenant(request), msg.model_id)
                data = await run_in_threadpool(  # up to a span per token: off the event loop
                    svc.stability.resolve, run.tenant, run.session_id, data, [spans_of(d) for d in msg.data]
                )
        except UserError as e:
            data, config = e, {}
        rec = svc.forward_backward(
            tenant(request),
            msg.model_id,
            msg.seq_id,
            data,
            msg.loss_fn or "cross_entropy",
            config,
            msg.forward_only,
            idem(request),
        )
        return json_response(rec.reply())

    @r.post("/optim_step", openapi_extra=body(B.OptimStep), responses=L.SUBMIT_LINKS)
    @new_work
    async def optim_step(request: Request):
        """AdamW or Dimuon step over the run's accumulated gradients; future → {metrics}."""
        body, _ = await read_op(request, B.OptimStep, max_body)
        model_id, seq_id = body["model_id"], body["seq_id"]
        try:
            adam: Any = optim_params(body)
        except UserError as e:
            adam = e
        rec = svc.optim_step(tenant(request), model_id, seq_id, adam, idem(request))
        return json_response(rec.reply())

    @r.post("/save_weights", openapi_extra=body(B.SaveWeights), responses=L.SAVE_WEIGHTS_LINKS)
    @new_work
    async def save_weights(request: Request):
        """save_state: adapter + optimizer under tinker://<run>/weights/<name>."""
        body, _ = await read_op(request, B.SaveWeights, max_body)
        rec = svc.save_state(
            tenant(request),
            body["model_id"],
            body.get("seq_id"),
            body.get("path"),
            flag(body, "overwrite"),
            body.get("user_metadata"),
            idem(request),
            ttl_seconds=body.get("ttl_seconds"),
        )
        return json_response(rec.reply())

    @r.post(
        "/save_weights_external",
        openapi_extra=body(B.SaveWeightsExternal),
        responses=L.SUBMIT_LINKS,
    )
    @new_work
    async def save_weights_external(request: Request):
        """The adapter as a downloadable PEFT folder under tinker://<run>/external_weights/<name>."""
        body, _ = await read_op(request, B.SaveWeightsExternal, max_body)
        rec = svc.save_external(
            tenant(request),
            body["model_id"],
            body.get("seq_id"),
            body.get("path"),
            body.get("ttl_seconds"),
            body.get("age_encryption_recipients"),
            idem(request),
        )
        return json_response(rec.reply())

    @r.post("/load_weights", openapi_extra=body(B.LoadWeights), responses=L.CREATE_MODEL_LINKS)
    @new_work
    async def load_weights(request: Request):
        """load_state (model_id + seq_id) or create-via-load (session_id + model_seq_id)."""
        who = tenant(request)
        body, b = await read_op(request, B.LoadWeights, max_body)
        # hashed here, on a pool thread: the device worker then reads the tensors without hashing them
        await run_in_threadpool(
            svc.verify_checkpoint, who, body.get("path"), optimizer=flag(body, "optimizer") is True
        )
        if body.get("model_id") is None and body.get("session_id") is not None:
            b = parse(B.LoadWeights, body)  # a new run: no slot to keep, the refusal is a 400
            rec = svc.create_from_state(
                who,
                session_id=b.session_id,
                model_seq_id=b.model_seq_id,
                path=b.path,
                optimizer=bool(b.optimizer),
                optimizer_config=b.optimizer_config.model_dump(exclude_none=True)
                if b.optimizer_config
                else None,
                base_model=b.base_model,
                user_metadata=unlabelled(b.user_metadata),
                idem=idem(request),
            )
        else:
            rec = svc.load_state(
                who,
                body["model_id"],
                body["seq_id"],
                body.get("path"),
                flag(body, "optimizer"),
                idem(request),
            )
        return json_response(rec.reply())

    @r.post(
        "/save_weights_for_sampler",
        openapi_extra=body(B.SaveForSampler),
        responses=L.SAVE_FOR_SAMPLER_LINKS,
    )
    @new_work
    async def save_for_sampler(request: Request):
        """Named → tinker://<run>/sampler_weights/<name>; without a name → a new sampling session."""
        body, _ = await read_op(request, B.SaveForSampler, max_body)
        rec = svc.save_for_sampler(
            tenant(request),
            body["model_id"],
            body.get("seq_id"),
            body.get("path"),
            body.get("sampling_session_seq_id"),
            body.get("user_metadata"),
            idem(request),
            ttl_seconds=body.get("ttl_seconds"),
            kind=body.get("kind"),
        )
        return json_response(rec.reply())

    # -- sampling ------------------------------------------------------------------------------
    @r.post(
        "/create_sampling_session",
        openapi_extra=body(B.CreateSamplingSession),
        responses=L.SAMPLING_SESSION_LINKS,
    )
    @new_work
    async def create_sampling_session(request: Request):
        """A sampler on the base model or on a saved sampler checkpoint."""
        b = await read_model(request, B.CreateSamplingSession, max_body)
        sampler_id = await run_in_threadpool(
            svc.create_sampler,
            tenant(request),
            session_id=b.session_id,
            seq_id=b.sampling_session_seq_id,
            base_model=b.base_model,
            model_path=b.model_path,
        )
        if b.model_path is not None:  # hashed here: its first sample loads it on the worker unhashed
            await run_in_threadpool(svc.verify_checkpoint, tenant(request), b.model_path)
        return json_response({"type": "create_sampling_session", "sampling_session_id": sampler_id})

    @r.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        """Which base model and checkpoint a sampler serves."""
        e = svc.sampler_entry(tenant(request), sampler_id)
        out = {"sampler_id": e.sampler_id, "base_model": e.base_model}
        if e.model_path:
            out["model_path"] = e.model_path
        if sampler_id in svc.sample_notices:  # the vLLM sampler handed its last job to torch: why
            out["sampler_notice"] = svc.sample_notices[sampler_id]
        return json_response(out)

    @r.post("/asample", openapi_extra=body(B.ASample), responses=L.SUBMIT_LINKS)
    @new_work
    async def asample(request: Request):
        """Queue a sample request; the reply carries one sequence id per sample."""
        b = await read_model(request, B.ASample, max_body)
        prompt = [t for chunk in b.prompt.chunks for t in chunk.tokens]
        if b.prompt_alt_tokens_k:
            raise UserError(
                "prompt_alt_tokens_k is not supported by this service", field="prompt_alt_tokens_k"
            )
        if b.target_prompt_logprobs is not None:
            raise UserError(
                "target_prompt_logprobs is not supported by this service", field="target_prompt_logprobs"
            )
        await svc.sampler_ready(tenant(request), b.sampling_session_id)  # a save still queued creates it
        params = svc.checks.sampling_params(
            b.sampling_params.model_dump(exclude_none=True) if b.sampling_params else {},
            svc.base_of_sampler(tenant(request), b.sampling_session_id),
        )
        rec = svc.sample(
            tenant(request),
            sampler_id=b.sampling_session_id,
            record_stability_info=bool(b.record_stability_info),
            prompt=prompt,
            num_samples=b.num_samples or 1,
            params=params,
            prompt_logprobs=bool(b.prompt_logprobs),
            topk_prompt_logprobs=b.topk_prompt_logprobs or 0,
            topk_sample_logprobs=b.topk_sample_logprobs or 0,
            idem=idem(request),
        )
        if b.prompt_logprobs_last_n is not None:
            rec.extra.setdefault("_last_n", b.prompt_logprobs_last_n)
        return json_response({k: v for k, v in rec.reply().items() if not k.startswith("_")})

    # -- futures -------------------------------------------------------------------------------
    @r.post("/retrieve_future", openapi_extra=body(B.RequestId), responses=L.RESULT_LINKS)
    @answers_while_starting
    async def retrieve_future(request: Request):
        """Long-poll a future: the result, an error result, or try_again."""
        request_id = (await read_model(request, B.RequestId, max_body)).request_id
        try:
            rec = svc.futures.get(tenant(request), request_id)
        except NotFound:
            if not coming_up(request):
                raise
            # Restarting: the request may be in the journal, about to be replayed. Poll again.
            return json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if not await svc.futures.wait(rec, svc.settings.long_poll_s):
            if not svc.engine.alive and svc.engine.ready.is_set():
                return json_response(
                    {
                        "error": "the service's device worker has stopped; restart the service",
                        "category": "server",
                    }
                )
            state, reason = svc.engine.queue_state(rec)
            reply = {"type": "try_again", "request_id": request_id, "queue_state": state}
            if reason:
                reply["queue_state_reason"] = reason
            return json_response(reply)
        rec.fetched = True  # a draining service waits for this (lifecycle.py)
        if rec.error is not None:
            return json_response(rec.error.to_json())
        wants_proto = PROTO in request.headers.get("accept", "")
        return encode_result(rec, wants_proto)

    @r.get("/healthz")
    @answers_while_starting
    async def api_healthz():
        """Liveness of the worker thread (no key needed)."""
        return health(svc)

    return r


def flag(body: dict, name: str) -> Any:
    """An op's true/false field as sent (null or absent: false); the engine refuses anything else
    in the op's slot."""
    value = body.get(name)
    return False if value is None else value


def unlabelled(meta: Any) -> Any:
    """``user_metadata`` as sent, refused (403) if it claims a job's label (only a job's key gets it)."""
    check_unlabelled(meta)
    return meta


def coming_up(request: Request) -> bool:
    """The service is starting or recovering its journal (see openrl_service.lifecycle)."""
    lifecycle = getattr(request.app.state, "lifecycle", None)
    return lifecycle is not None and lifecycle.coming_up


def health(svc: TrainingService) -> Response:
    """Liveness, from copies (no lock the worker holds): the worker thread exists and, when work is
    waiting, has made progress within OPENRL_HEALTH_STALL_S."""
    engine = svc.engine
    ok = engine.alive or not engine.ready.is_set() and engine.setup_error is None
    if not ok:
        return json_response({"status": "worker thread is dead"}, status=503)
    limit = svc.settings.health_stall_s
    idle = progress.idle_for()
    if limit > 0 and idle > limit and engine.has_work():
        return json_response(
            {
                "status": f"the device worker has made no progress for {idle:.0f} s while work waits "
                f"(OPENRL_HEALTH_STALL_S={limit:g})",
                "running": engine.current.kind if engine.current is not None else None,
            },
            status=503,
        )
    return json_response({"status": "ok", "idle_s": round(idle, 3)}, status=200)
