"""The one owner of the registries: sessions, runs and samplers change only through its commands.

Like vLLM's ``EngineCore`` owns its scheduler's state, :class:`Owner` owns the maps of what the service
holds. Whoever wants a change (a request on the event loop, an op on the device worker, the idle reaper,
the admin API, recovery) builds a **command**, a frozen record of plain values, and hands it to
:meth:`Owner.apply`, which:

1. applies one command at a time, in one order (``applied`` counts them), under the owner's lock and
   the journal's cut lock (a snapshot sees every command whole or not at all);
2. writes the command's journal record first, where it has one (``record()``: the same tuples the
   journal has always held, so journals written before the owner replay unchanged);
3. decides inside the command what follows from it: the quota a new run must fit, which samplers the
   snapshot budget evicts, which runs a finished session frees;
4. returns the result and carries out the **effects** (writing a session's file, closing a run's lane,
   letting a run's device share go, telling listeners) after the locks are released: no lock is held
   across I/O or device work.

The maps (``sessions``, ``runs``, ``samplers``) are handed out read-only (``MappingProxyType``):
code outside the owner can look, not change. Everything a command decides follows from its fields and
the state before it, so two owners given the same commands in the same order hold the same registry
(tests/service/test_owner.py): that is what lets an engine spread over several processes send every
process the same commands, and what recovery does with the journal.

Tensors are not part of a command's record: an ``AddSampler`` of a snapshot carries the weights the
local worker made (``weights``), the way each process of a sharded engine holds its own shard.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from openrl_service.engine.state import RunState, SamplerEntry, SessionRecord
from openrl_service.errors import QuotaExceeded
from openrl_service.training.lora import LoraSpec

log = logging.getLogger(__name__)

TOMBSTONES = 100_000  # ids of forgotten sessions and evicted samplers kept to explain a 404 / 410


# -- commands --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenSession:
    """A new session (``restored``: brought back by recovery, not journaled again)."""

    fields: dict  # SessionRecord's fields
    restored: bool = False

    def record(self) -> tuple | None:
        return None if self.restored else ("session", dict(self.fields))


@dataclass(frozen=True)
class FinishSession:
    """A session ends: its runs and samplers are dropped (their device memory goes); files stay."""

    tenant: str
    session_id: str
    reason: str = "success"

    def record(self) -> tuple | None:
        return ("finish", self.tenant, self.session_id, self.reason)


@dataclass(frozen=True)
class ForgetSession:
    """A session finished long ago leaves the map; its id is kept to answer 410 (the idle reaper)."""

    session_id: str

    def record(self) -> tuple | None:
        return None


@dataclass(frozen=True)
class ForgetTenant:
    """A tenant's sessions end and leave the maps, with its samplers (admin; its files are the caller's)."""

    tenant: str
    move_to: str | None = None

    def record(self) -> tuple | None:
        return ("forget_tenant", self.tenant, self.move_to)


@dataclass(frozen=True)
class OpenRun:
    """A training run in a session, if the tenant's quotas allow it (its ``create_model`` or
    ``load_weights`` call is the journal record; the run's tensors are made by that op)."""

    run_id: str
    tenant: str
    session_id: str
    spec: LoraSpec
    seed: int
    base_model: str
    user_metadata: dict = field(default_factory=dict)

    def record(self) -> tuple | None:
        return None


@dataclass(frozen=True)
class LinkRun:
    """A run (a copied checkpoint's) is listed in a session."""

    session_id: str
    run_id: str

    def record(self) -> tuple | None:
        return None


@dataclass(frozen=True)
class AddSampler:
    """A sampler: on the base model, on a checkpoint (``model_path``), or on a run's snapshot
    (``weights``, made by the local worker; not part of the record). ``journal`` is the record of the
    request that made it, where that request is not an op of its own (``create_sampler``)."""

    sampler_id: str
    tenant: str
    session_id: str | None
    base_model: str
    model_path: str | None = None
    source_run: str | None = None
    inflight_of: str | None = None
    journal: tuple | None = None
    weights: Any = field(default=None, compare=False)

    def record(self) -> tuple | None:
        return self.journal


