"""The request bodies of the JSON routes, as pydantic models: one definition is both the check and
the published shape.

A route reads its body with :func:`openrl_service.api.http.read_model`; a body the model refuses
is a 400 whose ``field`` is the path of the first refused value (``sampling_params.max_tokens``,
``prompt.chunks[0].tokens``) and whose message names the limit and the setting behind it, as every
other refusal does (:func:`openrl_common.checks.requirement`). ``/openapi.json`` publishes the same
models (:func:`body`), so a client generator, a reader or a fuzzer (``make fuzz``) builds bodies the
service accepts: required fields, types, ranges (from :class:`Limits`), enums, patterns and sizes.

- Unknown fields are ignored (newer Tinker SDKs add some); a ``null`` is the same as a field left
  out (the SDK sends ``null`` for every option it does not set).
- The limits come from the running service's settings, so the models are built per service
  (:class:`Bodies`); those that take no setting are module-level.
- What a model cannot know stays with the engine, which checks it before any work is queued: a
  prompt plus ``max_tokens`` must fit the model's context, token ids must be below its vocabulary
  size, a ``tinker://`` path must name a checkpoint the caller may read, ``user_metadata`` must be at
  most ``OPENRL_MAX_METADATA_BYTES`` as JSON. The descriptions say so.
- An op ordered by ``seq_id`` takes its slot even when its body is refused (or the run would wait for
  a gap): see :func:`openrl_service.api.http.read_op`.

The OpenAPI links (how one reply feeds the next request) are in :mod:`openrl_service.api.links`.
Operation ids are ``<router>_<handler name>`` (``tinker_create_model``, ``rest_get_session``,
``native_create_run``): :func:`operation_ids` makes them.
"""

import dataclasses
import functools
from typing import Annotated, Any, Literal

from fastapi.routing import APIRoute
from pydantic import ConfigDict, Field, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

from openrl_common.checks import requirement
from openrl_common.protocol import CONTROL_ACTIONS, JOB_NAME_PATTERN, JOB_STATES, RL_LOSSES
from openrl_service.api.fields import (
    FLOAT32_MAX,
    INT32_MAX,
    SOME_LAYERS,
    Body,
    CheckpointName,
    Choice,
    Int,
    Metadata,
    Num,
    OneOf,
    SeqId,
    Sized,
    Str,
    TinkerPath,
    Token,
    Ttl,
    at_least_one_layer,
    explained,
    one_of_forms,
    require_form,
)
from openrl_service.config import Limits
from openrl_service.engine.native import MAX_METRIC_KEY_CHARS, MAX_METRIC_KEYS
from openrl_service.engine.native_checks import MAX_KL_COEF, loss_config_keys, unknown_key
from openrl_service.engine.native_state import KERNEL_STATES

MAX_KEY_NAME_CHARS = 100  # a minted key's name
JOB_KINDS = ("run", "sweep")
JOB_WHERES = ("local", "k8s")
MAX_META_VALUES = 32  # a job's meta: named scalars
MAX_META_KEY_CHARS = 64
MAX_META_STR_CHARS = 256
MAX_REWARD_CHARS = 128
MAX_HOST_CHARS = 255  # a job's state report
MAX_MESSAGE_CHARS = 2000
HELLO_B64 = "aGVsbG8="  # b"hello": an example payload and its SHA-256
HELLO_SHA256 = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"


def operation_ids(prefix: str):
    """``generate_unique_id_function`` of a router: ``<prefix>_<handler name>``."""

    def make(route: APIRoute) -> str:
        return f"{prefix}_{route.name}"

    return make


# -- shared pieces ------------------------------------------------------------------------------------
class AdamParams(Body):
    """AdamW's parameters (training.trainer.adam_params); each left out keeps its default."""

    learning_rate: Num(0, FLOAT32_MAX) | None = None
    beta1: Num(0, below=1) | None = None
    beta2: Num(0, below=1) | None = None
    eps: Num(0, FLOAT32_MAX) | None = None
    weight_decay: Num(0, FLOAT32_MAX) | None = None
    grad_clip_norm: Num(0, FLOAT32_MAX) | None = None


