"""The service's records of what it holds, as data: the models it serves, sessions, runs and
sampler snapshots. The registry (engine/registry.py) owns the maps of them; the journal
(engine/durability.py) captures and restores them.

    ServedModel    one base model the service serves, with its own trainer and sampler
    SessionRecord  a client connection (Tinker ServiceClient, or one notebook run); owns runs and samplers
    RunState       one LoRA training run on one base model: adapter + optimizer + gradients, ordered by seq_id
    SamplerEntry   an immutable adapter snapshot (or the bare base model, or a checkpoint) to sample
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from openrl_service.models.loading import BaseModel
from openrl_service.training.lora import Adapter, LoraSpec
from openrl_service.training.trainer import Trainer, TrainState


@dataclass
class ServedModel:
    """One base model the service serves, with its own trainer and sampler (made on the worker)."""

    base: BaseModel
    trainer: Trainer
    sampler: Any  # TorchSampler, or what TrainingService._make_sampler makes

    @property
    def name(self) -> str:
        return self.base.name


@dataclass
class SessionRecord:
    """A client connection (a Tinker ServiceClient, or one notebook run): owns runs and samplers."""

    session_id: str
    tenant: str
    created_at: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)
    finished: bool = False
    finished_at: float | None = None
    tags: list[str] = field(default_factory=list)
    user_metadata: dict = field(default_factory=dict)
    display_name: str | None = None
    project_id: str | None = None
    run_ids: list[str] = field(default_factory=list)
    sampler_ids: list[str] = field(default_factory=list)
    finish_reason: str | None = None  # success | errored | interrupted | idle

    def record(self) -> dict:
        """What is kept on disk: enough to list, get and search the session after it ends."""
        status = (
            {"type": "client_finished", "reason": {"type": self.finish_reason or "success"}}
            if self.finished
            else {"type": "active"}
        )
        return {
            "session_id": self.session_id,
            "tenant": self.tenant,
            "created_at": self.created_at,
            "display_name": self.display_name,
            "project_id": self.project_id,
            "user_metadata": self.user_metadata,
            "tags": self.tags,
            "status": status,
            "training_run_ids": list(self.run_ids),
            "sampler_ids": list(self.sampler_ids),
        }


@dataclass
class RunState:
    """One LoRA training run: its owner, LoRA spec and seed; ``state`` holds the tensors once created."""

    run_id: str
    tenant: str
    session_id: str
    spec: LoraSpec
    seed: int
    base_model: str
    user_metadata: dict = field(default_factory=dict)
    state: TrainState | None = None
    created_at: float = field(default_factory=time.time)
    last_request_time: float = field(default_factory=time.time)


@dataclass
class SamplerEntry:
    """A sampler: an adapter snapshot, a checkpoint (tensors loaded on demand) or the bare base model."""

    sampler_id: str
    tenant: str
    session_id: str | None
    base_model: str
    adapter: Adapter | None
    model_path: str | None = None
    source_run: str | None = None
    created_at: float = field(default_factory=time.time)
    # an inflight sampling client of this run (SDK kind="inflight"): later inflight saves of the run
    # update its weights in place; None for a snapshot (fixed weights)
    inflight_of: str | None = None
    last_used: float = field(default_factory=time.time)


def new_session_id() -> str:
    return f"s{uuid.uuid4().hex[:16]}"


def spec_from_manifest(manifest: dict) -> LoraSpec:
    lora = manifest["lora"]
    return LoraSpec(
        rank=lora["rank"],
        train_attn=lora["train_attn"],
        train_mlp=lora["train_mlp"],
        train_unembed=lora["train_unembed"],
        alpha=lora.get("alpha", LoraSpec(1).alpha),
        optimizer=lora.get("optimizer", "adamw"),
    )