@dataclass(frozen=True)
class SamplerWeights:
    """A sampler's weights are in memory again (reloaded from its checkpoint), or, for ``inflight_of``,
    every inflight sampler of that run moves to ``weights``; the snapshot budget then applies."""

    sampler_id: str | None = None
    inflight_of: str | None = None
    weights: Any = field(default=None, compare=False)

    def record(self) -> tuple | None:
        return None


@dataclass(frozen=True)
class RestoreRegistry:
    """Recovery: what a journal snapshot held (runs with the tensors restored from their files)."""

    runs: tuple = ()  # RunState
    samplers: tuple = ()  # SamplerEntry
    ended: dict = field(default_factory=dict)
    evicted: dict = field(default_factory=dict)

    def record(self) -> tuple | None:
        return None


Command = (
    OpenSession
    | FinishSession
    | ForgetSession
    | ForgetTenant
    | OpenRun
    | LinkRun
    | AddSampler
    | SamplerWeights
    | RestoreRegistry
)


@dataclass
class Applied:
    """What a command decided: its result, the changes of the maps (made once its journal record is
    written: none if it cannot be), and what to do once the locks are released."""

    result: Any = None
    changes: list[Callable[[], None]] = field(default_factory=list)
    effects: list[Callable[[], None]] = field(default_factory=list)


