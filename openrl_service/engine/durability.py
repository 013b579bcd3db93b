"""Crash recovery: what the service acknowledged survives ``kill -9`` (``--durability journal``).

Designed like a database's redo log (see docs/architecture.md, Durability):

- **Journal**: every request that changes state is recorded before it is queued, as the call that
  made it (``("call", request_id, method, arguments)``: ``forward_backward`` with its datums,
  ``sample`` with the seed an unseeded request drew...), as a session or sampler record, or, for the
  notebook API, as the request's *intent* (``("native", id, kind, inputs)``: the resolved datums of a
  train step, the sample ids a sample call hands out, its seq_ids and its idempotency key). The HTTP
  layer acknowledges a request only after :meth:`Durability.sync` made its record durable (one fsync
  for all the requests waiting: group commit).
- **Snapshot**: every ``snapshot_interval_s`` (and at the end of a drain, and after a recovery) the
  device worker pauses between two ops (never inside a chunked one) and the whole state is copied:
  sessions, runs (adapter, optimizer moments, accumulated gradients, step counts, the next seq_id
  each run expects), samplers with their snapshot tensors, the results of completed requests (so a
  retried ``retrieve_future`` or a re-sent seq_id gets the original answer), the notebook API's
  runs, sample store, metric rows and idempotent replies, and the records of everything accepted but
  not yet done. The journal moves to a new segment at that instant; once the snapshot is durable
  the older segments are deleted (compaction).
- **Recovery** (``/readyz`` says ``recovering``): the newest snapshot is restored, then every record
  after it is replayed through the same code that accepted it, in journal order; ops of a run run
  in seq_id order as always. A replayed request keeps its request_id; one that had already run (its
  result is in the snapshot) is answered from its result, never run twice. Ops are deterministic on
  a given machine (seeded sampling; fusion off is bit-exact), so replay rebuilds the exact state.
  Idle clocks restart: an outage is not a client's silence.
- **Models**: every run and sampler names its base model. A restart may serve more models, or
  fewer, but it refuses to start (naming the model and what uses it) when the snapshot or the
  journal holds a live run or sampler of a model it no longer serves: dropping them silently would
  lose acknowledged work. Finish those sessions first, or serve that model too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from openrl_service.engine import records
from openrl_service.engine.futures import FutureRecord
from openrl_service.engine.owner import RestoreRegistry
from openrl_service.engine.run_files import RunFiles
from openrl_service.engine.snapshots import (
    STATE_VERSION,
    adapter_from,
    read_snapshot,
    tensor_from,
    write_snapshot,
)
from openrl_service.engine.state import RunState, SamplerEntry
from openrl_service.errors import ApiError
from openrl_service.storage.files import write_private
from openrl_service.storage.journal import Journal, JournalFull

log = logging.getLogger(__name__)


# Set while a journal record is replayed: the record (so the call it makes is not journaled again).
_REPLAYING: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("openrl_replaying", default=None)
# Set inside a notebook-API intent: its engine calls are part of the intent, not records of their own.
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("openrl_quiet", default=False)


class RecoveryRefused(RuntimeError):
    """Recovery met records it cannot replay; the message says which and what the operator can do."""


class InsufficientStorage(ApiError):
    """The journal's disk is full: the request was not recorded, so it was not accepted (507)."""

    status_code = 507
    category = "server"


