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
  and a JSON error naming the limit; nothing was queued, so the SDK's resubmission is safe.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
import zstandard
from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from google.protobuf.message import DecodeError
from starlette.concurrency import run_in_threadpool

from openrl_service.api import proto
from openrl_service.engine.scheduler import QueueFull
from openrl_service.engine.service import TrainingService
from openrl_service.errors import PayloadTooLarge, UnsupportedMediaType, UserError
from openrl_service.sampling.base import SampleOutput
from openrl_service.training.trainer import DatumArrays, ForwardResult, adam_params

PROTO = "application/x-protobuf"

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}


def _json_bytes(data: Any) -> bytes:
    return orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)


def json_response(data: Any, status: int = 200) -> Response:
    return Response(_json_bytes(data), status_code=status, media_type="application/json")


def backpressure_response(e: QueueFull) -> Response:
    """429 with the JSON error (naming the limit) and when to retry, in seconds and milliseconds."""
    resp = json_response(e.to_json(), status=429)
    resp.headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
    resp.headers["retry-after-ms"] = str(max(1, round(e.retry_after_s * 1000)))
    return resp


class BackpressureRoute(APIRoute):
    """A route whose :class:`QueueFull` becomes :func:`backpressure_response` (the app-wide error
    handler knows no Retry-After for 429)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except QueueFull as e:
                return backpressure_response(e)

        return route


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


async def read_json(request: Request, max_bytes: int) -> dict:
    body = await read_body(request, max_bytes)
    if body and "json" not in request.headers.get("content-type", "").lower():
        # Also keeps "simple" cross-site form/text posts out: browsers cannot send JSON without CORS.
        raise UnsupportedMediaType(
            "this route takes a JSON body (Content-Type: application/json)", field="body"
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


def _tenant(request: Request) -> str:
    return request.state.tenant


# -- protobuf decode / encode --------------------------------------------------------------------
def _tensor_to_numpy(t, where: str, n: int, max_k: int) -> np.ndarray:
    """A protobuf Tensor as a writable numpy array for a datum of ``n`` tokens.

    Every declared size is checked against the datum and the limits before anything is allocated:
    a few bytes of CSR can otherwise declare terabytes."""
    if t.dtype not in proto.NUMPY_OF:
        raise UserError(
            f"{where}: unsupported dtype {proto.DTYPE_NAMES.get(t.dtype, t.dtype)} "
            "(float32 or int64 expected)",
            field=where,
        )
    dt = proto.NUMPY_OF[t.dtype]
    shape = [int(s) for s in t.shape]
    if any(s < 0 for s in shape) or len(shape) > 2:
        raise UserError(f"{where}: shape {shape} is not [N] or [N, K]", field=where)
    mismatch = UserError(
        f"{where} has shape {shape}; expected [{n}] or [{n}, K] to match model_input length {n}", field=where
    )
    if len(shape) == 2 and not 1 <= shape[1] <= max_k:
        raise UserError(f"{where}: shape {shape} needs 1 <= K <= {max_k} (OPENRL_MAX_TARGET_K)", field=where)
    itemsize = np.dtype(dt).itemsize
    if t.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise UserError(f"{where}: a sparse tensor needs a 2-D shape; got {shape}", field=where)
        if shape[0] != n:
            raise mismatch
        csr = t.sparse_csr
        if len(csr.values) % itemsize or len(csr.crow_indices) % 8 or len(csr.col_indices) % 8:
            raise UserError(f"{where}: sparse buffers are not whole {itemsize}/8-byte elements", field=where)
        values = np.frombuffer(csr.values, dtype=dt)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        rows, k = shape
        if (
            len(crow) != rows + 1
            or len(col) != len(values)
            or (len(crow) and (crow[0] != 0 or crow[-1] != len(values)))
            or (len(col) and (col.min() < 0 or col.max() >= k))
            or np.any(np.diff(crow) < 0)
        ):
            raise UserError(f"{where}: malformed CSR tensor for shape {shape}", field=where)
        dense = np.zeros((rows, k), dtype=dt)
        dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
        return dense
    raw = t.dense
    if len(raw) % itemsize:
        raise UserError(
            f"{where}: {len(raw)} bytes is not a whole number of {proto.DTYPE_NAMES[t.dtype]} values",
            field=where,
        )
    count = len(raw) // itemsize
    if shape and math.prod(shape) != count:
        raise UserError(f"{where}: shape {shape} does not match its {count} values", field=where)
    if (shape and shape[0] != n) or (not shape and count != n):
        raise mismatch
    arr = np.frombuffer(raw, dtype=dt).copy()  # writable: torch refuses read-only buffers
    return arr.reshape(shape) if shape else arr


def decode_datums(msg, *, max_n: int, max_k: int, max_cells: int) -> list[DatumArrays]:
    """The request's datums as numpy arrays, bounded by the context length, K and the request size."""
    data = []
    cells = 0
    for i, d in enumerate(msg.data):
        toks = []
        for c in d.model_input:
            which = c.WhichOneof("chunk")
            if which != "encoded_text":
                raise UserError(
                    f"data[{i}].model_input: {which or 'empty'} chunks are not supported by this model "
                    "(text tokens only)",
                    field=f"data[{i}].model_input",
                )
            if len(c.encoded_text.tokens) % 4:
                raise UserError(
                    f"data[{i}].model_input: token bytes are not whole int32 values",
                    field=f"data[{i}].model_input",
                )
            toks.append(np.frombuffer(c.encoded_text.tokens, dtype=np.int32))
        tokens = np.concatenate(toks).astype(np.int64) if toks else np.zeros(0, dtype=np.int64)
        n = len(tokens)
        if n > max_n:
            raise UserError(
                f"data[{i}].model_input has {n} tokens; the model's context length is {max_n}",
                field=f"data[{i}].model_input",
            )
        widest = max([t.shape[1] for t in d.loss_fn_inputs.values() if len(t.shape) == 2] + [1])
        cells += n * max(1, min(int(widest), max_k))
        if cells > max_cells:
            raise UserError(
                f"data: the request holds more than {max_cells} token positions (N, times K for [N, K] "
                "targets, summed over datums) (OPENRL_MAX_REQUEST_TOKENS); split it into several calls",
                field="data",
            )
        inputs = {}
        for name, t in d.loss_fn_inputs.items():
            where = f"data[{i}].loss_fn_inputs.{name}"
            arr = _tensor_to_numpy(t, where, n, max_k)
            if name == "target_tokens":
                if arr.dtype != np.int64 and arr.dtype != np.int32:
                    raise UserError(f"{where} must be int64 token ids; got {arr.dtype}", field=where)
                arr = arr.astype(np.int64)
            elif arr.dtype != np.float32:
                raise UserError(f"{where} must be float32; got {arr.dtype}", field=where)
            inputs[name] = arr
        data.append(DatumArrays(tokens, inputs))
    return data


