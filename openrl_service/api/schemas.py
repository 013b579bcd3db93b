"""The published shape of the JSON routes: request-body JSON Schemas.

The handlers' checks stay the authority (they name the field and the limit in a 400); these schemas
describe the same rules in ``/openapi.json`` so a client generator, a reader or a fuzzer (``make
fuzz``) builds bodies the service accepts: required fields, types, ranges (from :class:`Limits`),
enums and list sizes. What JSON Schema cannot say (a prompt plus ``max_tokens`` must fit the
model's context; token ids must be below its vocabulary size) is said in the description.

The OpenAPI links (how one reply feeds the next request) are in :mod:`openrl_service.api.links`.

Operation ids are ``<router>_<handler name>`` (``tinker_create_model``, ``rest_get_session``,
``native_create_run``): :func:`operation_ids` makes them.
"""

from __future__ import annotations

from typing import Any

from fastapi.routing import APIRoute

from openrl_common.protocol import CONTROL_ACTIONS, JOB_NAME_PATTERN, JOB_STATES, RL_LOSSES
from openrl_service.config import Limits
from openrl_service.storage.checkpoints import KINDS
from openrl_service.training.losses import LOSSES

TTL_MAX_S = 10 * 365 * 24 * 3600  # Validation.expiry: Tinker's ten years
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # storage.checkpoints.check_name
TINKER_PATH_PATTERN = (
    r"^tinker://[A-Za-z0-9][A-Za-z0-9:._-]{0,127}/("
    + "|".join(KINDS)
    + r")/[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
)
FLOAT32_MAX = 3.4028234663852886e38  # AdamW holds its parameters as float32

STR: dict = {"type": "string"}
BOOL: dict = {"type": "boolean"}
INT: dict = {"type": "integer"}
SEQ_ID: dict = {"type": "integer", "minimum": 0, "description": "the op's place in its run's order"}
METADATA: dict = {"type": "object", "description": "a JSON object of at most OPENRL_MAX_METADATA_BYTES"}
CHECKPOINT_NAME: dict = {"type": "string", "pattern": NAME_PATTERN}
TINKER_PATH: dict = {"type": "string", "pattern": TINKER_PATH_PATTERN}
TOKEN: dict = {"type": "integer", "minimum": 0, "description": "a token id below the vocabulary size"}


def operation_ids(prefix: str):
    """``generate_unique_id_function`` of a router: ``<prefix>_<handler name>``."""

    def make(route: APIRoute) -> str:
        return f"{prefix}_{route.name}"

    return make


def obj(properties: dict, *required: str, **more: Any) -> dict:
    out: dict = {"type": "object", "properties": properties, **more}
    if required:
        out["required"] = list(required)
    return out


PROTOBUF_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/x-protobuf": {
                "schema": {"type": "string", "format": "binary", "description": "a ForwardBackwardRequest"}
            }
        },
    }
}


def body(schema: dict, *, required: bool = True) -> dict:
    """``openapi_extra`` of a route whose JSON body is ``schema``."""
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def ttl(min_ttl_s: float) -> dict:
    lo = int(min_ttl_s) if float(min_ttl_s).is_integer() else min_ttl_s
    return {"type": "integer", "minimum": lo, "maximum": TTL_MAX_S, "description": "seconds from now"}


# -- shared pieces -----------------------------------------------------------------------------
def adam(lr_required: bool = False) -> dict:
    """AdamW parameters (training.trainer.adam_params)."""
    nonneg = {"type": "number", "minimum": 0, "maximum": FLOAT32_MAX}
    beta = {"type": "number", "minimum": 0, "exclusiveMaximum": 1}
    return obj(
        {
            "learning_rate": nonneg,
            "beta1": beta,
            "beta2": beta,
            "eps": nonneg,
            "weight_decay": nonneg,
            "grad_clip_norm": nonneg,
        },
        *(("learning_rate",) if lr_required else ()),
    )


def sampling_fields(lim: Limits) -> dict:
    """The SamplingParams fields (engine.validation.sampling_params)."""
    return {
        "max_tokens": {
            "type": "integer",
            "minimum": 1,
            "maximum": lim.max_tokens,
            "description": "prompt + max_tokens must fit the model's context length",
        },
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"anyOf": [{"type": "integer", "minimum": 1}, {"const": -1}], "description": "-1: off"},
        "seed": INT,
        "stop": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "maxItems": lim.max_stop_sequences,
                },
                {"type": "array", "items": TOKEN, "maxItems": lim.max_stop_sequences},
            ]
        },
    }


