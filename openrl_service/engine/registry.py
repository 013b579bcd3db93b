"""Who owns what: sessions, training runs and samplers, their tenants, quotas and idle reaping.

Mixed into :class:`~openrl_service.engine.service.TrainingService`, which provides ``settings``,
``limits``, ``store``, ``engine``, ``models``, ``require_ready`` and ``checks``
(:class:`~openrl_service.engine.validation.Checks`). Every object belongs to a tenant; another
tenant gets "not found".

The records themselves (ServedModel, SessionRecord, RunState, SamplerEntry) are in engine/state.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from openrl_service.checks import integer
from openrl_service.config import Settings
from openrl_service.engine.durability import Durability
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
    """Sessions, runs and samplers of every tenant (the maps below), guarded by ``_lock``."""

    settings: Settings
    durability: Durability
    store: CheckpointStore
    engine: Engine
    models: dict[str, ServedModel]
    sessions: dict[str, SessionRecord]
    runs: dict[str, RunState]
    samplers: dict[str, SamplerEntry]
    _evicted: dict[str, str]  # sampler id -> tenant, to explain a 404
    _ended: dict[str, str]  # forgotten finished session id -> tenant, to answer 410
    _lock: threading.Lock
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
        self.sessions = {}
        self.runs = {}
        self.samplers = {}
        self._evicted = {}
        self._ended = {}
        self._lock = threading.Lock()
        self.session_listeners = []
        self.sweepers = []
        self.tenant_forgetters = []

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
        sess = SessionRecord(
            session_id=session_id or new_session_id(),
            tenant=tenant,
            tags=list(tags or []),
            user_metadata=self.checks.check_metadata(user_metadata),
            display_name=display_name,
            project_id=project_id,
        )
        with self.durability.change():
            self.durability.append(("session", vars(sess).copy()))
            with self._lock:
                self.sessions[sess.session_id] = sess
        self.store.write_session(tenant, sess.record())
        return sess

    def restore_session(self, fields: dict) -> SessionRecord:
        """A session again, from its journal record (recovery)."""
        sess = SessionRecord(**fields)
        with self._lock:
            self.sessions[sess.session_id] = sess
        return sess

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
        sess = self.session(tenant, session_id, live=False)
        with self.durability.change():
            self.durability.append(("finish", tenant, session_id, reason))
            with self._lock:
                if not sess.finished:
                    sess.finish_reason = (
                        reason if reason in ("success", "errored", "interrupted") else "success"
                    )
                sess.finished = True
                sess.finished_at = time.time()
                run_ids = [r for r in sess.run_ids if r in self.runs]
                for rid in run_ids:
                    gone = self.runs.pop(rid, None)
                    if gone is not None and gone.state is not None:
                        gone.state.adapter.leave()
                for sid in sess.sampler_ids:
                    self.samplers.pop(sid, None)
        self.store.write_session(tenant, sess.record())
        for rid in run_ids:
            self.engine.close_lane(f"run:{rid}")
        for listener in self.session_listeners:
            listener(tenant, session_id, list(sess.run_ids))

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
                    with self._lock:
                        self.sessions.pop(sess.session_id, None)
                        self._ended[sess.session_id] = sess.tenant
                        while len(self._ended) > 100_000:
                            self._ended.pop(next(iter(self._ended)))
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
        with self.durability.change():
            self.durability.append(("forget_tenant", tenant, move_to))
            live = self._forget_tenant_state(tenant)
        return self._forget_tenant_files(tenant, move_to, live)

    def _forget_tenant_state(self, tenant: str) -> list[SessionRecord]:
        """The tenant's sessions end and leave the maps (the record's change); returns those that were live."""
        live = [s for s in list(self.sessions.values()) if s.tenant == tenant and not s.finished]
        for sess in live:
            self.finish_session(tenant, sess.session_id, reason="interrupted")
        with self._lock:
            gone = [sid for sid, sess in self.sessions.items() if sess.tenant == tenant]
            for sid in gone:
                del self.sessions[sid]
                self._ended[sid] = tenant
            for sid in [sid for sid, e in self.samplers.items() if e.tenant == tenant]:
                del self.samplers[sid]
            for sid in [sid for sid, t in self._evicted.items() if t == tenant]:
                del self._evicted[sid]
        return live

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
        self._forget_tenant_files(tenant, move_to, self._forget_tenant_state(tenant))

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

    def _check_run_quota(self, tenant: str, spec: LoraSpec) -> None:
        mine = [r for r in self.runs.values() if r.tenant == tenant]
        if len(mine) >= self.limits.max_runs_per_tenant:
            raise QuotaExceeded(
                f"a tenant may hold at most {self.limits.max_runs_per_tenant} live runs (OPENRL_MAX_RUNS_PER_TENANT); "
                f"finish a session to free its runs",
                field="model_id",
            )
        full = sum(1 for r in mine if r.spec.full)
        if spec.full and full >= self.limits.max_full_runs_per_tenant:
            raise QuotaExceeded(
                f"rank: a tenant may hold at most {self.limits.max_full_runs_per_tenant} live full fine-tunes "
                f"(rank 0; OPENRL_MAX_FULL_RUNS_PER_TENANT), each a whole copy of the model's training state; "
                f"finish a session to free its runs, or train a LoRA (rank >= 1)",
                field="rank",
            )

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
        with self._lock:
            existing = self.runs.get(run_id)
            if existing is not None:
                return existing
            self._check_run_quota(tenant, spec)
            run = RunState(
                run_id=run_id,
                tenant=tenant,
                session_id=session.session_id,
                spec=spec,
                seed=seed,
                base_model=base_model,
                user_metadata=dict(user_metadata or {}),
            )
            self.runs[run_id] = run
            session.run_ids.append(run_id)
        self.engine.open_ordered_lane(run_id, next_seq=0)
        return run

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
    def _add_sampler(self, entry: SamplerEntry) -> None:
        """Register a sampler (not for a finished session: its owner is gone) and keep the budget."""
        with self._lock:
            sess = self.sessions.get(entry.session_id or "")
            if sess is not None and sess.finished:
                return
            self.samplers[entry.sampler_id] = entry
            if sess is not None:
                sess.sampler_ids.append(entry.sampler_id)
            self._enforce_snapshot_budget(keep=entry)

    def _enforce_snapshot_budget(self, keep: SamplerEntry) -> None:
        """Keep the adapters held in memory within each tenant's share and the service's budget.

        A tenant over OPENRL_MAX_SAMPLER_SNAPSHOTS_PER_TENANT loses its own least recently used
        snapshot; over the service's count, the tenant holding the most snapshots loses its least
        recently used one, and over its bytes the tenant holding the most bytes (a full fine-tune's
        snapshot is a whole model) — so one tenant's flood never evicts a neighbour that holds less.
        Inflight clients sharing one set of weights count it once. A snapshot that alone makes its
        owner the heaviest with nothing older to give is kept without evicting anyone else. A
        checkpoint-backed sampler only drops its tensors (they reload from disk on its next request);
        an ephemeral snapshot is forgotten. Caller holds the lock."""
        s = self.settings
        loaded = sorted(
            (x for x in self.samplers.values() if x.adapter is not None and x is not keep),
            key=lambda x: x.last_used,
        )
        per_tenant: dict[str, list[SamplerEntry]] = {}
        for x in loaded:  # each tenant's, least recently used first
            per_tenant.setdefault(x.tenant, []).append(x)
        per_tenant.setdefault(keep.tenant, [])
        mine = per_tenant[keep.tenant]
        cap = max(1, s.max_sampler_snapshots_per_tenant)
        victims: list[SamplerEntry] = []
        while mine and len(mine) + (keep.adapter is not None) > cap:
            victims.append(mine.pop(0))
        size = {id(x.adapter): x.adapter.nbytes() for x in [*loaded, keep] if x.adapter is not None}

        def nbytes(entries: list[SamplerEntry]) -> int:
            return sum(size[k] for k in {id(x.adapter) for x in entries})  # a shared (inflight) adapter once

        def held(tenant: str) -> list[SamplerEntry]:
            extra = [keep] if tenant == keep.tenant and keep.adapter is not None else []
            return per_tenant[tenant] + extra

        while True:
            every = [x for t in per_tenant for x in held(t)]
            over_count = len(every) > s.max_sampler_snapshots
            if not over_count and nbytes(every) <= self.snapshot_bytes_cap:
                break
            weigh = len if over_count else nbytes
            heaviest = max(
                (t for t in per_tenant if held(t)),
                key=lambda t: (weigh(held(t)), -held(t)[0].last_used),  # ties: the oldest snapshot
            )
            if not per_tenant[heaviest]:
                break  # only the new snapshot: its owner is over on its own, nobody else pays for it
            victims.append(per_tenant[heaviest].pop(0))
        for old in victims:
            if old.model_path is not None:
                old.adapter = None
                continue
            del self.samplers[old.sampler_id]
            sess = self.sessions.get(old.session_id or "")
            if sess is not None and old.sampler_id in sess.sampler_ids:
                sess.sampler_ids.remove(old.sampler_id)  # its record lists samplers that exist
            self._evicted[old.sampler_id] = old.tenant
            while len(self._evicted) > 100_000:
                self._evicted.pop(next(iter(self._evicted)))
            log.info("evicted sampler %s of %s (snapshot budget)", old.sampler_id, old.tenant)

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
            with self.durability.change():
                self.durability.append(("sampler", tenant, args))
                self._add_sampler(SamplerEntry(sampler_id, tenant, sess.session_id, name, None))
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
        with self.durability.change():
            self.durability.append(("sampler", tenant, args))
            self._add_sampler(
                SamplerEntry(
                    sampler_id,
                    tenant,
                    sess.session_id,
                    name,
                    None,
                    model_path=ref.path,
                    source_run=ref.run_id,
                )
            )
        return sampler_id