def loss_config(msg) -> dict[str, float]:
    config: dict[str, float] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        which = v.WhichOneof("value")
        if which == "number":
            config[k] = float(v.number)
        elif which == "text":
            raise UserError(
                f"loss_fn_config.{k}: text values are not supported by the built-in losses",
                field=f"loss_fn_config.{k}",
            )
    for k, v in config.items():
        if not math.isfinite(v):
            raise UserError(f"loss_fn_config.{k} must be finite; got {v}", field=f"loss_fn_config.{k}")
    return config


def encode_forward(result: ForwardResult) -> bytes:
    out = proto.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    rec = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(result.logprobs))
    bt = rec.fields["logprobs"]
    arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in result.logprobs]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    bt.data = b"".join(a.tobytes() for a in arrays)
    bt.offsets = offsets.tobytes()
    bt.dtype = proto.DTYPE_FLOAT32
    if arrays and arrays[0].ndim == 2:
        bt.trailing_shape.extend([arrays[0].shape[1]])
    out.metrics["loss:sum"] = result.loss
    return out.SerializeToString()


def forward_json(result: ForwardResult) -> dict:
    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [
            {"logprobs": {"data": a.ravel().tolist(), "dtype": "float32", "shape": list(a.shape)}}
            for a in result.logprobs
        ],
        "metrics": {"loss:sum": result.loss},
    }


def _topk(msg, ids: np.ndarray, vals: np.ndarray) -> None:
    msg.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(vals, dtype=np.float32).tobytes()
    msg.length, msg.k = ids.shape


def encode_sample(out: SampleOutput) -> bytes:
    msg = proto.SampleResponse()
    for s in out.sequences:
        seq = msg.sequences.add(stop_reason=proto.STOP_REASON[s.stop_reason])
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
        if s.topk_ids is not None:
            _topk(seq.topk_sampled_logprobs, s.topk_ids, s.topk_logprobs)
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(out.prompt_logprobs, dtype=np.float32).tobytes()
    if out.topk_prompt_ids is not None:
        _topk(msg.topk_prompt_logprobs, out.topk_prompt_ids, out.topk_prompt_logprobs)
    return msg.SerializeToString()