class Message(Body):
    """A chat message: role and content, and whatever else the chat template reads (name,
    tool_call_id...), passed on as sent."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str


ChatMessage = Annotated[
    Message, explained(lambda v: requirement("a {role, content} message of two strings", v))
]


class FinishReason(Body):
    type: str | None = None


class OptimizerConfig(Body):
    """The optimizer a run is created with (training.trainer.optimizer_kind)."""

    type: Literal["adamw", "dimuon"] = "adamw"
    version: Literal[1] | None = None


class DimuonParams(Body):
    """Dimuon's step parameters (training.trainer.dimuon_params): SDK 0.38 sends the first three."""

    type: Literal["dimuon"] = "dimuon"
    learning_rate: Num(0, FLOAT32_MAX)
    grad_clip_norm: Num(-FLOAT32_MAX, FLOAT32_MAX) | None = None
    beta1: Num(0, below=1) | None = None
    damping: Num(0, FLOAT32_MAX, lo_open=True) | None = None
    rank_lr_correction_exponent: Num(-8, 8) | None = None


class ModelId(Body):
    model_id: str


class RequestId(Body):
    request_id: str


class SessionHeartbeat(Body):
    session_id: str


class Finish(Body):
    reason: FinishReason | None = None


class WeightsInfo(Body):
    tinker_path: TinkerPath


class Export(Body):
    tinker_path: TinkerPath
    merged: bool = Field(
        False,
        description="false: a PEFT adapter folder; true: a Hugging Face model folder with the adapter merged in",
    )


class AssignProject(Body):
    project_id: Str(1, 256)


class Owner(Body):
    type: str | None = None


class StatusFilter(Body):
    type: str | None = None


class Cursor(Body):
    last_created_at: str = Field(description="as the previous page's next_cursor has it")
    last_session_id: str


class SearchSessions(Body):
    limit: Int(1, 200) | None = None
    owner: Owner | None = None
    session_id: str | None = None
    display_name: str | None = None
    user_metadata: dict[str, Any] | None = None
    project_ids: list[str] | None = None
    statuses: list[OneOf(str, StatusFilter, what="a status name or {type}")] | None = None
    cursor: Cursor | None = None


class Heartbeat(Body):
    state: Choice(*KERNEL_STATES) | None = Field(
        None, description="the notebook Run's state, as its kernel sees it"
    )


class Control(Body):
    action: Choice(*CONTROL_ACTIONS)
    reason: Str(1, 200) | None = None


class JobState(Body):
    state: Choice(*JOB_STATES)
    pid: Int(1, INT32_MAX) | None = None
    host: Str(max_length=MAX_HOST_CHARS) | None = None
    message: Str(max_length=MAX_MESSAGE_CHARS) | None = None


class MintKey(Body):
    name: Str(max_length=MAX_KEY_NAME_CHARS) | None = None


class TrainSample(Body):
    """A sample, or an episode's turns in order (their sample ids; engine/native.py checks one is given)."""

    sample_id: str | None = None
    episode: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    advantage: Num()


def _loss_config_schema(loss: str) -> dict:
    """The config keys a loss takes on the notebook API (engine/native_checks.py), each a number."""
    keys = loss_config_keys(loss)
    return {
        "type": "object",
        "properties": {k: {"type": "number"} for k in keys},
        "additionalProperties": False,
    }


class TrainStep(Body):
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {
                    "properties": {"loss": {"const": x}, "loss_config": _loss_config_schema(x)},
                    "required": ["loss"],
                }
                for x in RL_LOSSES
            ]
            + [
                {
                    "not": {"required": ["loss"]},
                    "properties": {"loss_config": _loss_config_schema("importance_sampling")},
                }
            ]
        }
    )

    samples: Annotated[list[TrainSample], Field(min_length=1)]
    loss: Choice(*RL_LOSSES) | None = None
    loss_config: dict[str, Num(-FLOAT32_MAX, FLOAT32_MAX, setting="float32's range")] | None = Field(
        None, description="the loss's own keys; clip_low_threshold <= clip_high_threshold"
    )
    optimizer: AdamParams | None = None
    kl_coef: Num(0, MAX_KL_COEF) | None = Field(None, description="weight of the KL to the start weights")

    @model_validator(mode="after")
    def _config_keys(self):
        loss = self.loss or "importance_sampling"
        unknown = sorted(set(self.loss_config or {}) - set(loss_config_keys(loss)))
        if unknown:
            why = unknown_key(loss, unknown[0])
            raise PydanticCustomError("form", "{why}", {"why": why, "field": f"loss_config.{unknown[0]}"})
        return self