# lora_spec: at least one of the three trains (each defaults to true)
SOME_LAYERS = {
    "not": {
        "properties": {k: {"const": False} for k in ("train_attn", "train_mlp", "train_unembed")},
        "required": ["train_attn", "train_mlp", "train_unembed"],
    }
}


def lora_fields(lim: Limits) -> dict:
    return {
        "rank": {"type": "integer", "minimum": 1, "maximum": lim.max_rank},
        "seed": INT,
        "train_attn": BOOL,
        "train_mlp": BOOL,
        "train_unembed": BOOL,
    }


# -- Tinker JSON routes (api/tinker.py) --------------------------------------------------------
def create_session(lim: Limits) -> dict:
    short = {"type": "string", "maxLength": 256}
    return obj(
        {
            "tags": {"type": "array", "items": STR},
            "user_metadata": METADATA,
            "display_name": short,
            "project_id": short,
        }
    )


SESSION_HEARTBEAT = obj({"session_id": STR}, "session_id")
FINISH = obj({"reason": obj({"type": STR})})
MODEL_ID = obj({"model_id": STR}, "model_id")
REQUEST_ID = obj({"request_id": STR}, "request_id")


def create_model(lim: Limits) -> dict:
    return obj(
        {
            "session_id": STR,
            "model_seq_id": {"type": "integer", "minimum": 0},
            "base_model": STR,
            "lora_config": obj(lora_fields(lim), **SOME_LAYERS),
            "optimizer_config": obj({"type": {"enum": ["adamw"]}}),
            "user_metadata": METADATA,
        },
        "session_id",
        "model_seq_id",
    )


OPTIM_STEP = obj(
    {"model_id": STR, "seq_id": SEQ_ID, "adam_params": adam()}, "model_id", "seq_id", "adam_params"
)


def save_weights(lim: Limits, min_ttl_s: float) -> dict:
    return obj(
        {
            "model_id": STR,
            "seq_id": SEQ_ID,
            "path": CHECKPOINT_NAME,
            "overwrite": BOOL,
            "user_metadata": METADATA,
            "ttl_seconds": ttl(min_ttl_s),
        },
        "model_id",
        "seq_id",
        "path",
    )


def save_weights_external(lim: Limits, min_ttl_s: float) -> dict:
    return obj(
        {
            "model_id": STR,
            "seq_id": SEQ_ID,
            "path": CHECKPOINT_NAME,
            "ttl_seconds": ttl(min_ttl_s),
            "age_encryption_recipients": {"type": "array", "maxItems": 0, "description": "not supported"},
        },
        "model_id",
        "seq_id",
        "path",
    )


def save_for_sampler(lim: Limits, min_ttl_s: float) -> dict:
    common = {
        "model_id": STR,
        "seq_id": SEQ_ID,
        "user_metadata": METADATA,
        "ttl_seconds": ttl(min_ttl_s),
    }
    return {
        "description": "a named sampler checkpoint (path), or a new sampling session (sampling_session_seq_id)",
        "anyOf": [
            obj({**common, "path": CHECKPOINT_NAME}, "model_id", "seq_id", "path"),
            obj(
                {**common, "sampling_session_seq_id": {"type": "integer", "minimum": 0}},
                "model_id",
                "seq_id",
                "sampling_session_seq_id",
            ),
        ],
    }


LOAD_WEIGHTS = {
    "description": "load_state into a run (model_id + seq_id), or a new run from a checkpoint "
    "(session_id + model_seq_id)",
    "anyOf": [
        obj(
            {"model_id": STR, "seq_id": SEQ_ID, "path": TINKER_PATH, "optimizer": BOOL},
            "model_id",
            "seq_id",
            "path",
        ),
        obj(
            {
                "session_id": STR,
                "model_seq_id": {"type": "integer", "minimum": 0},
                "path": TINKER_PATH,
                "optimizer": BOOL,
                "base_model": STR,
                "user_metadata": METADATA,
            },
            "session_id",
            "model_seq_id",
            "path",
        ),
    ],
}

CREATE_SAMPLING_SESSION = obj(
    {
        "session_id": STR,
        "sampling_session_seq_id": {"type": "integer", "minimum": 0},
        "base_model": STR,
        "model_path": TINKER_PATH,
    },
    "session_id",
    "sampling_session_seq_id",
)


