"""The Tinker wire codecs: protobuf/JSON request bodies to engine inputs, engine results to replies.

Decoding checks every declared size against the datum and the limits before anything is allocated;
encoding turns a finished future's result into protobuf (when the client accepts it) or JSON.
"""

from __future__ import annotations

import math

import numpy as np
from fastapi.responses import Response

from openrl_service.api import proto
from openrl_service.api.http import json_bytes
from openrl_service.errors import UserError
from openrl_service.sampling.base import SampleOutput
from openrl_service.training.trainer import DatumArrays, ForwardResult

PROTO = "application/x-protobuf"


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
        return json_bytes(forward_json(res)), "application/json"
    if isinstance(res, SampleOutput):
        last_n = rec.extra.get("_last_n")
        if last_n is not None and res.prompt_logprobs is not None:
            res.prompt_logprobs[: max(0, len(res.prompt_logprobs) - last_n)] = np.nan
        if wants_proto:
            return encode_sample(res), PROTO
        return json_bytes(sample_json(res, rec.extra.get("sample_sequence_ids", []))), "application/json"
    return json_bytes({**res, "type": rec.kind} if isinstance(res, dict) else res), "application/json"