def sample_json(out: SampleOutput, ids: list[str]) -> dict:
    def nan_none(a):
        return [None if not math.isfinite(x) else float(x) for x in a]

    return {
        "sequences": [
            {"sequence_id": sid, "stop_reason": s.stop_reason, "tokens": s.tokens, "logprobs": s.logprobs}
            for sid, s in zip(ids, out.sequences, strict=True)
        ],
        "prompt_logprobs": None if out.prompt_logprobs is None else nan_none(out.prompt_logprobs),
    }


def build_router(svc: TrainingService) -> APIRouter:
    r = APIRouter(prefix="/api/v1", route_class=BackpressureRoute)
    max_body = svc.limits.max_body_bytes

    def idem(request: Request) -> str | None:
        return request.headers.get("x-idempotency-key")

    # -- bootstrap and sessions ----------------------------------------------------------------
    @r.post("/client/config")
    async def client_config(request: Request):
        """Flags the SDK reads at start-up."""
        return json_response(CLIENT_CONFIG)

    @r.post("/client/dynamic_config")
    async def dynamic_config(request: Request):
        """Flags the SDK re-reads periodically."""
        return json_response(
            {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}
        )

    @r.post("/create_session")
    async def create_session(request: Request):
        """Start a session (one ServiceClient)."""
        body = await read_json(request, max_body)
        sess = await run_in_threadpool(  # writes (and fsyncs) the session record
            svc.create_session,
            _tenant(request),
            tags=body.get("tags"),
            user_metadata=body.get("user_metadata"),
            display_name=body.get("display_name"),
            project_id=body.get("project_id"),
        )
        return json_response({"type": "create_session", "session_id": sess.session_id})

    @r.post("/session_heartbeat")
    async def heartbeat(request: Request):
        """Keep a session alive; 410 once it is finished."""
        body = await read_json(request, max_body)
        if not svc.heartbeat(_tenant(request), field(body, "session_id", str)):
            return json_response({"error": "session is finished", "category": "user"}, status=410)
        return json_response({"type": "session_heartbeat"})

    @r.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        """End a session; its runs and samplers leave device memory, checkpoints stay."""
        body = await read_json(request, max_body)
        reason = body.get("reason") if isinstance(body.get("reason"), dict) else {}
        await run_in_threadpool(  # writes (and fsyncs) the session record
            svc.finish_session, _tenant(request), session_id, reason=str(reason.get("type", "success"))
        )
        return json_response({"type": "session_finish", "session_id": session_id})

    @r.post("/telemetry")
    async def telemetry(request: Request):
        """Accept (and drop) SDK telemetry."""
        return json_response({"status": "accepted"})

    @r.get("/get_server_capabilities")
    async def capabilities(request: Request):
        """The served model, its context length and RL defaults."""
        return json_response({"supported_models": svc.capabilities()})

    # -- training ------------------------------------------------------------------------------
    @r.post("/create_model")
    async def create_model(request: Request):
        """Create a LoRA training run; future → {model_id}."""
        body = await read_json(request, max_body)
        lora = field(body, "lora_config", dict, required=False, default={}) or {}
        spec = svc.lora_spec(
            lora.get("rank", 32),
            lora.get("train_attn", True),
            lora.get("train_mlp", True),
            lora.get("train_unembed", True),
        )
        seed = lora.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise UserError(f"lora_config.seed must be an integer; got {seed!r}", field="lora_config.seed")
        opt = body.get("optimizer_config") or {"type": "adamw"}
        if isinstance(opt, dict) and opt.get("type", "adamw") != "adamw":
            raise UserError(
                f"optimizer_config.type {opt.get('type')!r} is not supported; use adamw",
                field="optimizer_config.type",
            )
        rec = svc.create_model(
            _tenant(request),
            session_id=field(body, "session_id", str),
            model_seq_id=field(body, "model_seq_id", int),
            base_model=body.get("base_model"),
            spec=spec,
            seed=seed,
            user_metadata=body.get("user_metadata"),
            idem=idem(request),
        )
        return json_response(rec.reply())

    @r.post("/get_info")
    async def get_info(request: Request):
        """A run's model name, LoRA rank and tokenizer id."""
        body = await read_json(request, max_body)
        return json_response(svc.get_info(_tenant(request), field(body, "model_id", str)))

    @r.post("/forward_backward")
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
        base = svc.require_ready()
        try:
            data: Any = decode_datums(
                msg,
                max_n=base.context_length,
                max_k=min(base.vocab_size, svc.limits.max_target_k),
                max_cells=svc.limits.max_request_tokens,
            )
            config = loss_config(msg)
        except UserError as e:
            data, config = e, {}
        rec = svc.forward_backward(
            _tenant(request),
            msg.model_id,
            msg.seq_id,
            data,
            msg.loss_fn or "cross_entropy",
            config,
            msg.forward_only,
            idem(request),
        )
        return json_response(rec.reply())

    @r.post("/optim_step")
    async def optim_step(request: Request):
        """AdamW step over the run's accumulated gradients; future → {metrics}."""
        body = await read_json(request, max_body)
        model_id = field(body, "model_id", str)
        seq_id = body.get("seq_id")
        try:
            adam: Any = adam_params(body)
        except UserError as e:
            adam = e
        rec = svc.optim_step(_tenant(request), model_id, seq_id, adam, idem(request))
        return json_response(rec.reply())

    @r.post("/save_weights")
    async def save_weights(request: Request):
        """save_state: adapter + optimizer under tinker://<run>/weights/<name>."""
        body = await read_json(request, max_body)
        rec = svc.save_state(
            _tenant(request),
            field(body, "model_id", str),
            body.get("seq_id"),
            body.get("path"),
            bool(body.get("overwrite", False)),
            body.get("user_metadata"),
            idem(request),
            ttl_seconds=body.get("ttl_seconds"),
        )
        return json_response(rec.reply())

    @r.post("/save_weights_external")
    async def save_weights_external(request: Request):
        """The adapter as a downloadable PEFT folder under tinker://<run>/external_weights/<name>."""
        body = await read_json(request, max_body)
        rec = svc.save_external(
            _tenant(request),
            field(body, "model_id", str),
            body.get("seq_id"),
            body.get("path"),
            body.get("ttl_seconds"),
            body.get("age_encryption_recipients"),
            idem(request),
        )
        return json_response(rec.reply())

    @r.post("/load_weights")
    async def load_weights(request: Request):
        """load_state (model_id + seq_id) or create-via-load (session_id + model_seq_id)."""
        body = await read_json(request, max_body)
        tenant = _tenant(request)
        optimizer = bool(body.get("optimizer", False))
        if body.get("model_id") is None and body.get("session_id") is not None:
            rec = svc.create_from_state(
                tenant,
                session_id=field(body, "session_id", str),
                model_seq_id=field(body, "model_seq_id", int),
                path=field(body, "path", str),
                optimizer=optimizer,
                base_model=body.get("base_model"),
                user_metadata=body.get("user_metadata"),
                idem=idem(request),
            )
        else:
            rec = svc.load_state(
                tenant,
                field(body, "model_id", str),
                body.get("seq_id"),
                body.get("path"),
                optimizer,
                idem(request),
            )
        return json_response(rec.reply())

    @r.post("/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        """Named → tinker://<run>/sampler_weights/<name>; without a name → a new sampling session."""
        body = await read_json(request, max_body)
        rec = svc.save_for_sampler(
            _tenant(request),
            field(body, "model_id", str),
            body.get("seq_id"),
            body.get("path"),
            body.get("sampling_session_seq_id"),
            body.get("user_metadata"),
            idem(request),
            ttl_seconds=body.get("ttl_seconds"),
        )
        return json_response(rec.reply())

    # -- sampling ------------------------------------------------------------------------------
    @r.post("/create_sampling_session")
    async def create_sampling_session(request: Request):
        """A sampler on the base model or on a saved sampler checkpoint."""
        body = await read_json(request, max_body)
        sampler_id = await run_in_threadpool(
            svc.create_sampler,
            _tenant(request),
            session_id=field(body, "session_id", str),
            seq_id=body.get("sampling_session_seq_id"),
            base_model=body.get("base_model"),
            model_path=body.get("model_path"),
        )
        return json_response({"type": "create_sampling_session", "sampling_session_id": sampler_id})

    @r.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        """Which base model and checkpoint a sampler serves."""
        e = svc.sampler_entry(_tenant(request), sampler_id)
        out = {"sampler_id": e.sampler_id, "base_model": e.base_model}
        if e.model_path:
            out["model_path"] = e.model_path
        return json_response(out)

    @r.post("/asample")
    async def asample(request: Request):
        """Queue a sample request; the reply carries one sequence id per sample."""
        body = await read_json(request, max_body)
        sampler_id = field(body, "sampling_session_id", str)
        prompt = prompt_tokens(field(body, "prompt", dict))
        for unsupported in ("prompt_alt_tokens_k",):
            if body.get(unsupported):
                raise UserError(f"{unsupported} is not supported by this service", field=unsupported)
        if body.get("target_prompt_logprobs") is not None:
            raise UserError(
                "target_prompt_logprobs is not supported by this service", field="target_prompt_logprobs"
            )
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None and (isinstance(last_n, bool) or not isinstance(last_n, int) or last_n < 1):
            raise UserError(
                f"prompt_logprobs_last_n must be an integer >= 1; got {last_n!r}",
                field="prompt_logprobs_last_n",
            )
        params = svc.sampling_params(field(body, "sampling_params", dict, required=False, default={}))
        rec = svc.sample(
            _tenant(request),
            sampler_id=sampler_id,
            prompt=prompt,
            num_samples=body.get("num_samples", 1),
            params=params,
            prompt_logprobs=bool(body.get("prompt_logprobs", False)),
            topk_prompt_logprobs=body.get("topk_prompt_logprobs", 0) or 0,
            topk_sample_logprobs=body.get("topk_sample_logprobs", 0) or 0,
            idem=idem(request),
        )
        if last_n is not None:
            rec.extra.setdefault("_last_n", last_n)
        return json_response({k: v for k, v in rec.reply().items() if not k.startswith("_")})

    # -- futures -------------------------------------------------------------------------------
    @r.post("/retrieve_future")
    async def retrieve_future(request: Request):
        """Long-poll a future: the result, an error result, or try_again."""
        body = await read_json(request, max_body)
        request_id = field(body, "request_id", str)
        rec = svc.futures.get(_tenant(request), request_id)
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
        if rec.error is not None:
            return json_response(rec.error.to_json())
        wants_proto = PROTO in request.headers.get("accept", "")
        return encode_result(rec, wants_proto)

    @r.get("/healthz")
    async def api_healthz():
        """Liveness of the worker thread (no key needed)."""
        return health(svc)

    return r


def health(svc: TrainingService) -> Response:
    ok = svc.engine.alive or not svc.engine.ready.is_set() and svc.engine.setup_error is None
    return json_response({"status": "ok" if ok else "worker thread is dead"}, status=200 if ok else 503)


def prompt_tokens(prompt: dict) -> list[int]:
    chunks = prompt.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise UserError("prompt.chunks must be a non-empty list", field="prompt.chunks")
    out: list[int] = []
    for i, c in enumerate(chunks):
        if not isinstance(c, dict) or c.get("type", "encoded_text") != "encoded_text":
            kind = c.get("type") if isinstance(c, dict) else type(c).__name__
            raise UserError(
                f"prompt.chunks[{i}]: {kind} chunks are not supported by this model (text tokens only)",
                field=f"prompt.chunks[{i}]",
            )
        toks = c.get("tokens")
        if not isinstance(toks, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in toks
        ):
            raise UserError(
                f"prompt.chunks[{i}].tokens must be a list of integers", field=f"prompt.chunks[{i}].tokens"
            )
        out.extend(toks)
    return out


def encode_result(rec, wants_proto: bool) -> Response:
    """A fresh Response for each retrieve (middleware may add headers to it); the encoded bytes are
    made once per future and format, and kept on the record."""
    if rec.cache is None or rec.cache[0] != wants_proto:
        rec.cache = (wants_proto, *_encode(rec, wants_proto))
    _, body, media_type = rec.cache
    return Response(body, media_type=media_type)


def _encode(rec, wants_proto: bool) -> tuple[bytes, str]:
    """(body, media type) of a finished future's result."""
    res = rec.result
    if isinstance(res, ForwardResult):
        if wants_proto:
            return encode_forward(res), PROTO
        return _json_bytes(forward_json(res)), "application/json"
    if isinstance(res, SampleOutput):
        last_n = rec.extra.get("_last_n")
        if last_n is not None and res.prompt_logprobs is not None:
            res.prompt_logprobs[: max(0, len(res.prompt_logprobs) - last_n)] = np.nan
        if wants_proto:
            return encode_sample(res), PROTO
        return _json_bytes(sample_json(res, rec.extra.get("sample_sequence_ids", []))), "application/json"
    return _json_bytes({**res, "type": rec.kind} if isinstance(res, dict) else res), "application/json"