def asample(lim: Limits) -> dict:
    topk = {"type": "integer", "minimum": 0, "maximum": lim.max_topk}
    tokens = {
        "type": "array",
        "items": TOKEN,
        "minItems": 1,
    }  # (the handler takes an empty chunk beside others)
    chunk = obj({"type": {"enum": ["encoded_text"]}, "tokens": tokens}, "tokens")
    return obj(
        {
            "sampling_session_id": STR,
            "prompt": obj({"chunks": {"type": "array", "items": chunk, "minItems": 1}}, "chunks"),
            "num_samples": {"type": "integer", "minimum": 1, "maximum": lim.max_num_samples},
            "sampling_params": obj(sampling_fields(lim)),
            "prompt_logprobs": BOOL,
            "topk_prompt_logprobs": topk,
            "topk_sample_logprobs": topk,
            "prompt_logprobs_last_n": {"type": "integer", "minimum": 1},
        },
        "sampling_session_id",
        "prompt",
        description="the prompt holds at least one token",
    )


# -- REST JSON routes (api/rest.py) ------------------------------------------------------------
def set_ttl(lim: Limits, min_ttl_s: float) -> dict:
    return obj({"ttl_seconds": {"anyOf": [ttl(min_ttl_s), {"type": "null"}]}}, "ttl_seconds")


WEIGHTS_INFO = obj({"tinker_path": TINKER_PATH}, "tinker_path")


def copy_weights(lim: Limits, min_ttl_s: float) -> dict:
    common = {"source_path": TINKER_PATH, "ttl_seconds": ttl(min_ttl_s)}
    return {
        "description": "into a session's run slot (session_id + model_seq_id) or a new session of a project",
        "anyOf": [
            obj(
                {**common, "session_id": STR, "model_seq_id": {"type": "integer", "minimum": 0}},
                "source_path",
                "session_id",
                "model_seq_id",
            ),
            obj(
                {**common, "destination_project_id": {"type": "string", "minLength": 1}},
                "source_path",
                "destination_project_id",
            ),
        ],
    }


SEARCH_SESSIONS = obj(
    {
        "limit": {"type": "integer", "minimum": 1, "maximum": 200},
        "owner": obj({"type": STR}),
        "session_id": STR,
        "display_name": STR,
        "user_metadata": {"type": "object"},
        "project_ids": {"type": "array", "items": STR},
        "statuses": {"type": "array", "items": {"anyOf": [STR, obj({"type": STR})]}},
        "cursor": obj({"last_created_at": STR, "last_session_id": STR}),
    }
)
ASSIGN_PROJECT = obj({"project_id": {"type": "string", "minLength": 1, "maxLength": 256}}, "project_id")


# -- notebook API (api/native.py) --------------------------------------------------------------
def create_run(lim: Limits) -> dict:
    return obj(
        {
            "name": {"type": "string", "minLength": 1, "maxLength": 128},
            "base_model": STR,
            "user_metadata": METADATA,
            "load_from": {
                "type": "string",
                "description": "a tinker:// checkpoint to start from (weights only)",
            },
            **lora_fields(lim),
        },
        **SOME_LAYERS,
    )


def native_sample(lim: Limits) -> dict:
    message = obj({"role": STR, "content": STR}, "role", "content")
    prompt = {
        "anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": message, "minItems": 1}]
    }
    return obj(
        {
            "prompts": {"type": "array", "items": prompt, "minItems": 1, "maxItems": lim.max_datums},
            "chat": BOOL,
            "num_samples": {"type": "integer", "minimum": 1, "maximum": lim.max_num_samples},
            **sampling_fields(lim),
        },
        "prompts",
    )


def _loss_config(loss: str) -> dict:
    """The config keys a loss accepts (training.losses.check_loss), each a number."""
    keys = LOSSES[loss].config
    return {
        "type": "object",
        "properties": {k: {"type": "number"} for k in keys},
        "additionalProperties": False,
    }


TRAIN_STEP = obj(
    {
        "samples": {
            "type": "array",
            "minItems": 1,
            "items": obj({"sample_id": STR, "advantage": {"type": "number"}}, "sample_id", "advantage"),
        },
        "loss": {"enum": list(RL_LOSSES)},
        "loss_config": {
            "type": "object",
            "description": "the loss's own keys; clip_low_threshold <= clip_high_threshold",
        },
        "optimizer": adam(),
    },
    "samples",
    anyOf=[
        {"properties": {"loss": {"const": loss}, "loss_config": _loss_config(loss)}, "required": ["loss"]}
        for loss in RL_LOSSES
    ]
    + [{"not": {"required": ["loss"]}, "properties": {"loss_config": _loss_config("importance_sampling")}}],
)


