"""Who owns what: sessions, training runs and samplers, their tenants, quotas and idle reaping.

Mixed into :class:`~openrl_service.engine.service.TrainingService`, which provides ``settings``,
``limits``, ``store``, ``engine``, ``models``, ``require_ready`` and ``checks``
(:class:`~openrl_service.engine.validation.Checks`). Every object belongs to a tenant; another
tenant gets "not found".

The records themselves (ServedModel, SessionRecord, RunState, SamplerEntry) are in engine/state.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from openrl_service.checks import integer
from openrl_service.config import Settings
from openrl_service.engine.durability import Durability
from openrl_service.engine.owner import (
    AddSampler,
    FinishSession,
    ForgetSession,
    ForgetTenant,
    OpenRun,
    OpenSession,
    Owner,
)
from openrl_service.engine.scheduler import Engine
from openrl_service.engine.state import (
    RunState,
    SamplerEntry,
    ServedModel,
    SessionRecord,
    new_session_id,
    spec_from_manifest,
)
from openrl_service.errors import NotFound, QuotaExceeded, UserError
from openrl_service.models.loading import BaseModel
from openrl_service.storage.checkpoints import CheckpointStore, parse_tinker_path
from openrl_service.training.lora import LoraSpec
from openrl_service.training.optim_params import optimizer_config

log = logging.getLogger(__name__)


class Registry:
    """Sessions, runs and samplers of every tenant: the maps below, read-only here; they change only
    through the commands of ``owner`` (engine/owner.py)."""

    settings: Settings
    durability: Durability
    store: CheckpointStore
    engine: Engine
    models: dict[str, ServedModel]
    owner: Owner
    sessions: Mapping[str, SessionRecord]
    runs: Mapping[str, RunState]
    samplers: Mapping[str, SamplerEntry]
    _evicted: Mapping[str, str]  # sampler id -> tenant, to explain a 404
    _ended: Mapping[str, str]  # forgotten finished session id -> tenant, to answer 410
    # Called as fn(tenant, session_id, run_ids) when a session finishes (by its client or the idle
    # reaper), so layers above the engine (the notebook API) drop what they keep for its runs.
    session_listeners: list[Callable[[str, str, list[str]], None]]
    # Called as fn(now) on each housekeeping round (after idle sessions are reaped), so layers above
    # the engine expire what they keep by age even when no new traffic arrives (the sample store).
    sweepers: list[Callable[[float], None]]
    # Called as fn(tenant) when a tenant is removed, so what layers above keep per tenant (cached
    # adapters of the OpenAI API, built exports) goes with it.
    tenant_forgetters: list[Callable[[str], None]]

    def _init_registry(self) -> None:
        # OPENRL_MAX_SAMPLER_SNAPSHOT_BYTES, or less: what the memory plan reserves (service._plan_memory)
        self.snapshot_bytes_cap = self.settings.max_sampler_snapshot_bytes
        self.session_listeners = []
        self.sweepers = []
        self.tenant_forgetters = []
        self.owner = Owner(
            journal=lambda record: self.durability.append(record),
            cut_lock=self.durability.state_lock,
            limits=self.limits,
            settings=self.settings,
            snapshot_bytes_cap=lambda: self.snapshot_bytes_cap,
            write_session=lambda sess: self.store.write_session(sess.tenant, sess.record()),
            open_lane=lambda run_id: self.engine.open_ordered_lane(run_id, next_seq=0),
            close_lane=self.engine.close_lane,
            session_listeners=self.session_listeners,
        )
        self.sessions = self.owner.sessions
        self.runs = self.owner.runs
        self.samplers = self.owner.samplers
        self._ended = self.owner.ended
        self._evicted = self.owner.evicted

    # -- sessions -------------------------------------------------------------------------------
    def create_session(
        self,
        tenant: str,
        *,
        tags=None,
        user_metadata=None,
        display_name=None,
        project_id=None,
        session_id: str | None = None,
    ) -> SessionRecord:
        """A new session (``session_id`` is given only by a journal replay of the request that made it)."""
        if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
            raise UserError("tags must be a list of strings", field="tags")
        for name, value in (("display_name", display_name), ("project_id", project_id)):
            if value is not None and (not isinstance(value, str) or len(value) > 256):
                raise UserError(f"{name} must be a string of at most 256 characters", field=name)
        self.checks.check_metadata({"tags": tags or []}, "tags")
        if not self.durability.replaying:  # a replay re-creates what was accepted
            live = sum(1 for s in list(self.sessions.values()) if s.tenant == tenant and not s.finished)
            if live >= self.limits.max_sessions_per_tenant:
                raise QuotaExceeded(
                    f"this tenant has {live} live sessions, the most (OPENRL_MAX_SESSIONS_PER_TENANT="
                    f"{self.limits.max_sessions_per_tenant}); finish sessions you no longer use "
                    "(ServiceClient.close(), or delete notebook runs; idle ones finish after "
                    "OPENRL_SESSION_IDLE_TIMEOUT_S)",
                    field="session_id",
                )
        fields = vars(
            SessionRecord(
                session_id=session_id or new_session_id(),
                tenant=tenant,
                tags=list(tags or []),
                user_metadata=self.checks.check_metadata(user_metadata),
                display_name=display_name,
                project_id=project_id,
            )
        )
        return self.owner.apply(OpenSession(fields))

    def restore_session(self, fields: dict) -> SessionRecord | None:
        """A session again, from its journal record (recovery); None when it is known already or
        ended since."""
        return self.owner.apply(OpenSession(fields, restored=True))

    def session(self, tenant: str, session_id: str, *, live: bool = True) -> SessionRecord:
        sess = self.sessions.get(session_id)
        if sess is None or sess.tenant != tenant:
            raise NotFound(f"unknown session_id {session_id!r}", field="session_id")
        if live and sess.finished:
            raise UserError(
                f"session {session_id} is finished; start a new ServiceClient", field="session_id"
            )
        return sess

    def heartbeat(self, tenant: str, session_id: str) -> bool:
        """False once the session is finished (the SDK stops heartbeating on 410)."""
        if self._ended.get(session_id) == tenant:
            return False
        sess = self.session(tenant, session_id, live=False)
        sess.last_heartbeat = time.time()
        return not sess.finished

    def finish_session(self, tenant: str, session_id: str, reason: str = "success") -> None:
        """Mark finished and free its runs and samplers from device memory; checkpoints stay."""
        self.session(tenant, session_id, live=False)
        self.owner.apply(FinishSession(tenant, session_id, reason))

    def reap_idle_sessions(self, now: float | None = None) -> list[str]:
        """Finish live sessions with no heartbeat or request for ``session_idle_timeout_s`` (a client
        that died), and forget sessions finished longer ago than that; then run the ``sweepers``.
        Returns the sessions finished."""
        now = time.time() if now is None else now
        timeout = self.settings.session_idle_timeout_s
        idle = []
        for sess in list(self.sessions.values()):
            if sess.finished:
                if now - (sess.finished_at or now) > timeout:
                    self.owner.apply(ForgetSession(sess.session_id))
                continue
            runs = [self.runs[r].last_request_time for r in sess.run_ids if r in self.runs]
            if now - max([sess.last_heartbeat, *runs]) > timeout:
                idle.append(sess)
        for sess in idle:
            log.info(
                "finishing idle session %s (no heartbeat for %.0f s)",
                sess.session_id,
                now - sess.last_heartbeat,
            )
            self.finish_session(sess.tenant, sess.session_id, reason="interrupted")
        for sweep in self.sweepers:
            sweep(now)
        return [s.session_id for s in idle]

    # -- tenants --------------------------------------------------------------------------------
    def remove_tenant(self, tenant: str, *, move_to: str | None = None) -> dict:
        """Forget ``tenant``: end its sessions (its runs and samplers leave the device) and remove its
        files, or move them to ``move_to``. Journaled first, so a restart replays the removal and
        nothing of the tenant comes back. Its jobs and minted keys are the caller's (api/admin.py)."""
        live = self.owner.apply(ForgetTenant(tenant, move_to))
        return self._forget_tenant_files(tenant, move_to, live)

    def _forget_tenant_files(self, tenant: str, move_to: str | None, live: list[SessionRecord]) -> dict:
        freed = self.store.forget_tenant(tenant, Path(move_to) if move_to else None)
        for forget in self.tenant_forgetters:
            forget(tenant)
        log.warning(
            "tenant %s removed: %d sessions ended, %d checkpoint bytes %s",
            tenant,
            len(live),
            freed,
            f"moved to {move_to}" if move_to else "deleted",
        )
        return {"tenant": tenant, "sessions_ended": len(live), "checkpoint_bytes": freed, "moved_to": move_to}

    def _replay_forget_tenant(self, record: tuple) -> None:
        _, tenant, move_to = record
        self._forget_tenant_files(tenant, move_to, self.owner.apply(ForgetTenant(tenant, move_to)))

    # -- runs -----------------------------------------------------------------------------------
    def run(self, tenant: str, model_id: str) -> RunState:
        run = self.runs.get(model_id)
        if run is None or run.tenant != tenant:
            raise NotFound(f"unknown model_id {model_id!r}", field="model_id")
        return run

    def served(self, name: str | None, field_name: str = "base_model") -> ServedModel:
        """The served model ``name`` (None: the default, the first one); NotFound names the field and
        lists the served models; a name that is not a string is a UserError (400) naming the field."""
        default = self.require_ready()
        if name is not None and not isinstance(name, str):
            raise UserError(
                f"{field_name} must be a served model's name (a string) or absent; got "
                f"{type(name).__name__} {repr(name)[:100]}",
                field=field_name,
            )
        model = self.models.get(default.name if name is None else name)
        if model is None:
            served = ", ".join(repr(n) for n in self.models)
            raise NotFound(
                f"{field_name}: model {name[:200]!r} is not served here; this service serves {served}",
                field=field_name,
            )
        return model

    def _check_base_model(self, name: str | None, field_name: str = "base_model") -> str:
        """The served model's name for ``name`` (None: the default model's)."""
        return self.served(name, field_name).name

    def model_of(self, owner: RunState | SamplerEntry) -> ServedModel:
        """The model a run or sampler was made on."""
        model = self.models.get(owner.base_model)
        if model is None:  # recovery refuses state of unserved models; this is a safety net
            raise NotFound(f"model {owner.base_model!r} is not served here", field="base_model")
        return model

    def base_of_run(self, tenant: str, model_id: str) -> BaseModel:
        """The base model of run ``model_id``, or the default one when there is no such run (the op
        that follows then refuses it)."""
        run = self.runs.get(model_id)
        if run is not None and run.tenant == tenant and run.base_model in self.models:
            return self.models[run.base_model].base
        return self.require_ready()

    def base_of_sampler(self, tenant: str, sampler_id: str) -> BaseModel:
        """The base model of sampler ``sampler_id``, or the default one when there is no such sampler."""
        entry = self.samplers.get(sampler_id)
        if entry is not None and entry.tenant == tenant and entry.base_model in self.models:
            return self.models[entry.base_model].base
        return self.require_ready()

    def _register_run(
        self,
        tenant: str,
        session: SessionRecord,
        model_seq_id: int,
        spec: LoraSpec,
        seed: int,
        user_metadata: dict | None,
        base_model: str,
    ) -> RunState:
        integer(model_seq_id, "model_seq_id", 0)
        run_id = f"{session.session_id}:train:{model_seq_id}"
        return self.owner.apply(
            OpenRun(run_id, tenant, session.session_id, spec, seed, base_model, dict(user_metadata or {}))
        )

    def _write_run_meta(self, run: RunState, **extra) -> None:
        self.store.write_run_meta(
            run.tenant,
            run.run_id,
            {
                "run_id": run.run_id,
                "tenant": run.tenant,
                "session_id": run.session_id,
                "base_model": run.base_model,
                "lora": run.spec.to_json(),
                "seed": run.seed,
                "created_at": run.created_at,
                "user_metadata": run.user_metadata,
                "project_id": getattr(self.sessions.get(run.session_id), "project_id", None),
                **extra,
            },
        )
        sess = self.sessions.get(run.session_id)
        if sess is not None:
            self.store.write_session(run.tenant, sess.record())

    def get_info(self, tenant: str, model_id: str) -> dict:
        run = self.run(tenant, model_id)
        base = self.model_of(run).base
        return {
            "type": "get_info",
            "model_id": run.run_id,
            "model_data": {"arch": base.arch, "model_name": base.name, "tokenizer_id": base.name},
            "is_lora": not run.spec.full,
            "lora_rank": run.spec.rank or None,  # a full fine-tune has none
            "model_name": base.name,
            "optimizer_config": optimizer_config(run.spec.optimizer),
        }

    # -- samplers -------------------------------------------------------------------------------
    def sampler_entry(self, tenant: str, sampler_id: str) -> SamplerEntry:
        entry = self.samplers.get(sampler_id)
        if entry is None and self._evicted.get(sampler_id) == tenant:
            raise NotFound(
                f"sampler {sampler_id} was evicted: each tenant keeps its "
                f"{self.settings.max_sampler_snapshots_per_tenant} most recently used snapshots "
                "(OPENRL_MAX_SAMPLER_SNAPSHOTS_PER_TENANT) and the service "
                f"{self.settings.max_sampler_snapshots} (OPENRL_MAX_SAMPLER_SNAPSHOTS) within "
                "OPENRL_MAX_SAMPLER_SNAPSHOT_BYTES, the tenant holding the most giving way first; "
                "save weights for a new sampling client",
                field="sampling_session_id",
            )
        if entry is None or entry.tenant != tenant:
            raise NotFound(f"unknown sampling_session_id {sampler_id!r}", field="sampling_session_id")
        return entry

    def create_sampler(
        self, tenant: str, *, session_id: str, seq_id: Any, base_model: str | None, model_path: str | None
    ) -> str:
        """A sampler on the base model or on a saved checkpoint; returns its id at once (the checkpoint's
        tensors load on the worker with its first sample request)."""
        sess = self.session(tenant, session_id)
        integer(seq_id, "sampling_session_seq_id", 0)
        sampler_id = f"{sess.session_id}:sample:{seq_id}"
        existing = self.samplers.get(sampler_id)
        if existing is not None and existing.tenant == tenant:
            return sampler_id  # a retry
        args = {
            "session_id": session_id,
            "seq_id": seq_id,
            "base_model": base_model,
            "model_path": model_path,
        }
        if model_path is None:
            name = args["base_model"] = self._check_base_model(base_model)  # journaled resolved
            self.owner.apply(
                AddSampler(sampler_id, tenant, sess.session_id, name, journal=("sampler", tenant, args))
            )
            return sampler_id
        ref = parse_tinker_path(model_path, field="model_path")
        manifest = self.store.manifest(tenant, ref)
        model = self.served(manifest.get("base_model"), "model_path")
        name = model.name
        self.checks.check_adapter_file(
            tenant, ref, spec_from_manifest(manifest), "model_path", base=model.base
        )
        if base_model is not None and self._check_base_model(base_model) != name:
            raise UserError(
                f"base_model: {ref.path} was trained on {name!r}, not {base_model!r}", field="base_model"
            )
        self.owner.apply(
            AddSampler(
                sampler_id,
                tenant,
                sess.session_id,
                name,
                model_path=ref.path,
                source_run=ref.run_id,
                journal=("sampler", tenant, args),
            )
        )
        return sampler_id