class JobMeta(Body):
    """A job's meta: up to 32 named scalars (a string of at most 256 characters)."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "maxProperties": MAX_META_VALUES,
            "propertyNames": {"maxLength": MAX_META_KEY_CHARS},
        },
    )
    __pydantic_extra__: dict[
        str,
        OneOf(
            Str(max_length=MAX_META_STR_CHARS),
            int,  # (before float: a whole number stays whole, "steps": 20 is not 20.0)
            float,
            bool,
            None,
            what=f"a string of at most {MAX_META_STR_CHARS} characters, a number, a boolean or null",
        ),
    ]

    @model_validator(mode="after")
    def _sized(self):
        extra = self.__pydantic_extra__ or {}
        if len(extra) > MAX_META_VALUES:
            raise PydanticCustomError(
                "explained", "{why}", {"why": f"at most {MAX_META_VALUES} values; got {len(extra)}"}
            )
        for k in extra:
            if len(k) > MAX_META_KEY_CHARS:
                raise PydanticCustomError(
                    "explained",
                    "{why}",
                    {"why": f"the name {k[:32]!r}… has {len(k)} characters; at most {MAX_META_KEY_CHARS}"},
                )
        return self


class JobK8s(Body):
    model_config = ConfigDict(extra="forbid")

    image: str | None = None
    volumes: list[str] | None = None
    cpu: str | int | float | None = Field(None, description="a Kubernetes quantity: 2, 0.5 or 500m")
    memory: str | int | float | None = Field(None, description="a Kubernetes quantity: 4Gi or bytes")


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: Int(0)
    base_model: str | None = None
    model_path: TinkerPath | None = None


# -- the models a service's limits shape ----------------------------------------------------------------
class Bodies:
    """The request models of one service: the limits in them are its settings'."""

    def __init__(self, lim: Limits, min_ttl_s: float):
        ttl = Ttl(min_ttl_s)
        Rank = Int(0, lim.max_rank, "OPENRL_MAX_RANK")  # 0: a full fine-tune
        NumSamples = Int(1, lim.max_num_samples, "OPENRL_MAX_NUM_SAMPLES")
        TopK = Int(0, lim.max_topk, "OPENRL_MAX_TOPK")

        def stop_rule(v: Any) -> str:
            n = lim.max_stop_sequences
            return requirement(
                f"a non-empty string, or a list of at most {n} non-empty strings or of at most {n} token ids "
                "(not a mix)",
                v,
                setting="OPENRL_MAX_STOP_SEQUENCES",
            )

        Stop = Annotated[
            Str(1)
            | Annotated[list[Str(1)], Field(max_length=lim.max_stop_sequences)]
            | Annotated[list[Token], Field(max_length=lim.max_stop_sequences)],
            explained(stop_rule),
        ]  # (token ids below the vocabulary size: the engine checks them against the model)

        def top_k_rule(v: Any) -> str:
            return requirement("an integer", v, 1, setting="or -1 for off")

        TopKSampling = Annotated[Int(1) | Literal[-1], explained(top_k_rule), Field(description="-1: off")]

        class SamplingFields(Body):
            max_tokens: (
                Int(
                    1,
                    lim.max_tokens,
                    "OPENRL_MAX_TOKENS",
                    description="prompt + max_tokens must fit the model's context length",
                )
                | None
            ) = None
            temperature: Num(0) | None = None
            top_p: Num(0, 1, lo_open=True) | None = None
            top_k: TopKSampling | None = None
            seed: Int() | None = None
            stop: Stop | None = None

        class LoraFields(Body):
            model_config = ConfigDict(json_schema_extra=SOME_LAYERS)

            rank: Rank | None = None
            seed: Int() | None = None
            train_attn: bool | None = None
            train_mlp: bool | None = None
            train_unembed: bool | None = None

        class LoraConfig(LoraFields):
            @model_validator(mode="after")
            def _some(self):
                return at_least_one_layer(self)

        class CreateSession(Body):
            tags: list[str] | None = None
            user_metadata: Metadata | None = None
            display_name: Str(max_length=256) | None = None
            project_id: Str(max_length=256) | None = None

        class CreateModel(Body):
            session_id: str
            model_seq_id: Int(0)
            base_model: str | None = None
            lora_config: LoraConfig | None = None
            optimizer_config: OptimizerConfig | None = None
            user_metadata: Metadata | None = None

        class OptimStep(Body):
            model_config = ConfigDict(
                json_schema_extra=one_of_forms(
                    ("model_id", "seq_id", "adam_params"),
                    ("model_id", "seq_id", "optimizer_params"),
                    description="AdamW's parameters (adam_params) or Dimuon's (optimizer_params), "
                    "matching the optimizer the run was created with",
                )
            )

            model_id: str
            seq_id: SeqId
            adam_params: AdamParams | None = None
            optimizer_params: DimuonParams | None = None

        class SaveWeights(Body):
            model_id: str
            seq_id: SeqId
            path: CheckpointName
            overwrite: bool | None = None
            user_metadata: Metadata | None = None
            ttl_seconds: ttl | None = None

        class SaveWeightsExternal(Body):
            model_id: str
            seq_id: SeqId
            path: CheckpointName
            ttl_seconds: ttl | None = None
            age_encryption_recipients: (
                Annotated[list[Any], Field(max_length=0, description="not supported")] | None
            ) = None

        class SaveForSampler(Body):
            model_config = ConfigDict(
                json_schema_extra=one_of_forms(
                    ("path",),
                    ("sampling_session_seq_id",),
                    description="a named sampler checkpoint (path), or a new sampling session "
                    "(sampling_session_seq_id)",
                )
            )

            model_id: str
            seq_id: SeqId
            path: CheckpointName | None = None
            sampling_session_seq_id: Int(0) | None = None
            user_metadata: Metadata | None = None
            ttl_seconds: ttl | None = None
            kind: Literal["snapshot", "inflight"] | None = Field(
                None,
                description="snapshot: fixed weights; inflight: the run's shared weights, updated by later inflight saves",
            )

            @model_validator(mode="before")
            @classmethod
            def _form(cls, data: Any) -> Any:  # model_id and seq_id first: without them there is no slot
                return require_form(
                    data, ("model_id", "seq_id", "path"), ("model_id", "seq_id", "sampling_session_seq_id")
                )

        LOAD_FORMS = (("model_id", "seq_id", "path"), ("session_id", "model_seq_id", "path"))

        class LoadWeights(Body):
            model_config = ConfigDict(
                json_schema_extra=one_of_forms(
                    *LOAD_FORMS,
                    description="load_state into a run (model_id + seq_id), or a new run from a "
                    "checkpoint (session_id + model_seq_id)",
                )
            )

            model_id: str | None = None
            seq_id: SeqId | None = None
            session_id: str | None = None
            model_seq_id: Int(0) | None = None
            path: TinkerPath | None = None
            optimizer: bool | None = None
            optimizer_config: OptimizerConfig | None = None
            base_model: str | None = None
            user_metadata: Metadata | None = None

            @model_validator(mode="before")
            @classmethod
            def _form(cls, data: Any) -> Any:
                new_run = (
                    isinstance(data, dict)
                    and data.get("model_id") is None
                    and data.get("session_id") is not None
                )
                return require_form(data, LOAD_FORMS[1] if new_run else LOAD_FORMS[0])

        class Chunk(Body):
            type: (
                Annotated[
                    Literal["encoded_text"],
                    explained(lambda v: f"{v!r} chunks are not supported by this model (text tokens only)"),
                ]
                | None
            ) = None
            tokens: list[Token]

        class Prompt(Body):
            chunks: Annotated[list[Chunk], Field(min_length=1)]

        class ASample(Body):
            model_config = ConfigDict(
                json_schema_extra={"description": "the prompt holds at least one token"}
            )

            sampling_session_id: str
            prompt: Prompt
            num_samples: NumSamples | None = None
            sampling_params: SamplingFields | None = None
            prompt_logprobs: bool | None = None
            topk_prompt_logprobs: TopK | None = None
            topk_sample_logprobs: TopK | None = None
            prompt_logprobs_last_n: Int(1) | None = None
            record_stability_info: bool | None = Field(
                None, description="record each sampled sequence for stable_reinforce (by its sequence id)"
            )
            prompt_alt_tokens_k: Any = Field(None, description="not supported")
            target_prompt_logprobs: Any = Field(None, description="not supported")

        class SetTtl(Body):
            ttl_seconds: ttl | None = Field(description="null clears the expiry")

        class CopyWeights(Body):
            model_config = ConfigDict(
                json_schema_extra=one_of_forms(
                    ("source_path", "session_id", "model_seq_id"),
                    ("source_path", "destination_project_id"),
                    description="into a session's run slot (session_id + model_seq_id) or a new session "
                    "of a project",
                )
            )

            source_path: TinkerPath
            ttl_seconds: ttl | None = None
            session_id: str | None = None
            model_seq_id: Int(0) | None = None
            destination_project_id: Str(1) | None = None

            @model_validator(mode="before")
            @classmethod
            def _form(cls, data: Any) -> Any:
                return require_form(
                    data,
                    ("source_path", "session_id", "model_seq_id"),
                    ("source_path", "destination_project_id"),
                )

        class CreateRun(LoraFields):
            name: Str(1, 128) | None = None
            base_model: str | None = None
            user_metadata: Metadata | None = None
            load_from: Str(1) | None = Field(
                None, description="a tinker:// checkpoint to start from (weights only)"
            )
            steps: Int(1) | None = Field(None, description="the steps the notebook plans (shown in listings)")

            @model_validator(mode="after")
            def _some(self):
                return at_least_one_layer(self, "train_attn")

        class TokenPrompt(Body):
            tokens: Annotated[list[Token], Field(min_length=1)]

        # text, chat messages, or token ids as they are ({"tokens": [...]}: an environment's observation)
        TextPrompt = Str(1) | Annotated[list[ChatMessage], Field(min_length=1)] | TokenPrompt

        class NativeSample(SamplingFields):
            prompts: Sized(TextPrompt, lim.max_datums, "OPENRL_MAX_DATUMS", min_items=1)
            chat: bool | None = None
            num_samples: NumSamples | None = None

        class SftExample(Body):
            prompt: Str(1) | Annotated[list[ChatMessage], Field(min_length=1)]
            completion: str = Field(description="what the model should answer (then its turn ends)")

        class SftStep(Body):
            model_config = ConfigDict(
                json_schema_extra={"example": {"examples": [{"prompt": "2+3=", "completion": "5"}]}}
            )

            examples: Sized(SftExample, lim.max_datums, "OPENRL_MAX_DATUMS", min_items=1)
            chat: bool | None = Field(None, description="render prompts with the chat template (default)")
            optimizer: AdamParams | None = None

        class SaveCheckpoint(Body):
            name: CheckpointName
            overwrite: bool | None = None
            user_metadata: Metadata | None = None
            ttl_seconds: ttl | None = None

        class AddMetrics(Body):
            model_config = ConfigDict(
                extra="allow",
                json_schema_extra={
                    "maxProperties": MAX_METRIC_KEYS + 1,
                    "propertyNames": {"maxLength": MAX_METRIC_KEY_CHARS},
                    "description": f"step plus up to {MAX_METRIC_KEYS} named numbers (reward mean/std...) "
                    "and a reward_name",
                },
            )
            # a whole number stays whole (a reward version), others are finite floats; null: not measured
            __pydantic_extra__: dict[str, OneOf(int, Num(), None, what="a finite number or null")]

            step: Int(0)
            reward_name: Str(max_length=128) | None = None

        payload_chars = (lim.max_job_payload_bytes + 2) // 3 * 4

        def payload_size(value: Any, handler):
            if isinstance(value, str) and len(value) > payload_chars:
                limit = lim.max_job_payload_bytes
                why = f"decodes to more than {limit} bytes (OPENRL_MAX_JOB_PAYLOAD_BYTES={limit})"
                raise PydanticCustomError("too_large", "{why}", {"why": why})
            return handler(value)

        Payload = Annotated[
            Str(
                1,
                payload_chars,
                json_schema_extra={"contentEncoding": "base64"},
                description="the payload bytes, standard base64; decoded at most "
                "OPENRL_MAX_JOB_PAYLOAD_BYTES; stored and returned as they are, never unpickled",
            ),
            WrapValidator(payload_size),
        ]
        Sha256 = Str(pattern="^[0-9a-fA-F]{64}$", description="SHA-256 of the decoded payload")
        Reward = Str(1, MAX_REWARD_CHARS)

        class AddJobPayload(Body):
            payload: Payload
            payload_sha256: Sha256
            reward: Reward | None = None

        class SubmitJob(AddJobPayload):
            model_config = ConfigDict(
                json_schema_extra={
                    "example": {
                        "name": "sql-rl",
                        "kind": "run",
                        "where": "local",
                        "payload": HELLO_B64,
                        "payload_sha256": HELLO_SHA256,
                        "reward": "sql",
                        "meta": {"steps": 20, "model": "openrl/tiny"},
                    }
                }
            )

            name: Str(pattern=JOB_NAME_PATTERN)
            kind: Choice(*JOB_KINDS)
            where: Choice(*JOB_WHERES)
            meta: JobMeta | None = None
            k8s: JobK8s | None = Field(
                None,
                description="only with where=k8s; checked against the service's allowed images, volumes "
                "and limits",
            )

        for name, value in [*globals().items(), *locals().items()]:  # (the fixed ones too: one place)
            if isinstance(value, type) and issubclass(value, Body) and value is not Body:
                setattr(self, name, value)


def bodies(lim: Limits, min_ttl_s: float) -> Bodies:
    """The request models of a service with these limits (built once per distinct limits)."""
    return _bodies(dataclasses.astuple(lim), min_ttl_s)


@functools.lru_cache(maxsize=8)
def _bodies(limits: tuple, min_ttl_s: float) -> Bodies:
    return Bodies(Limits(*limits), min_ttl_s)