def save_checkpoint(lim: Limits, min_ttl_s: float) -> dict:
    return obj(
        {
            "name": CHECKPOINT_NAME,
            "overwrite": BOOL,
            "user_metadata": METADATA,
            "ttl_seconds": ttl(min_ttl_s),
        },
        "name",
    )


def add_metrics(max_keys: int, max_key_chars: int) -> dict:
    return obj(
        {"step": {"type": "integer", "minimum": 0}, "reward_name": {"type": "string", "maxLength": 128}},
        "step",
        additionalProperties={"type": "number"},
        propertyNames={"maxLength": max_key_chars},
        maxProperties=max_keys + 1,
        description="step plus up to 64 named numbers (reward mean/std...) and a reward_name",
    )


# -- run control (notebook API) -----------------------------------------------------------------
HEARTBEAT = obj(
    {
        "state": {
            "type": "string",
            "enum": ["starting", "running", "pausing", "paused", "stopping", "stopped", "finished", "failed"],
            "description": "the notebook Run's state, as its kernel sees it",
        }
    }
)
RUN_CONTROL = obj(
    {
        "action": {"type": "string", "enum": list(CONTROL_ACTIONS)},
        "reason": {"type": "string", "minLength": 1, "maxLength": 200},
    },
    "action",
)


# -- detached jobs (/openrl/v1/jobs, api/jobs.py; the checks are engine/jobs.py's) -------------------
JOB_NAME: dict = {"type": "string", "pattern": JOB_NAME_PATTERN}
SHA256: dict = {
    "type": "string",
    "pattern": "^[0-9a-fA-F]{64}$",
    "description": "SHA-256 of the decoded payload",
}
REWARD_NAME: dict = {"type": ["string", "null"], "minLength": 1, "maxLength": 128}


def job_payload_b64(lim: Limits) -> dict:
    return {
        "type": "string",
        "contentEncoding": "base64",
        "minLength": 1,
        "maxLength": (lim.max_job_payload_bytes + 2) // 3 * 4,
        "description": "the payload bytes, standard base64; decoded at most OPENRL_MAX_JOB_PAYLOAD_BYTES; "
        "stored and returned as they are, never unpickled",
    }


HELLO_B64 = "aGVsbG8="  # b"hello": an example payload and its SHA-256
HELLO_SHA256 = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"


def submit_job(lim: Limits) -> dict:
    return obj(
        {
            "name": JOB_NAME,
            "kind": {"type": "string", "enum": ["run", "sweep"]},
            "where": {"type": "string", "enum": ["local", "k8s"]},
            "payload": job_payload_b64(lim),
            "payload_sha256": SHA256,
            "reward": REWARD_NAME,
            "meta": {
                "type": "object",
                "maxProperties": 32,
                "propertyNames": {"maxLength": 64},
                "additionalProperties": {
                    "anyOf": [
                        {"type": "string", "maxLength": 256},
                        {"type": "number"},
                        {"type": "boolean"},
                        {"type": "null"},
                    ]
                },
            },
            "k8s": obj(
                {
                    "image": STR,
                    "volumes": {"type": "array", "items": STR},
                    "cpu": STR,
                    "memory": STR,
                },
                additionalProperties=False,
                description="only with where=k8s; checked against the service's allowed images, volumes "
                "and limits",
            ),
        },
        "name",
        "kind",
        "where",
        "payload",
        "payload_sha256",
        example={
            "name": "sql-rl",
            "kind": "run",
            "where": "local",
            "payload": HELLO_B64,
            "payload_sha256": HELLO_SHA256,
            "reward": "sql",
            "meta": {"steps": 20, "model": "openrl/tiny"},
        },
    )


def add_job_payload(lim: Limits) -> dict:
    return obj(
        {"payload": job_payload_b64(lim), "payload_sha256": SHA256, "reward": REWARD_NAME},
        "payload",
        "payload_sha256",
    )


JOB_STATE = obj(
    {
        "state": {"type": "string", "enum": list(JOB_STATES)},
        "pid": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
        "host": {"type": "string", "maxLength": 255},
        "message": {"type": "string", "maxLength": 2000},
    },
    "state",
)
JOB_CONTROL = RUN_CONTROL