class Durability:
    """The journal, snapshots and recovery of one service (a no-op with ``--durability none``)."""

    def __init__(self, svc: Any):  # the TrainingService whose state it journals
        s = svc.settings
        self.svc = svc
        self.enabled = s.durability == "journal"
        self.journal = Journal(s.data_dir / "journal") if self.enabled else None
        self.files = RunFiles(s.data_dir / "journal")  # each run's tensors, a file per run (format 3)
        self.last_snapshot: dict = {}  # what the last one took: bytes written, files reused, seconds
        self.interval_s = s.snapshot_interval_s
        self.pending: OrderedDict[str, tuple] = OrderedDict()  # accepted, not yet done, in order
        # sessions whose "finish" replayed before the notebook-API intent that creates them (intents
        # replay as tasks): that intent must not bring the session (and its runs) back
        self.finished_unseen: set[str] = set()
        self._plock = threading.Lock()
        # The notebook API's state, captured and restored by the layer that owns it.
        self.loop_state: list[tuple[str, Callable[[], Any], Callable[[Any], None]]] = []
        self.intent_replayers: dict[str, Callable[[str, dict], Any]] = {}
        # Records of other kinds the layers above append (e.g. "control": a run paused or stopped from
        # the panel), replayed in journal order by the layer that wrote them.
        self.record_replayers: dict[str, Callable[[tuple], None]] = {}
        self._replay_tasks: set[asyncio.Future] = set()  # replayed intents, referenced until done
        self._snap_lock = threading.Lock()  # one snapshot at a time
        # Held while a journal record and the change it describes are applied (``change()``), and by
        # a snapshot's cut: a snapshot sees every change whole or not at all, and the record of a
        # change it does not see lands after the journal's rotation (or among the pending records).
        self.state_lock = threading.RLock()
        self.snapshotted_at = 0  # journal.appended at the last snapshot
        self.recovered = False  # recover() ran: only then may a snapshot replace the journal
        self.failures: list[tuple[str, str]] = []  # records recovery could not replay: (which, why)

    # -- recording -------------------------------------------------------------------------------
    @property
    def quiet(self) -> bool:
        return not self.enabled or _QUIET.get() or _REPLAYING.get() is not None

    @property
    def admitted(self) -> bool:
        """Inside a notebook-API intent or a replay: the request was admitted (quotas checked) already."""
        return _QUIET.get() or _REPLAYING.get() is not None

    @property
    def replaying(self) -> bool:
        """Inside the replay of a journal record (recovery)."""
        return _REPLAYING.get() is not None

    @contextlib.contextmanager
    def inside_intent(self):
        """Engine calls made by a notebook-API intent: the intent's record covers them."""
        token = _QUIET.set(True)
        try:
            yield
        finally:
            _QUIET.reset(token)

    @contextlib.contextmanager
    def change(self):
        """Write a journal record and apply the change it describes as one step: a snapshot's cut
        waits until the change is whole. Keep it short (no device work, no waiting on the worker or
        the loop, no file trees): the event loop waits on it while a snapshot cuts."""
        with self.state_lock:
            yield

    def call(self, method: str, **args: Any) -> tuple | None:
        """The journal record of the service call ``method`` that will queue an op: exactly the
        arguments :data:`records.CALLS` declares for it, and a new request_id. None when nothing is
        recorded; while a record is replayed, that record (same request_id)."""
        replaying = _REPLAYING.get()
        if replaying is not None:
            return replaying if replaying[0] == "call" else None
        if self.quiet:
            return None
        declared = records.CALLS[method].fields
        if set(args) != set(declared):
            raise TypeError(f"journal: {method} records {sorted(declared)}, was given {sorted(args)}")
        return ("call", f"req-{uuid.uuid4().hex}", method, args)

    def accept(self, call: tuple | None) -> None:
        """Record an accepted call (before it is queued); it stays pending until its future completes.
        Raises InsufficientStorage (nothing queued) when the disk is full."""
        if call is None:
            return
        self.append(call)
        with self._plock:
            self.pending[call[1]] = call

    def append(self, record: tuple) -> None:
        """Write a record (not while replaying, nor inside an intent, nor with durability off)."""
        if self.quiet:
            return
        data = records.encode(record)
        try:
            self.journal.append(data)
        except JournalFull as e:
            raise InsufficientStorage(
                f"openrl-service cannot record the request: {e.strerror}. Nothing was accepted; free space "
                "on the data volume (or run with --durability none) and retry"
            ) from e

    def completed(self, rec: FutureRecord) -> None:
        """A future completed: its call record is no longer pending."""
        if self.pending:
            with self._plock:
                self.pending.pop(rec.request_id, None)

    def intent(self, kind: str, inputs: dict) -> str:
        """Record a notebook-API request's intent; returns its id (pending until :meth:`intent_done`)."""
        replaying = _REPLAYING.get()
        if replaying is not None and replaying[0] == "native":
            return replaying[1]
        intent_id = f"int-{uuid.uuid4().hex}"
        if not self.enabled:
            return intent_id
        record = ("native", intent_id, kind, inputs)
        self.append(record)
        with self._plock:
            self.pending[intent_id] = record
        return intent_id

    def intent_done(self, intent_id: str) -> None:
        with self._plock:
            self.pending.pop(intent_id, None)

    def unsynced(self) -> bool:
        return self.enabled and self.journal.synced < self.journal.appended

    async def sync(self) -> None:
        """Make every record so far durable (the caller acknowledges after this)."""
        if self.unsynced():
            try:
                await asyncio.to_thread(self.journal.sync)
            except JournalFull as e:
                raise InsufficientStorage(
                    f"openrl-service could not make the request durable: {e.strerror}; retry once the data "
                    "volume has free space"
                ) from e

    # -- snapshots -------------------------------------------------------------------------------
    def due(self) -> bool:
        return (
            self.enabled
            and self.journal.appended > self.snapshotted_at
            and not self._snap_lock.locked()
            and self.interval_s > 0
        )

    async def snapshot(self, reason: str = "interval") -> bool:
        """Take a snapshot: capture on the worker (between ops) and on the loop, write it off both."""
        if not self.enabled or not self.recovered or not self._snap_lock.acquire(blocking=False):
            return False  # before recovery a snapshot would replace the journal with an empty state
        try:
            loop = asyncio.get_running_loop()
            t0 = time.perf_counter()
            captured = await asyncio.wrap_future(
                self.svc.engine.run_exclusive(lambda: self._capture(loop)), loop=loop
            )
            if captured is None:
                return False
            n, state, appended = captured
            keep = {r["state"]["file"] for r in state["runs"] if r["state"] is not None}
            keep |= {e["weights"]["file"] for e in state["samplers"] if e["weights"] is not None}
            size = await asyncio.to_thread(write_snapshot, self.journal, n, state, keep)
            self.files.forget(keep)
            self.snapshotted_at = appended
            took = time.perf_counter() - t0
            self.last_snapshot = {"n": n, "bytes": size, "seconds": round(took, 3), "files": len(keep)}
            log.info(
                "snapshot %d (%s): %d bytes in %d files (%d bytes written so far, %d unchanged files "
                "referred to again) in %.2f s",
                n, reason, size, len(keep), self.files.written, self.files.reused, took,
            )  # fmt: skip
            return True
        except Exception:  # noqa: BLE001 - the segments it would replace are kept: nothing is lost
            log.exception("snapshot failed; the journal keeps everything since the last one")
            return False
        finally:
            self._snap_lock.release()

    def _capture(self, loop: asyncio.AbstractEventLoop) -> tuple[int, dict, int] | None:
        """On the worker, between ops: the engine's tensors; then, on the loop (the worker waits) and
        under ``state_lock`` (no change half-applied), the cut: the journal's rotation, the pending
        records, the sessions and samplers, which runs are live, and the loop-side state."""
        tensors = self._capture_engine()
        done = threading.Event()
        box: dict = {}

        def on_loop():
            try:
                with self.state_lock:
                    box["n"] = self.journal.rotate()
                    box["appended"] = self.journal.appended
                    state = self._capture_registry(tensors)
                    with self._plock:
                        state["pending"] = [records.encode(r) for r in self.pending.values()]
                    state["loop"] = {name: capture() for name, capture, _ in self.loop_state}
                box["state"] = state
            except BaseException as e:  # noqa: BLE001 - handed back to the worker
                box["error"] = e
            finally:
                done.set()

        if loop.is_closed():
            return None
        loop.call_soon_threadsafe(on_loop)
        if not done.wait(60.0):
            log.warning("snapshot: the event loop did not answer within 60 s; skipped")
            return None
        if "error" in box:
            raise box["error"]
        return box["n"], box["state"], box["appended"]

    def _capture_engine(self) -> dict:
        """On the worker, between ops: what only ops change (runs' tensors and lanes, sampler
        snapshots' weights, the futures). Each run's tensors go to a file of their own in the journal
        folder (run_files.py), written only when the run changed since its last one; a sampler
        snapshot's once."""
        svc = self.svc
        engine = svc.engine
        runs = {}
        for run in list(svc.runs.values()):
            st = run.state
            runs[run.run_id] = {
                "run_id": run.run_id,
                "tenant": run.tenant,
                "session_id": run.session_id,
                "spec": run.spec,
                "seed": run.seed,
                "base_model": run.base_model,
                "user_metadata": copy.deepcopy(run.user_metadata),
                "created_at": run.created_at,
                "state": None if st is None else self.files.run(run.run_id, st),
                "lane": engine.lane_position(f"run:{run.run_id}"),
            }
        weights = {
            e.sampler_id: (e.adapter.spec, self.files.sampler(e.sampler_id, e.adapter))
            for e in list(svc.samplers.values())
            if e.adapter is not None and e.model_path is None
        }
        return {"runs": runs, "sampler_weights": weights, "futures": svc.futures.capture()}

    def _capture_registry(self, engine: dict) -> dict:
        """At the cut (``state_lock`` held): sessions, samplers and which runs are live. A run or a
        sampler snapshot the worker copied but a finish removed since is left out; a run registered
        since is not in the snapshot, and the record that creates it is pending or comes later."""
        svc = self.svc
        samplers = []
        for e in list(svc.samplers.values()):
            spec, weights = engine["sampler_weights"].get(e.sampler_id, (None, None))
            if weights is None and e.adapter is not None and e.model_path is None:
                continue  # not copied by the worker (it waits for this cut: cannot happen)
            samplers.append(
                {
                    "sampler_id": e.sampler_id,
                    "tenant": e.tenant,
                    "session_id": e.session_id,
                    "base_model": e.base_model,
                    "model_path": e.model_path,
                    "source_run": e.source_run,
                    "created_at": e.created_at,
                    "spec": spec,
                    "weights": weights,
                }
            )
        return {
            "version": STATE_VERSION,
            "base_model": svc.base.name if svc.base else None,  # the default model
            "base_models": list(svc.models),
            "sessions": [copy.deepcopy(vars(s)) for s in list(svc.sessions.values())],
            "ended": dict(svc._ended),
            "evicted": dict(svc._evicted),
            "runs": [r for run_id, r in engine["runs"].items() if run_id in svc.runs],
            "samplers": samplers,
            "futures": engine["futures"],
        }

    # -- recovery --------------------------------------------------------------------------------
    async def recover(self) -> int:
        """Restore the newest snapshot and replay the journal after it; returns the records replayed.
        New appends go to a fresh segment. A record this release cannot replay (unknown, or failing
        with anything but the refusal its request would get now) stops the start with
        :class:`RecoveryRefused`, which names each one and what the operator can do, unless
        ``--recovery-skip-failed`` says to drop them."""
        if not self.enabled:
            return 0
        t0 = time.perf_counter()
        snap = await asyncio.to_thread(self.journal.latest_snapshot)
        first = 1
        raw: list = []
        if snap is not None:
            first, state = snap
            state = await asyncio.to_thread(read_snapshot, self.journal, first, state)
            raw += state.get("pending", [])
        raw += await asyncio.to_thread(lambda: list(self.journal.records_since(first)))
        self.failures = []
        todo: list[tuple] = []
        for data in raw:
            try:
                todo.append(records.decode(data))
            except records.UnknownRecord as e:
                self.failures.append((e.what, e.why))
        if self.failures and not self.svc.settings.recovery_skip_failed:
            self._refuse_or_drop(self.failures)  # before anything is restored, replayed or written
        self._check_models(state if snap is not None else None, todo)
        if snap is not None:
            self._restore(state)
        self.journal.open(self.journal.next_segment())
        meta = {
            "base_model": self.svc.base.name,
            "base_models": list(self.svc.models),
            "version": STATE_VERSION,
            "format": records.FORMAT,
        }
        self.append_now(("meta", meta))
        seen: set[str] = set()
        later = [r for r in todo if not self._replay(r, seen)]
        if later:
            # Sampling on a snapshot that a replayed save_weights_for_sampler makes: replayed once
            # that sampler exists (its run's ops before the save have run), or once nothing more can
            # run (the save failed: the sample is refused as it would have been). Only those runs'
            # ops are waited for: the service is ready while the others' still run.
            while (
                any(r[3].get("sampler_id") not in self.svc.samplers for r in later)
                and self.svc.engine.runnable()
            ):
                await asyncio.sleep(0.02)
            for record in later:
                self._replay(record, seen, last_chance=True)
        if self.failures:
            self._refuse_or_drop(self.failures)
        now = time.time()
        for sess in self.svc.sessions.values():
            sess.last_heartbeat = now  # the outage was not the client's silence
        for run in self.svc.runs.values():
            run.last_request_time = now
        self.recovered = True
        if snap is not None or todo:
            log.warning(
                "recovered: snapshot %s, %d journal records replayed in %.2f s",
                first if snap is not None else "none",
                len(seen),
                time.perf_counter() - t0,
            )
        return len(seen)

    def append_now(self, record: tuple) -> None:
        """Write a record even during recovery (the meta record that opens a new segment)."""
        self.journal.append(records.encode(record))

    def _refuse_or_drop(self, failures: list[tuple[str, str]]) -> None:
        """Records that could not be replayed: listed in a file beside the journal; then the start is
        refused with what to do, or (``--recovery-skip-failed``) they are dropped, loudly."""
        listing = self.journal.folder / f"unreplayed-{time.strftime('%Y%m%d-%H%M%S')}.json"
        write_private(
            listing, (json.dumps([{"record": w, "error": e} for w, e in failures], indent=1) + "\n").encode()
        )
        named = "; ".join(f"{w}: {e}" for w, e in failures[:3]) + (
            f"; and {len(failures) - 3} more" if len(failures) > 3 else ""
        )
        if self.svc.settings.recovery_skip_failed:
            log.error(
                "recovery dropped %d acknowledged journal records it cannot replay (--recovery-skip-failed): "
                "%s. Listed in %s",
                len(failures),
                named,
                listing,
            )
            return
        raise RecoveryRefused(
            f"this release cannot replay {len(failures)} acknowledged journal record(s) of the data dir: {named}. "
            f"They are listed in {listing}; nothing in the data dir was changed. Either start the release "
            "that wrote them on this data dir and let its clients finish (or finish their sessions), then "
            "upgrade; or start this release with --recovery-skip-failed (OPENRL_RECOVERY_SKIP_FAILED=1) to "
            "drop them: the requests they record are lost (their clients see them fail or their ids unknown)"
        )

    def _check_models(self, state: dict | None, records: list[tuple]) -> None:
        """Refuse, before anything is restored, a snapshot or journal holding runs or samplers of a
        model this service does not serve. Records written without a model name (the default then)
        get the default model of their time, so a replay creates them on the same model."""
        served = self.svc.models
        default = state.get("base_model") if state is not None else None
        used: dict[str, str] = {}  # model -> one thing that uses it, for the message
        if state is not None:
            for r in state["runs"]:
                used.setdefault(r["base_model"], f"run {r['run_id']}")
            for e in state["samplers"]:
                used.setdefault(e["base_model"], f"sampler {e['sampler_id']}")
        for record in records:
            if record[0] == "meta":
                default = record[1].get("base_model")
                continue
            name, what = self._record_model(record, default)
            if name is not None:
                used.setdefault(name, what)
        missing = {m: what for m, what in used.items() if m not in served}
        if missing:
            listed = "; ".join(f"{m!r} (e.g. {what})" for m, what in missing.items())
            raise RuntimeError(
                f"the data dir's state holds live runs or samplers of models this service does not serve: "
                f"{listed}. It serves {', '.join(repr(n) for n in served)}. Start it with those models too "
                "(--model, OPENRL_MODELS), finish their sessions with the old set first, or use another --data-dir"
            )

    def _record_model(self, record: tuple, default: str | None) -> tuple[str | None, str]:
        """The model a journal record creates a run or sampler on (None: it creates neither); a
        missing name is filled in with ``default``, the default model when it was written."""
        kind = record[0]
        if kind == "call" and record[2] in ("create_model", "create_from_state"):
            args = record[3]
            if record[2] == "create_model" and args.get("base_model") is None:
                args["base_model"] = default
            name = args.get("base_model") or self._manifest_model(args.get("tenant"), args.get("path"))
            return name, f"the run created by request {record[1]}"
        if kind == "sampler":
            _, tenant, args = record
            if args.get("base_model") is None and args.get("model_path") is None:
                args["base_model"] = default
            name = args.get("base_model") or self._manifest_model(tenant, args.get("model_path"))
            return name, f"sampler {args.get('session_id')}:sample:{args.get('seq_id')}"
        if kind == "native" and record[2] == "create":
            inputs = record[3]
            if inputs.get("base_model") is None:
                inputs["base_model"] = default
            return inputs["base_model"], f"notebook run {inputs.get('name')!r}"
        return None, ""

    def _manifest_model(self, tenant: str | None, path: str | None) -> str | None:
        """The base model a checkpoint was trained on; None when it cannot be read (the replay then
        refuses the request as it would have)."""
        from openrl_service.storage.checkpoints import parse_tinker_path

        try:
            return self.svc.store.manifest(tenant, parse_tinker_path(path)).get("base_model")
        except Exception:  # noqa: BLE001 - an unreadable checkpoint is the replay's to refuse
            return None

    def _restore(self, state: dict) -> None:
        svc = self.svc
        for fields in state["sessions"]:
            svc.restore_session(fields)
        slots = svc.futures.restore(state["futures"])
        runs, samplers = [], []
        for r in state["runs"]:
            run = RunState(
                run_id=r["run_id"],
                tenant=r["tenant"],
                session_id=r["session_id"],
                spec=r["spec"],
                seed=r["seed"],
                base_model=r["base_model"],
                user_metadata=r["user_metadata"],
                created_at=r["created_at"],
            )
            t = r["state"]
            if t is not None and "file" in t:  # format 3: the run's own file
                trainer = svc.model_of(run).trainer
                st = trainer.restore_state(r["spec"], t["names"], self.files.path(t["file"]))
                st.steps = t["steps"]
                st.pending_backward = t["pending_backward"]
                trainer.publish(st)
                run.state = st
                st.adapter.lane = f"run:{run.run_id}"
                self.files.adopt(run.run_id, st, t["file"])
            elif t is not None:
                trainer = svc.model_of(run).trainer
                device = trainer.base.device
                st = trainer.state_for(adapter_from(r["spec"], t["weights"], device, trainable=True))
                type(trainer).load_optimizer_tensors(
                    st, {k: tensor_from(v, "cpu") for k, v in t["optimizer"].items()}
                )
                for name, p in st.adapter.named_parameters():
                    if name in t["grads"]:
                        p.grad = tensor_from(t["grads"][name], device)
                st.steps = t["steps"]
                st.pending_backward = t["pending_backward"]
                trainer.publish(st)
                run.state = st
                st.adapter.lane = f"run:{run.run_id}"
            runs.append(run)
            svc.engine.restore_lane(f"run:{run.run_id}", r["lane"], slots.get(f"run:{run.run_id}", {}))
        for e in state["samplers"]:
            adapter = None
            if e["weights"] is not None and "file" in e["weights"]:  # format 3
                trainer = svc.models[e["base_model"]].trainer
                adapter = trainer.restore_weights(
                    e["spec"], e["weights"]["names"], self.files.path(e["weights"]["file"])
                )
            elif e["weights"] is not None:
                device = svc.models[e["base_model"]].base.device
                adapter = adapter_from(e["spec"], e["weights"], device, trainable=False)
            samplers.append(
                SamplerEntry(
                    e["sampler_id"],
                    e["tenant"],
                    e["session_id"],
                    e["base_model"],
                    adapter,
                    model_path=e["model_path"],
                    source_run=e["source_run"],
                    created_at=e["created_at"],
                )
            )
        svc.owner.apply(
            RestoreRegistry(tuple(runs), tuple(samplers), dict(state["ended"]), dict(state["evicted"]))
        )
        svc.engine.restore_idempotency(svc.futures)
        loop_state = state.get("loop", {})
        for name, _, restore in self.loop_state:
            if name in loop_state:
                restore(loop_state[name])

    def _replay(self, record: tuple, seen: set[str], last_chance: bool = False) -> bool:
        """Apply one journal record again, through the code that accepted it. False when it must wait
        (a sample on a sampler snapshot that replayed ops have not made yet)."""
        svc = self.svc
        kind = record[0]
        if (
            kind == "call"
            and record[2] == "sample"
            and not last_chance
            and record[3].get("sampler_id") not in svc.samplers
        ):
            return False
        token = _REPLAYING.set(record)
        try:
            if kind == "session":
                fields = record[1]
                if fields["session_id"] not in svc.sessions and fields["session_id"] not in svc._ended:
                    svc.restore_session(fields)
            elif kind == "finish":
                _, tenant, session_id, reason = record
                sess = svc.sessions.get(session_id)
                if sess is not None and not sess.finished:
                    svc.finish_session(tenant, session_id, reason)
                elif sess is None:
                    self.finished_unseen.add(session_id)
            elif kind == "sampler":
                svc.create_sampler(record[1], **record[2])
            elif kind == "call":
                _, request_id, method, args = record
                if request_id in seen or svc.futures.known(request_id):
                    return True
                seen.add(request_id)
                declared = records.CALLS[method].fields
                getattr(svc, method)(**{k: args[k] for k in declared if k in args})
            elif kind == "meta":
                pass  # checked before the replay
            elif kind == "native":
                _, intent_id, intent_kind, inputs = record
                if intent_id in seen:
                    return True
                seen.add(intent_id)
                replay = self.intent_replayers.get(intent_kind)
                if replay is None:  # not pending: dropped (--recovery-skip-failed) it must not come back
                    self.failures.append(
                        (f"record {records.describe(record)}", "no replayer for this intent kind")
                    )
                    return True
                with self._plock:
                    self.pending[intent_id] = record
                task = asyncio.ensure_future(replay(intent_id, inputs))
                self._replay_tasks.add(task)
                task.add_done_callback(self._replay_tasks.discard)
            elif kind in self.record_replayers:
                self.record_replayers[kind](record)
            else:
                self.failures.append((f"record {kind!r}", "no replayer for this record type in this release"))
        except ApiError as e:
            log.warning("journal: replaying a %s record was refused now (%s); skipped", kind, e.message)
        except Exception as e:  # noqa: BLE001 - reported by name; the start is refused unless told
            log.exception("journal: replaying %s failed", records.describe(record))
            self.failures.append((f"record {records.describe(record)}", f"{type(e).__name__}: {e}"))
        finally:
            _REPLAYING.reset(token)
        return True
