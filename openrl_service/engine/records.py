"""The journal's record types: each one named, versioned and made of declared fields.

In memory a record is a tuple whose first item is its type (``("finish", tenant, session_id,
reason)``), built by the code that makes the change. On disk (journal format 2) it is a dict
``{"type": ..., "v": ..., <declared fields>}``; values that are not JSON-like data (a LoRA spec, Adam
parameters, a datum's arrays, sampling parameters, a request refused at its checks) are written as
tagged plain data (``(b"lora", {...})``: a bytes tag, which no JSON body can produce), never as a
pickled class. :func:`decode` turns a record of any version this release knows back into the tuple
the replay expects (older versions upgraded on the way), and raises :class:`UnknownRecord` for one
it does not know, which recovery reports by name.

Service calls (``("call", request_id, method, args)``) declare their arguments in :data:`CALLS`:
the journal writes exactly those fields and a replay passes exactly those keywords back.
``tests/service/test_journal_records.py`` checks that each declared list still matches the method it
replays: renaming a parameter is then a new version of that call here, with an upgrade of the old
one in :data:`UPGRADES`, and the committed fixture of each format (tests/fixtures/) must still replay.

Format 1 (the first release's journal) wrote the in-memory tuples themselves, with their data
classes pickled; :func:`decode` takes those as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMAT = 2


class UnknownRecord(Exception):
    """A record this release cannot replay: a type or version it does not know, or malformed."""

    def __init__(self, what: str, why: str):
        super().__init__(f"{what}: {why}")
        self.what = what
        self.why = why


@dataclass(frozen=True)
class Call:
    version: int
    fields: tuple[str, ...]


CALLS: dict[str, Call] = {
    "create_model": Call(
        1, ("tenant", "session_id", "model_seq_id", "base_model", "spec", "seed", "user_metadata", "idem")
    ),
    "create_from_state": Call(
        1,
        (
            "tenant",
            "session_id",
            "model_seq_id",
            "path",
            "optimizer",
            "base_model",
            "user_metadata",
            "idem",
            "optimizer_config",  # optional (added with Dimuon): absent in older records
        ),
    ),
    "forward_backward": Call(
        1, ("tenant", "model_id", "seq_id", "data", "loss_fn", "loss_fn_config", "forward_only", "idem")
    ),
    "optim_step": Call(1, ("tenant", "model_id", "seq_id", "adam", "idem")),
    "save_state": Call(
        1,
        (
            "tenant",
            "model_id",
            "seq_id",
            "name",
            "overwrite",
            "user_metadata",
            "idem",
            "ttl_seconds",
            "writer",
        ),
    ),
    "load_state": Call(1, ("tenant", "model_id", "seq_id", "path", "optimizer", "idem")),
    "save_for_sampler": Call(
        1,
        (
            "tenant",
            "model_id",
            "seq_id",
            "name",
            "sampling_session_seq_id",
            "user_metadata",
            "idem",
            "ttl_seconds",
            "kind",  # optional (added with inflight sampling)
        ),
    ),
    "save_external": Call(1, ("tenant", "model_id", "seq_id", "name", "ttl_seconds", "recipients", "idem")),
    "sample_run": Call(1, ("tenant", "model_id", "seq_id", "jobs", "idem")),
    "sample": Call(
        1,
        (
            "tenant",
            "sampler_id",
            "prompt",
            "num_samples",
            "params",
            "prompt_logprobs",
            "topk_prompt_logprobs",
            "topk_sample_logprobs",
            "idem",
            "record_stability_info",  # optional (added with stable_reinforce)
        ),
    ),
}

SESSION_FIELDS = (
    "session_id",
    "tenant",
    "created_at",
    "last_heartbeat",
    "finished",
    "finished_at",
    "tags",
    "user_metadata",
    "display_name",
    "project_id",
    "run_ids",
    "sampler_ids",
    "finish_reason",
)
SAMPLER_FIELDS = ("session_id", "seq_id", "base_model", "model_path")

# Each type: (version, the tuple's items after the type, in order). "session" and "sampler" carry a
# dict of declared fields; "call" and "native" a dict of arguments.
TYPES: dict[str, tuple[int, tuple[str, ...]]] = {
    "meta": (1, ("meta",)),
    "session": (1, ("session",)),
    "finish": (1, ("tenant", "session_id", "reason")),
    "sampler": (1, ("tenant", "args")),
    "forget_tenant": (1, ("tenant", "move_to")),
    "control": (1, ("tenant", "run_id", "control")),
    "run_state": (1, ("tenant", "run_id", "state")),  # what a notebook run's kernel reported
    "native": (1, ("id", "kind", "inputs")),
    "call": (1, ("id", "method", "args")),
}

# (type, version) -> a function from that version's dict to the next version's; none yet.
UPGRADES: dict[tuple[str, int], Callable[[dict], dict]] = {}


# -- values ------------------------------------------------------------------------------------
def encode_value(v: Any) -> Any:
    """A record's value as plain data (containers, numbers, strings, numpy arrays, tagged tuples)."""
    from openrl_service.errors import ApiError
    from openrl_service.sampling.base import SampledSequence, SampleJob, SampleOutput, SamplingParams
    from openrl_service.training.dimuon import DimuonParams
    from openrl_service.training.lora import LoraSpec
    from openrl_service.training.optim_params import AdamParams
    from openrl_service.training.trainer import DatumArrays, ForwardResult

    if v is None or isinstance(v, (str, bool, int, float, np.ndarray, np.generic, bytes)):
        return v
    if isinstance(v, dict):
        return {k: encode_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [encode_value(x) for x in v]
    if isinstance(v, tuple):
        return tuple(encode_value(x) for x in v)
    if isinstance(v, (set, frozenset)):
        return (b"set", [encode_value(x) for x in v])
    if isinstance(v, ApiError):
        return (b"error", {"json": v.to_json(), "status": v.status_code})
    if isinstance(v, LoraSpec):
        return (b"lora", v.to_json())
    if isinstance(v, AdamParams):
        return (b"adam", dict(vars(v)))
    if isinstance(v, DimuonParams):
        return (b"dimuon", dict(vars(v)))
    if isinstance(v, DatumArrays):
        return (b"datum", {"tokens": v.tokens, "inputs": dict(v.inputs)})
    if isinstance(v, SamplingParams):
        return (
            b"sampling",
            {**vars(v), "stop_token_ids": list(v.stop_token_ids), "stop_strings": list(v.stop_strings)},
        )
    if isinstance(v, SampleJob):
        if v.adapter is not None:
            raise TypeError("a journaled SampleJob carries no adapter (the run's is used at replay)")
        return (
            b"sample_job",
            {
                "prompt": list(v.prompt),
                "num_samples": v.num_samples,
                "params": encode_value(v.params),
                "prompt_logprobs": v.prompt_logprobs,
                "topk_prompt_logprobs": v.topk_prompt_logprobs,
                "topk_sample_logprobs": v.topk_sample_logprobs,
            },
        )
    if isinstance(v, ForwardResult):
        return (
            b"forward_result",
            {"logprobs": list(v.logprobs), "loss": v.loss, "tokens": v.tokens, "stats": v.stats},
        )
    if isinstance(v, SampleOutput):
        return (
            b"sample_output",
            {
                "sequences": [encode_value(q) for q in v.sequences],
                "prompt_logprobs": v.prompt_logprobs,
                "topk_prompt_ids": v.topk_prompt_ids,
                "topk_prompt_logprobs": v.topk_prompt_logprobs,
                "tokens": v.tokens,
                "backend": v.backend,
                "notice": v.notice,
            },
        )
    if isinstance(v, SampledSequence):
        return (
            b"sampled_sequence",
            {
                "tokens": list(v.tokens),
                "logprobs": list(v.logprobs),
                "stop_reason": v.stop_reason,
                "topk_ids": v.topk_ids,
                "topk_logprobs": v.topk_logprobs,
            },
        )
    raise TypeError(f"journal: a {type(v).__name__} is not record data")


def decode_value(v: Any, tensors: Callable[[str], np.ndarray] | None = None) -> Any:
    """The inverse of :func:`encode_value`; ``tensors`` resolves a snapshot's tensor references."""
    from openrl_service.errors import RestoredError
    from openrl_service.sampling.base import SampledSequence, SampleJob, SampleOutput, SamplingParams
    from openrl_service.training.dimuon import DimuonParams
    from openrl_service.training.lora import LoraSpec
    from openrl_service.training.optim_params import AdamParams
    from openrl_service.training.trainer import DatumArrays, ForwardResult

    if isinstance(v, dict):
        return {k: decode_value(x, tensors) for k, x in v.items()}
    if isinstance(v, list):
        return [decode_value(x, tensors) for x in v]
    if not isinstance(v, tuple):
        return v
    if len(v) == 2 and isinstance(v[0], bytes):
        tag, d = v
        if tag == b"error":
            return RestoredError(d["json"], d["status"])
        if tag == b"set":
            return {decode_value(x, tensors) for x in d}
        if tag == b"lora":
            return LoraSpec(
                rank=d["rank"],
                train_attn=d["train_attn"],
                train_mlp=d["train_mlp"],
                train_unembed=d["train_unembed"],
                alpha=d["alpha"],
                optimizer=d.get("optimizer", "adamw"),  # absent in records before Dimuon
            )
        if tag == b"adam":
            return AdamParams(
                learning_rate=d["learning_rate"],
                beta1=d["beta1"],
                beta2=d["beta2"],
                eps=d["eps"],
                weight_decay=d["weight_decay"],
                grad_clip_norm=d["grad_clip_norm"],
            )
        if tag == b"dimuon":
            return DimuonParams(**{k: d[k] for k in DimuonParams.__dataclass_fields__})
        if tag == b"datum":
            return DatumArrays(tokens=d["tokens"], inputs=dict(d["inputs"]))
        if tag == b"sampling":
            return SamplingParams(
                max_tokens=d["max_tokens"],
                temperature=d["temperature"],
                top_p=d["top_p"],
                top_k=d["top_k"],
                seed=d["seed"],
                stop_token_ids=tuple(d["stop_token_ids"]),
                stop_strings=tuple(d["stop_strings"]),
            )
        if tag == b"sample_job":
            return SampleJob(
                prompt=list(d["prompt"]),
                num_samples=d["num_samples"],
                params=decode_value(d["params"]),
                adapter=None,
                prompt_logprobs=d["prompt_logprobs"],
                topk_prompt_logprobs=d["topk_prompt_logprobs"],
                topk_sample_logprobs=d["topk_sample_logprobs"],
            )
        if tag == b"forward_result":
            return ForwardResult(
                logprobs=list(d["logprobs"]), loss=d["loss"], tokens=d["tokens"], stats=d["stats"]
            )
        if tag == b"sample_output":
            return SampleOutput(
                sequences=[decode_value(q) for q in d["sequences"]],
                prompt_logprobs=d["prompt_logprobs"],
                topk_prompt_ids=d["topk_prompt_ids"],
                topk_prompt_logprobs=d["topk_prompt_logprobs"],
                tokens=d["tokens"],
                backend=d["backend"],
                notice=d["notice"],
            )
        if tag == b"sampled_sequence":
            return SampledSequence(
                tokens=list(d["tokens"]),
                logprobs=list(d["logprobs"]),
                stop_reason=d["stop_reason"],
                topk_ids=d["topk_ids"],
                topk_logprobs=d["topk_logprobs"],
            )
        if tag == b"tensor":
            if tensors is None:
                raise UnknownRecord("a value", "a tensor reference outside a snapshot")
            return tensors(d["key"])
        raise UnknownRecord("a value", f"unknown tag {tag!r}")
    return tuple(decode_value(x, tensors) for x in v)


# -- records -----------------------------------------------------------------------------------
def encode(record: tuple) -> dict:
    """The on-disk form of an in-memory record."""
    kind = record[0]
    if kind not in TYPES:
        raise TypeError(f"journal: {kind!r} is not a record type (add it to records.TYPES)")
    version, names = TYPES[kind]
    if len(record) != len(names) + 1:
        raise TypeError(f"journal: a {kind!r} record has {len(names)} items, got {len(record) - 1}")
    out: dict[str, Any] = {"type": kind, "v": version}
    for name, value in zip(names, record[1:], strict=True):
        out[name] = value
    if kind == "session":
        out["session"] = {f: encode_value(record[1][f]) for f in SESSION_FIELDS}
    elif kind == "sampler":
        out["args"] = {f: record[2][f] for f in SAMPLER_FIELDS}
    elif kind == "call":
        call = CALLS.get(record[2])
        if call is None:
            raise TypeError(f"journal: the call {record[2]!r} is not declared in records.CALLS")
        out["call_v"] = call.version
        out["args"] = {f: encode_value(record[3][f]) for f in call.fields if f in record[3]}
    elif kind == "native":
        out["inputs"] = encode_value(record[3])
    return out


def decode(data: Any) -> tuple:
    """The in-memory record from its on-disk form (a format-1 tuple, or a dict of a known version)."""
    if isinstance(data, tuple):
        return _format_1(data)
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise UnknownRecord("a record", f"not a record ({type(data).__name__})")
    kind, version = data["type"], data.get("v")
    what = _describe(data)
    if kind not in TYPES:
        raise UnknownRecord(what, "this release does not know this record type (written by a newer one?)")
    current, names = TYPES[kind]
    while version != current:
        upgrade = UPGRADES.get((kind, version))
        if upgrade is None:
            raise UnknownRecord(what, f"version {version} is not one this release reads (it reads {current})")
        data = upgrade(data)
        version = data["v"]
    try:
        items = [data[n] for n in names]
    except KeyError as e:
        raise UnknownRecord(what, f"the field {e.args[0]!r} is missing") from None
    if kind == "session":
        items[0] = decode_value(items[0])
    elif kind == "call":
        call = CALLS.get(data["method"])
        if call is None:
            raise UnknownRecord(what, "this release has no such call")
        if data.get("call_v") != call.version:
            raise UnknownRecord(what, f"call version {data.get('call_v')} is not {call.version}")
        items[2] = decode_value(items[2])
    elif kind == "native":
        items[2] = decode_value(items[2])
    return (kind, *items)


def _format_1(record: tuple) -> tuple:
    """A format-1 record: the tuple itself, except that a call's argument refused at its checks was
    written as ``{"__api_error__": json, "status": code}``."""
    from openrl_service.errors import RestoredError

    if record and record[0] == "call" and len(record) == 4:
        args = {
            k: RestoredError(v["__api_error__"], v["status"])
            if isinstance(v, dict) and set(v) == {"__api_error__", "status"}
            else v
            for k, v in record[3].items()
        }
        return (*record[:3], args)
    return record


def _describe(data: dict) -> str:
    kind = data.get("type")
    if kind == "call":
        return f"record 'call {data.get('method')}' v{data.get('v')} (request {data.get('id')})"
    if kind == "native":
        return f"record 'native {data.get('kind')}' v{data.get('v')} (intent {data.get('id')})"
    return f"record {kind!r} v{data.get('v')}"


def describe(record: tuple) -> str:
    """A record named for an operator: its type, and the request or intent it carries."""
    if record and record[0] == "call":
        return f"'call {record[2]}' (request {record[1]})"
    if record and record[0] == "native":
        return f"'native {record[2]}' (intent {record[1]})"
    return repr(record[0]) if record else "an empty record"