class Owner:
    """Sessions, runs and samplers of every tenant, changed only by :meth:`apply`."""

    def __init__(
        self,
        *,
        journal: Callable[[tuple], None],
        cut_lock: Any,
        limits: Any,
        settings: Any,
        snapshot_bytes_cap: Callable[[], int],
        write_session: Callable[[SessionRecord], None],
        open_lane: Callable[[str], None],
        close_lane: Callable[[str], None],
        session_listeners: list[Callable[[str, str, list[str]], None]],
    ):
        self._journal = journal
        self._cut_lock = cut_lock  # the journal's: a snapshot's cut waits for a command to be whole
        self._limits = limits
        self._settings = settings
        self._cap = snapshot_bytes_cap
        self._write_session = write_session
        self._open_lane = open_lane
        self._close_lane = close_lane
        self._listeners = session_listeners
        self._lock = threading.RLock()
        self._sessions: dict[str, SessionRecord] = {}
        self._runs: dict[str, RunState] = {}
        self._samplers: dict[str, SamplerEntry] = {}
        self._ended: dict[str, str] = {}  # forgotten finished session id -> tenant, to answer 410
        self._evicted: dict[str, str] = {}  # evicted sampler id -> tenant, to explain a 404
        self.sessions = MappingProxyType(self._sessions)
        self.runs = MappingProxyType(self._runs)
        self.samplers = MappingProxyType(self._samplers)
        self.ended = MappingProxyType(self._ended)
        self.evicted = MappingProxyType(self._evicted)
        self.applied = 0  # commands applied so far: their order

    def apply(self, command: Command) -> Any:
        """Apply one command (after writing its journal record) and return its result; its effects
        run after the locks are released. A refusal (QuotaExceeded) changes nothing."""
        handler = getattr(self, f"_{type(command).__name__}")
        with self._cut_lock, self._lock:
            done = handler(command, Applied())
            record = command.record()
            if record is not None:
                self._journal(record)  # InsufficientStorage: raised before anything below changes
            for change in done.changes:
                change()
            self.applied += 1
        for effect in done.effects:
            effect()
        return done.result

    # -- sessions ----------------------------------------------------------------------------------
    def _OpenSession(self, c: OpenSession, done: Applied) -> Applied:
        sess = SessionRecord(**copy.deepcopy(c.fields))  # the command stays as it was sent
        if c.restored and (sess.session_id in self._sessions or sess.session_id in self._ended):
            done.result = self._sessions.get(sess.session_id)
            return done
        done.changes.append(lambda: self._sessions.__setitem__(sess.session_id, sess))
        if not c.restored:
            done.effects.append(lambda: self._write_session(sess))
        done.result = sess
        return done

    def _FinishSession(self, c: FinishSession, done: Applied) -> Applied:
        sess = self._sessions.get(c.session_id)
        if sess is None or sess.tenant != c.tenant:
            return done  # gone since the caller looked it up (a tenant removed meanwhile)
        run_ids = [r for r in sess.run_ids if r in self._runs]

        def change():
            if not sess.finished:
                sess.finish_reason = (
                    c.reason if c.reason in ("success", "errored", "interrupted") else "success"
                )
            sess.finished = True
            sess.finished_at = time.time()
            for rid in run_ids:
                gone = self._runs.pop(rid, None)
                if gone is not None and gone.state is not None:
                    state = gone.state
                    done.effects.insert(0, state.adapter.leave)  # its device share goes first
            for sid in sess.sampler_ids:
                self._samplers.pop(sid, None)

        done.changes.append(change)
        done.effects.append(lambda: self._write_session(sess))
        done.effects.extend(lambda rid=rid: self._close_lane(f"run:{rid}") for rid in run_ids)
        everything = list(sess.run_ids)
        done.effects.extend(
            lambda fn=fn: fn(c.tenant, c.session_id, everything) for fn in list(self._listeners)
        )
        return done

    def _ForgetSession(self, c: ForgetSession, done: Applied) -> Applied:
        sess = self._sessions.get(c.session_id)
        if sess is not None and sess.finished:

            def change():
                self._sessions.pop(c.session_id, None)
                self._ended[c.session_id] = sess.tenant
                _trim(self._ended)

            done.changes.append(change)
        return done

    def _ForgetTenant(self, c: ForgetTenant, done: Applied) -> Applied:
        live = [s for s in self._sessions.values() if s.tenant == c.tenant and not s.finished]
        for sess in live:
            self._FinishSession(FinishSession(c.tenant, sess.session_id, "interrupted"), done)

        def change():
            for sid in [sid for sid, s in self._sessions.items() if s.tenant == c.tenant]:
                del self._sessions[sid]
                self._ended[sid] = c.tenant
            for sid in [sid for sid, e in self._samplers.items() if e.tenant == c.tenant]:
                del self._samplers[sid]
            for sid in [sid for sid, t in self._evicted.items() if t == c.tenant]:
                del self._evicted[sid]

        done.changes.append(change)
        done.result = live
        return done

    # -- runs --------------------------------------------------------------------------------------
    def _OpenRun(self, c: OpenRun, done: Applied) -> Applied:
        existing = self._runs.get(c.run_id)
        if existing is not None:
            done.result = existing
            return done
        self._check_run_quota(c.tenant, c.spec)
        sess = self._sessions[c.session_id]
        run = RunState(
            run_id=c.run_id,
            tenant=c.tenant,
            session_id=c.session_id,
            spec=c.spec,
            seed=c.seed,
            base_model=c.base_model,
            user_metadata=dict(c.user_metadata or {}),
        )

        def change():
            self._runs[run.run_id] = run
            sess.run_ids.append(run.run_id)

        done.changes.append(change)
        done.effects.append(lambda: self._open_lane(run.run_id))
        done.result = run
        return done

    def _check_run_quota(self, tenant: str, spec: LoraSpec) -> None:
        mine = [r for r in self._runs.values() if r.tenant == tenant]
        if len(mine) >= self._limits.max_runs_per_tenant:
            raise QuotaExceeded(
                f"a tenant may hold at most {self._limits.max_runs_per_tenant} live runs (OPENRL_MAX_RUNS_PER_TENANT); "
                f"finish a session to free its runs",
                field="model_id",
            )
        full = sum(1 for r in mine if r.spec.full)
        if spec.full and full >= self._limits.max_full_runs_per_tenant:
            raise QuotaExceeded(
                f"rank: a tenant may hold at most {self._limits.max_full_runs_per_tenant} live full fine-tunes "
                f"(rank 0; OPENRL_MAX_FULL_RUNS_PER_TENANT), each a whole copy of the model's training state; "
                f"finish a session to free its runs, or train a LoRA (rank >= 1)",
                field="rank",
            )

    def _LinkRun(self, c: LinkRun, done: Applied) -> Applied:
        sess = self._sessions[c.session_id]
        if c.run_id not in sess.run_ids:
            done.changes.append(lambda: sess.run_ids.append(c.run_id))
            done.effects.append(lambda: self._write_session(sess))
        return done

    # -- samplers ----------------------------------------------------------------------------------
    def _AddSampler(self, c: AddSampler, done: Applied) -> Applied:
        sess = self._sessions.get(c.session_id or "")
        if sess is not None and sess.finished:
            return done  # its owner is gone
        entry = SamplerEntry(
            c.sampler_id,
            c.tenant,
            c.session_id,
            c.base_model,
            c.weights,
            model_path=c.model_path,
            source_run=c.source_run,
            inflight_of=c.inflight_of,
        )

        def change():
            self._samplers[entry.sampler_id] = entry
            if sess is not None:
                sess.sampler_ids.append(entry.sampler_id)
            self._enforce_snapshot_budget(keep=entry)

        done.changes.append(change)
        done.result = entry
        return done

    def _SamplerWeights(self, c: SamplerWeights, done: Applied) -> Applied:
        def change():
            if c.inflight_of is not None:  # every inflight client of the run moves to these weights
                for e in self._samplers.values():
                    if e.inflight_of == c.inflight_of:
                        e.adapter = c.weights
                return
            entry = self._samplers.get(c.sampler_id or "")
            if entry is not None:
                entry.adapter = c.weights
                self._enforce_snapshot_budget(keep=entry)

        done.changes.append(change)
        return done

    def _enforce_snapshot_budget(self, keep: SamplerEntry) -> None:
        """Keep the adapters held in memory within each tenant's share and the service's budget.

        A tenant over OPENRL_MAX_SAMPLER_SNAPSHOTS_PER_TENANT loses its own least recently used
        snapshot; over the service's count, the tenant holding the most snapshots loses its least
        recently used one, and over its bytes the tenant holding the most bytes (a full fine-tune's
        snapshot is a whole model) — so one tenant's flood never evicts a neighbour that holds less.
        Inflight clients sharing one set of weights count it once. A snapshot that alone makes its
        owner the heaviest with nothing older to give is kept without evicting anyone else. A
        checkpoint-backed sampler only drops its tensors (they reload from disk on its next request);
        an ephemeral snapshot is forgotten."""
        s = self._settings
        loaded = sorted(
            (x for x in self._samplers.values() if x.adapter is not None and x is not keep),
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

        cap_bytes = self._cap()
        while True:
            every = [x for t in per_tenant for x in held(t)]
            over_count = len(every) > s.max_sampler_snapshots
            if not over_count and nbytes(every) <= cap_bytes:
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
            del self._samplers[old.sampler_id]
            sess = self._sessions.get(old.session_id or "")
            if sess is not None and old.sampler_id in sess.sampler_ids:
                sess.sampler_ids.remove(old.sampler_id)  # its record lists samplers that exist
            self._evicted[old.sampler_id] = old.tenant
            _trim(self._evicted)
            log.info("evicted sampler %s of %s (snapshot budget)", old.sampler_id, old.tenant)

    # -- recovery ----------------------------------------------------------------------------------
    def _RestoreRegistry(self, c: RestoreRegistry, done: Applied) -> Applied:
        def change():
            self._ended.update(c.ended)
            self._evicted.update(c.evicted)
            for run in c.runs:
                self._runs[run.run_id] = run
            for entry in c.samplers:
                self._samplers[entry.sampler_id] = entry

        done.changes.append(change)
        return done


def _trim(tombstones: dict[str, str]) -> None:
    while len(tombstones) > TOMBSTONES:
        tombstones.pop(next(iter(tombstones)))
