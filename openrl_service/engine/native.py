"""The notebook-facing operations behind ``/openrl/v1``: runs addressed by id, text in and out.

A native run is an ordinary engine run (its own session, adapter, optimizer, seq-ordered lane), so
the Tinker API's guarantees hold for it too. What this layer adds:

- text prompts: the service tokenises them (through the chat template when the model has one) and
  returns completions as text without the stop token's text;
- a sample store: each completion gets a ``sample_id``; the service keeps it (prompt tokens,
  completion tokens, sampler logprobs) for ``SAMPLE_TTL_S`` so a train step can name samples
  instead of re-sending tokens;
- one ``train_step`` = the engine's own ``forward_backward`` (importance sampling or another RL
  loss over the named samples with their advantages, plus ``kl_coef`` times the KL to the run's
  starting weights when asked: engine/reference.py) then its ``optim_step`` (AdamW), back to back
  in the run's lane, returning the ratio / KL / clip statistics; sampling is the engine's
  ``sample_run``: this layer calls the same public operations as the Tinker façade;
- client-reported metrics per step, stored with the run: the newest ``OPENRL_MAX_METRIC_ROWS`` rows
  (100,000); older ones are dropped (counted in the run's ``metrics_dropped``) so a long run never
  fails for its statistics; a row holds at most ``MAX_METRIC_KEYS`` values;
- an event bus for run events, read by the SSE stream with telemetry ticks;
- run control (``/runs/{id}/control``, for the side panel): each run's control state (running,
  pause or stop requested, paused, stopped; why; when), for notebook runs and the tenant's
  Tinker-SDK training runs alike. A notebook ``Run`` reads it from its heartbeat replies and obeys
  at its next step, reporting its own state back (heartbeat body ``{"state"}``); a paused or stopped
  SDK run's next op completes as a 409 naming the run and the reason (``resume`` clears it).
  Control changes are journaled (``("control", ...)`` records) and kept in snapshots.

A run lives as long as its session: ``heartbeat`` keeps it alive while the notebook is idle; when
the client deletes it or the idle reaper finishes it (no heartbeat or request for
OPENRL_SESSION_IDLE_TIMEOUT_S), this layer forgets it with its metric rows and stored samples. A
detached job's run (labelled ``openrl.job``) is kept instead: its entry and metric rows go to the job's
folder (engine/jobs.py) and stay readable, listed as ended, until the job is deleted.

Sampling and training of one run share its lane, so a sample always sees the weights of every
train step submitted before it; ``snapshot`` in replies is the run's optimizer-step count.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import replace
from typing import Any

import anyio
import numpy as np
import orjson

from openrl_common.episodes import episode_layout
from openrl_common.protocol import RL_LOSSES, control_problem
from openrl_service.checks import integer, number
from openrl_service.engine.events import EVENTS_SCHEMA_VERSION, EventBus
from openrl_service.engine.job_checks import JOB_META_KEY, job_label
from openrl_service.engine.jobs import Jobs
from openrl_service.engine.native_checks import adam_of, flag, kl_coef, loss_config
from openrl_service.engine.native_state import (
    DEFAULT_REASONS,
    KERNEL_DONE,
    KERNEL_STATES,
    Control,
    NativeRunState,
    RunControlled,
    StoredSample,
)
from openrl_service.engine.prompts import check_messages, check_text, off_loop
from openrl_service.engine.reference import References
from openrl_service.engine.replies import IdempotentReplies
from openrl_service.engine.service import RunState, TrainingService
from openrl_service.engine.sft_examples import sft_datums
from openrl_service.engine.state import new_session_id
from openrl_service.errors import ApiError, Conflict, NotFound, UserError
from openrl_service.lifecycle import ShuttingDown
from openrl_service.sampling.base import SampleJob
from openrl_service.storage.checkpoints import check_name
from openrl_service.telemetry import NvmlReader
from openrl_service.training.optim_params import AdamParams
from openrl_service.training.trainer import DatumArrays, ForwardResult

log = logging.getLogger(__name__)

SAMPLE_TTL_S = 1800.0
MAX_STORED_SAMPLES = 200_000
MAX_METRIC_KEYS = 64  # values per metric row (step excluded)
MAX_METRIC_KEY_CHARS = 128
# A notebook run without a heartbeat or request for this long is listed as orphaned (its kernel is
# gone or stuck); OPENRL_ORPHAN_AFTER_S overrides it.
ORPHAN_AFTER_S = 30.0
SHARE_WINDOW_S = 60.0  # a run's share of device time is measured over this window


# The notebook API's requests that change state, journaled as intents, and the status of their reply.
INTENTS = {"create": 201, "sample": 200, "train_step": 200, "checkpoint": 201, "metrics": 201}
SEQ_SLOTS = {"sample": 1, "train_step": 2, "checkpoint": 1}  # seq_ids an intent of that kind takes
DEVICE_INTENTS = {"create", "sample", "train_step", "checkpoint"}  # they queue device work


class NativeRuns:
    def __init__(self, svc: TrainingService, jobs: Jobs | None = None):
        self.svc = svc
        self.jobs = jobs  # detached jobs: a run's recorded control, runs kept after their session
        self.runs: dict[str, NativeRunState] = {}
        self.samples: OrderedDict[str, StoredSample] = OrderedDict()
        self.sample_counts: Counter[str] = Counter()  # tenant -> samples it has in self.samples
        self.events = EventBus()
        self.replies = IdempotentReplies(ttl_s=svc.settings.future_ttl_s)
        self._lock = threading.Lock()
        self._nvml: NvmlReader | None = None
        self.controls: dict[str, Control] = {}  # run id -> control state (absent: running)
        self.references = References(svc)  # each run's starting weights, for train_step's kl_coef
        self._share_cache: tuple[float, dict[str, float]] | None = None
        self.orphan_after_s = float(os.environ.get("OPENRL_ORPHAN_AFTER_S") or ORPHAN_AFTER_S)
        svc.durability.record_replayers["control"] = self._replay_control
        svc.durability.record_replayers["run_state"] = self._replay_run_state
        # what a replayed record said of a run whose creating intent (replayed as a task) has not made
        # it yet: run id -> {"tenant", "control": Control, "state": kernel state}, applied once it
        # exists (bounded by the journal replayed; a run never made leaves its entry until restart)
        self._replayed: dict[str, dict] = {}
        svc.session_listeners.append(self._session_finished)
        svc.sweepers.append(self.sweep_samples)
        svc.durability.loop_state.append(("native", self.capture, self.restore))
        for kind in INTENTS:
            svc.durability.intent_replayers[kind] = functools.partial(self._replay, kind)

    # -- journal ----------------------------------------------------------------------------------
    async def _intent(self, kind: str, inputs: dict, nr: NativeRunState | None = None) -> dict:
        """Journal a request's resolved inputs (its intent), then carry it out; the engine calls it
        makes are covered by the intent's record. A request in a run's order (``SEQ_SLOTS``) takes
        its seq_ids here, once every check has passed, right before the journal append (a sample, whose
        prompts are encoded off the event loop, takes its own as it arrives and gives it back if it is
        refused): a request refused on the way never leaves a gap the run's next request would wait on."""
        d = self.svc.durability
        n = SEQ_SLOTS.get(kind, 0)
        if n and nr is not None and "seq" not in inputs:  # (a sample takes its own as it arrives)
            inputs["seq"] = nr.next_seq(n)
        try:
            if kind in DEVICE_INTENTS:  # over its device time: 429, before it is journaled or queued
                self.svc.admit(inputs["tenant"])
            intent_id = d.intent(kind, inputs)
        except BaseException as e:  # refused (429), a full disk (507): it keeps no place in the run
            if n and nr is not None and not nr.give_back(inputs["seq"], n):
                self._fill_slots(kind, inputs, e)  # a later request took one meanwhile
            raise
        try:
            with d.inside_intent():
                return await self._execute(kind, inputs, intent_id)
        except Exception as e:  # not CancelledError: a client gone mid-step leaves its ops to run
            self._fill_slots(kind, inputs, e)
            raise
        finally:
            d.intent_done(intent_id)

    def _fill_slots(self, kind: str, inputs: dict, error: BaseException) -> None:
        """Complete the request's seq slots as ``error`` unless they were taken: a request that failed
        before its ops were queued (an unexpected error, the run gone) would otherwise leave a gap the
        run's next request waits OPENRL_SEQ_GAP_TIMEOUT_S on. A slot already taken keeps its op (the
        engine answers a second op in a slot with the first one's future)."""
        n = SEQ_SLOTS.get(kind, 0)
        if not n or "seq" not in inputs or inputs.get("run_id") not in self.svc.runs:
            return
        why = UserError(f"not executed: its request failed ({str(error)[:200]})", field="seq_id")

        def refuse(run):
            raise why

        for seq in range(inputs["seq"], inputs["seq"] + n):
            with contextlib.suppress(ApiError):  # the run or its lane is gone meanwhile: nothing waits
                self.svc.run_op(inputs["tenant"], inputs["run_id"], seq, "refused", refuse, None)

    async def _execute(self, kind: str, inputs: dict, intent_id: str) -> dict:
        if kind == "checkpoint":
            return await self._do_checkpoint(inputs, intent_id)
        return await getattr(self, f"_do_{kind}")(inputs)

    async def _replay(self, kind: str, intent_id: str, inputs: dict) -> None:
        """Carry out a journaled intent again after a crash; its reply becomes its idempotency key's,
        so the client's re-sent request gets it (a re-sent request waits for it meanwhile)."""
        idem = inputs.get("idem")
        entry = self.replies.begin(idem) if idem else None
        try:
            reply = await self._execute(kind, inputs, intent_id)
            if entry is not None:
                self.replies.settle(
                    idem, entry, reply=(INTENTS[kind], orjson.dumps(reply, option=orjson.OPT_SERIALIZE_NUMPY))
                )
        except ApiError as e:
            if entry is not None:
                self.replies.settle(idem, entry, error=e)
        except Exception:  # noqa: BLE001 - logged; the client's retry runs it again
            log.exception("replaying a %s request failed", kind)
            if entry is not None:
                self.replies.settle(idem, entry)
        finally:
            self.svc.durability.intent_done(intent_id)

    def capture(self) -> dict:
        """Runs' names, seq counters, steps and metric rows, the sample store and the idempotent
        replies, for a snapshot (on the event loop, with the device worker paused)."""
        with self._lock:
            runs = [
                {
                    "run_id": run_id,
                    "name": nr.name,
                    "seq": nr.seq,
                    "steps": nr.steps,
                    "metrics": list(nr.metrics),
                    "metrics_dropped": nr.metrics_dropped,
                    "planned": nr.planned,
                    "kernel_state": nr.kernel_state,
                    "reference": self.references.of.get(run_id),
                }
                for run_id, nr in self.runs.items()
            ]
            samples = [(sid, vars(smp).copy()) for sid, smp in self.samples.items()]
            controls = {r: c.to_json() for r, c in self.controls.items()}
        return {"runs": runs, "samples": samples, "replies": self.replies.capture(), "controls": controls}

    def restore(self, state: dict) -> None:
        with self._lock:
            for r in state["runs"]:
                run = self.svc.runs.get(r["run_id"])
                if run is not None:
                    self.runs[r["run_id"]] = NativeRunState(
                        run, r["name"], r["seq"], r["steps"], r["metrics"], r["metrics_dropped"]
                    )
                    self.runs[r["run_id"]].planned = r.get("planned")
                    self.runs[r["run_id"]].kernel_state = r.get("kernel_state", "running")
                    if r.get("reference"):
                        self.references.of[r["run_id"]] = r["reference"]
            for sid, fields in state["samples"]:
                self.samples[sid] = StoredSample(**fields)
                self.sample_counts[fields["tenant"]] += 1
        for run_id, c in state.get("controls", {}).items():
            if run_id in self.svc.runs:
                self._set_control(run_id, Control(**c))
        self.replies.restore(state["replies"])

    # -- runs -----------------------------------------------------------------------------------
    def get(self, tenant: str, run_id: str) -> NativeRunState:
        nr = self.runs.get(run_id)
        if nr is None or nr.run.tenant != tenant or run_id not in self.svc.runs:
            raise NotFound(f"unknown run {run_id!r}", field="run_id")
        return nr

    async def create(
        self, tenant: str, body: dict, idem: tuple | None = None, job: str | None = None
    ) -> dict:
        """Create a run on ``base_model`` (default: the service's first model); the reply describes it
        (201). ``job``: the job whose key asks (engine/jobs.py): the run is labelled with it."""
        model = self.svc.served(body.get("base_model"))
        defaults = model.base.defaults
        name = body.get("name")
        if name is None or name == "":  # absent: a name is made up
            name = f"run-{uuid.uuid4().hex[:6]}"
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise UserError(
                f"name must be a string of 1-128 characters; got {type(name).__name__} {repr(name)[:100]}",
                field="name",
            )

        def given(key: str, default: Any) -> Any:  # absent or null: the default
            value = body.get(key)
            return default if value is None else value

        spec = self.svc.checks.lora_spec(
            given("rank", defaults.get("lora_rank", 8)),
            given("train_attn", True),
            given("train_mlp", True),
            given("train_unembed", defaults.get("train_unembed", True)),
            where="",
        )
        seed = body.get("seed")
        seed = integer(seed, "seed") if seed is not None else random.SystemRandom().randrange(2**31)
        planned = body.get("steps")
        planned = integer(planned, "steps", 1) if planned is not None else None
        load_from = body.get("load_from")
        if load_from is not None and not (isinstance(load_from, str) and load_from):
            raise UserError(
                f"load_from must be a tinker:// checkpoint path (a string); got {load_from!r}",
                field="load_from",
            )
        inputs = {
            "tenant": tenant,
            "name": name,
            "steps": planned,
            "base_model": model.name,
            "spec": spec,
            "seed": seed,
            "user_metadata": job_label(self.svc.checks.check_metadata(body.get("user_metadata")), job),
            "session_id": new_session_id(),
            "idem": idem,
        }
        if load_from is not None:  # absent in intents journaled before this field existed
            inputs["load_from"] = load_from
        return await self._intent("create", inputs)

    async def _do_create(self, inputs: dict) -> dict:
        tenant = inputs["tenant"]
        sess = self.svc.sessions.get(inputs["session_id"])
        if (
            sess is None
            and self.svc.durability.replaying
            and inputs["session_id"] in self.svc.durability.finished_unseen
        ):
            # deleted or reaped before the restart (its "finish" record replayed first): stays gone
            raise NotFound(f"run {inputs['name']!r} ended before the restart", field="run_id")
        if sess is None:

            def new_session():
                return self.svc.create_session(
                    tenant,
                    display_name=inputs["name"],
                    user_metadata=inputs["user_metadata"],
                    session_id=inputs["session_id"],
                )

            if self.svc.durability.replaying:
                sess = new_session()  # in order: the replayed requests after it use the run
            else:  # the session file is written and fsynced: off the event loop
                sess = await anyio.to_thread.run_sync(new_session)
        rec = self.svc.create_model(
            tenant,
            session_id=sess.session_id,
            model_seq_id=0,
            base_model=inputs.get("base_model"),  # absent in intents journaled by one-model versions
            spec=inputs["spec"],
            seed=inputs["seed"],
            user_metadata=inputs["user_metadata"],
            idem=None,
        )
        run_id = rec.extra["model_id"]
        with self._lock:  # at once: requests queued behind the creation find the run
            nr = self.runs.get(run_id)
            if nr is None:
                nr = self.runs[run_id] = NativeRunState(self.svc.run(tenant, run_id), inputs["name"])
                nr.planned = inputs.get("steps")
            replayed = self._replayed.pop(run_id, {})
            if replayed.get("tenant") != tenant:
                replayed = {}
        if "state" in replayed:
            nr.kernel_state = replayed["state"]
        if "control" in replayed:
            self._set_control(run_id, replayed["control"])
        self._obey_job(tenant, run_id, inputs["user_metadata"])
        try:
            await self._result(rec)
            if inputs.get("load_from"):
                # start from a saved checkpoint's LoRA weights (a fresh optimizer): its base model,
                # rank and layers must be this run's (load_state checks them, naming the field)
                nr.bump(1)
                await anyio.to_thread.run_sync(self.svc.verify_checkpoint, tenant, inputs["load_from"])
                await anyio.to_thread.run_sync(self.references.remember, tenant, run_id, inputs["load_from"])
                loaded = self.svc.load_state(tenant, run_id, 1, inputs["load_from"], False, None)
                await self._result(loaded)
        except ApiError as e:
            with self._lock:
                self.runs.pop(run_id, None)
            if inputs.get("load_from") and run_id in self.svc.runs:  # created, then the load was refused
                finish = functools.partial(self.svc.finish_session, tenant, sess.session_id)
                if self.svc.durability.replaying:
                    finish()
                else:
                    await anyio.to_thread.run_sync(finish)
            if e.field == "path":
                e.field = "load_from"
            raise
        self.events.publish(tenant, {"event": "created", "run_id": run_id, "name": inputs["name"]})
        return self.describe(nr)

    def _obey_job(self, tenant: str, run_id: str, meta: dict | None) -> None:
        """A job's run created after a pause or stop of the job gets it at creation (its worker's Run
        obeys at its first step). The job records its control before fanning it out to the runs it
        has, so a run is either among those or finds the record here."""
        job_id = (meta or {}).get(JOB_META_KEY)
        jobs = self.jobs
        if job_id is None or jobs is None:  # a replayed creation too: the job record is on disk
            return
        control = jobs.control_of(tenant, job_id)
        if control is not None and control.get("action") in ("pause", "stop"):
            self.control(tenant, run_id, {"action": control["action"], "reason": control.get("reason")})

    def describe(self, nr: NativeRunState) -> dict:
        run = nr.run
        return {
            "run_id": run.run_id,
            "name": nr.name,
            "user_metadata": run.user_metadata,
            "base_model": run.base_model,
            "lora_rank": run.spec.rank,
            "step": nr.steps,
            "snapshot": nr.steps,
            "created_at": run.created_at,
            "metrics_count": len(nr.metrics),
            "metrics_dropped": nr.metrics_dropped,
            # without a heartbeat or a request for this long, the run's session is finished
            "idle_timeout_s": self.svc.settings.session_idle_timeout_s,
            # set when the vLLM sampler handed this run's sampling to torch: why
            "sampler_notice": self.svc.sample_notices.get(run.run_id),
            "kind": "notebook",
            "steps": nr.planned,
            "state": nr.kernel_state,
            # a notebook run without a heartbeat or request for this long is listed as orphaned
            "orphan_after_s": self.orphan_after_s,
            **self._status(run),
            "last_reward": self._last_reward(nr),
        }

    def describe_sdk(self, run: RunState) -> dict:
        """A Tinker-SDK training run as the runs list shows it: what the service knows of it."""
        sess = self.svc.sessions.get(run.session_id)
        control = self.control_of(run.run_id)
        return {
            "run_id": run.run_id,
            "name": (sess.display_name if sess is not None and sess.display_name else None) or run.run_id,
            "user_metadata": run.user_metadata,
            "base_model": run.base_model,
            "lora_rank": run.spec.rank,
            "step": run.state.steps if run.state is not None else 0,
            "created_at": run.created_at,
            "kind": "sdk",
            "steps": None,
            "state": "stopped" if control.state == "stopped" else "active",  # paused: see control
            **self._status(run),
            "last_reward": None,
        }

    def _status(self, run: RunState) -> dict:
        """Control, last activity, orphaned, last loss and device share: common to both kinds."""
        sess = self.svc.sessions.get(run.session_id)
        last = max(run.last_request_time, sess.last_heartbeat if sess is not None else 0.0)
        now = time.time()
        return {
            "control": self.control_of(run.run_id).to_json(),
            "last_activity": last,
            "orphaned": run.run_id in self.runs and now - last > self.orphan_after_s,
            "last_loss": self.svc.last_loss.get(run.run_id),
            "share": self._shares(now).get(run.run_id, 0.0),
        }

    def _shares(self, now: float) -> dict[str, float]:
        """Each run's share of device time over the last SHARE_WINDOW_S (computed at most every
        0.5 s: a list or a heartbeat does not rescan the op records for every run)."""
        cached = self._share_cache
        if cached is None or not 0 <= now - cached[0] < 0.5:
            busy = self.svc.recorder.window(now - SHARE_WINDOW_S, now)["busy_s"]
            cached = self._share_cache = (now, {r: min(1.0, v / SHARE_WINDOW_S) for r, v in busy.items()})
        return cached[1]

    @staticmethod
    def _last_reward(nr: NativeRunState) -> float | None:
        for row in reversed(nr.metrics[-64:]):
            for key in ("reward_mean", "reward"):
                if isinstance(row.get(key), (int, float)):
                    return row[key]
        return None

    def list(self, tenant: str, include_all: bool = False) -> list[dict]:
        """The tenant's notebook runs; with ``include_all`` its Tinker-SDK training runs too, and the
        ended runs its jobs keep."""
        out = [
            self.describe(nr)
            for nr in list(self.runs.values())
            if nr.run.tenant == tenant and nr.run.run_id in self.svc.runs
        ]
        if include_all:
            out += [
                self.describe_sdk(run)
                for run in list(self.svc.runs.values())
                if run.tenant == tenant and run.run_id not in self.runs
            ]
            jobs = self.jobs
            for run_id in jobs.archived_of(tenant) if jobs is not None else []:
                kept = None if run_id in self.svc.runs else jobs.archived(tenant, run_id)
                if kept is not None:
                    out.append(kept)
        return out

    def _kept(self, tenant: str, run_id: str) -> dict | None:
        """A job's ended run's entry, kept after its session (engine/jobs.py)."""
        jobs = self.jobs
        return jobs.archived(tenant, run_id) if jobs is not None and run_id not in self.svc.runs else None

    def entry(self, tenant: str, run_id: str) -> dict:
        """One run of ``tenant`` as the runs list shows it, notebook or Tinker SDK, or a job's ended
        run (else 404)."""
        nr = self.runs.get(run_id)
        if nr is not None and run_id in self.svc.runs:
            return self.describe(self.get(tenant, run_id))
        run = self.svc.runs.get(run_id)
        if run is None or run.tenant != tenant:
            kept = self._kept(tenant, run_id)
            if kept is not None:
                return kept
            raise NotFound(f"unknown run {run_id!r}", field="run_id")
        return self.describe_sdk(run)

    def metrics(self, tenant: str, run_id: str) -> list[dict]:
        """The run's metric rows (a job's ended run: the rows kept with it; a Tinker-SDK run: none)."""
        entry = self.entry(tenant, run_id)
        if entry.get("ended"):
            jobs = self.jobs
            return jobs.archived_metrics(tenant, run_id) if jobs is not None else []
        if entry["kind"] == "sdk":
            return []
        return self.get(tenant, run_id).metrics

    def heartbeat(self, tenant: str, run_id: str, body: dict | None = None) -> NativeRunState:
        """Keep the run's session alive (a paused notebook is not an abandoned one). ``body``'s
        ``state``: the kernel's Run reports its state (the runs list shows it; a pause or stop the
        panel asked for becomes "paused" / "stopped" once the kernel says so)."""
        nr = self.get(tenant, run_id)
        state = (body or {}).get("state")
        if state is not None and state not in KERNEL_STATES:
            raise UserError(
                f"state must be one of {', '.join(KERNEL_STATES)}; got {repr(state)[:100]}", field="state"
            )
        self.svc.heartbeat(tenant, nr.run.session_id)
        if state is not None:
            self._kernel_reports(nr, state)
        return nr

    # -- run control ------------------------------------------------------------------------------
    def control_of(self, run_id: str) -> Control:
        c = self.controls.get(run_id)
        if c is None:
            run = self.svc.runs.get(run_id)
            return Control(at=run.created_at if run is not None else time.time())
        return c

    def _set_control(self, run_id: str, control: Control) -> None:
        """Keep ``control``; a Tinker-SDK run paused or stopped has its ops refused."""
        with self._lock:
            self.controls[run_id] = control
            if run_id not in self.runs and control.state in ("paused", "stopped"):
                self.svc.refused_runs[run_id] = RunControlled(run_id, control)
            else:
                self.svc.refused_runs.pop(run_id, None)

    def _announce(self, tenant: str, run_id: str, control: Control) -> None:
        self.events.publish(tenant, {"event": "control", "run_id": run_id, "control": control.to_json()})

    def _kernel_reports(self, nr: NativeRunState, state: str) -> None:
        run_id, tenant = nr.run.run_id, nr.run.tenant
        if state != nr.kernel_state:
            with self.svc.durability.change():  # journaled: a finished or stopped run stays so
                self.svc.durability.append(("run_state", tenant, run_id, state))
                nr.kernel_state = state
            self.events.publish(tenant, {"event": "state", "run_id": run_id, "state": state})
        c = self.controls.get(run_id)
        if c is None:
            return
        new = None
        if c.state == "pause_requested" and state == "paused":
            new = "paused"
        elif c.state == "stop_requested" and state in KERNEL_DONE:
            new = "stopped"
        elif c.state in ("pause_requested", "paused") and state in KERNEL_DONE:
            new = "stopped" if state == "stopped" else "running"
        elif c.state == "paused" and state == "running":  # resumed in the notebook (run.resume())
            new = "running"
        if new is not None and new != c.state:
            control = Control(new, c.reason if new != "running" else None)
            with self.svc.durability.change():  # the kernel's confirmation is journaled like the request
                self.svc.durability.append(("control", tenant, run_id, control.to_json()))
                self._set_control(run_id, control)
            self._announce(tenant, run_id, control)

    def control(self, tenant: str, run_id: str, body: dict) -> dict:
        """Pause, resume or stop a run (notebook or Tinker SDK) of ``tenant``; answers its entry."""
        problem = control_problem(body)
        if problem is not None:
            raise UserError(problem[1], field=problem[0])
        action = body["action"]
        reason = body.get("reason") or DEFAULT_REASONS[action]
        nr = self.runs.get(run_id)
        run = self.svc.runs.get(run_id)
        if run is None or run.tenant != tenant:
            raise NotFound(f"unknown run {run_id!r}", field="run_id")
        if nr is None:  # a Tinker-SDK run: the service itself holds it
            state = {"pause": "paused", "stop": "stopped", "resume": "running"}[action]
        else:
            kernel = nr.kernel_state
            orphaned = time.time() - self._status(run)["last_activity"] > self.orphan_after_s
            if action == "resume":
                if kernel in KERNEL_DONE:
                    raise Conflict(
                        f"run {run_id} is {kernel} in its notebook; it cannot resume", field="action"
                    )
                state = "running"
            elif action == "pause":
                if kernel in KERNEL_DONE:
                    raise Conflict(
                        f"run {run_id} is {kernel} in its notebook; it cannot pause", field="action"
                    )
                state = "paused" if kernel == "paused" else "pause_requested"
            else:  # nobody will confirm a stop of a finished or orphaned run: it is stopped now
                state = "stopped" if kernel in KERNEL_DONE or orphaned else "stop_requested"
        control = Control(state, reason if state != "running" else None)
        with self.svc.durability.change():
            self.svc.durability.append(("control", tenant, run_id, control.to_json()))
            self._set_control(run_id, control)
        self._announce(tenant, run_id, control)
        return self.describe(nr) if nr is not None else self.describe_sdk(run)

    def _replay_control(self, record: tuple) -> None:
        _, tenant, run_id, control = record
        run = self.svc.runs.get(run_id)
        if run is not None and run.tenant == tenant:
            self._set_control(run_id, Control(**control))
        elif run is None:  # a notebook run its creating intent has not made yet
            self._replayed.setdefault(run_id, {"tenant": tenant})["control"] = Control(**control)

    def _replay_run_state(self, record: tuple) -> None:
        _, tenant, run_id, state = record
        nr = self.runs.get(run_id)
        if nr is not None and nr.run.tenant == tenant:
            nr.kernel_state = state
        elif nr is None:
            self._replayed.setdefault(run_id, {"tenant": tenant})["state"] = state

    async def delete(self, tenant: str, run_id: str) -> None:
        nr = self.get(tenant, run_id)
        # _session_finished forgets the run; the session file write runs off the event loop.
        await anyio.to_thread.run_sync(lambda: self.svc.finish_session(tenant, nr.run.session_id))
        self.events.publish(tenant, {"event": "deleted", "run_id": run_id})

    def _session_finished(self, tenant: str, session_id: str, run_ids: list[str]) -> None:
        """Forget the runs of a finished session (deleted, or reaped when idle), their metric rows
        and their stored samples; a job's run is kept first (its entry and rows, in the job's folder)."""
        gone = set(run_ids)
        jobs = self.jobs
        for r in run_ids:
            nr = self.runs.get(r)
            job_id = (nr.run.user_metadata or {}).get(JOB_META_KEY) if nr is not None else None
            if job_id is None or jobs is None:
                continue
            try:
                entry = self.describe(nr)
                entry.update(
                    ended=True,
                    ended_at=round(time.time(), 3),
                    orphaned=False,
                    share=0.0,
                    state=nr.kernel_state if nr.kernel_state in KERNEL_DONE else "ended",
                )
                with nr.lock:
                    rows = list(nr.metrics)
                jobs.archive_run(tenant, job_id, r, entry, rows)
            except Exception:  # noqa: BLE001 - a full disk must not keep the session from finishing
                log.exception("keeping run %s of job %s failed", r, job_id)
        self.references.forget(run_ids)
        with self._lock:
            for r in run_ids:
                self.controls.pop(r, None)
                self.svc.refused_runs.pop(r, None)
                self.svc.last_loss.pop(r, None)
            if not [self.runs.pop(r) for r in run_ids if r in self.runs]:  # every one, not just the first
                return
            for sid in [sid for sid, s in self.samples.items() if s.run_id in gone]:
                self.sample_counts[self.samples.pop(sid).tenant] -= 1

    # -- sampling -------------------------------------------------------------------------------
    def _encode(self, tok: Any, prompt: Any, i: int, chat: bool, vocab: int = 0) -> list[int]:
        if isinstance(prompt, dict) and isinstance(prompt.get("tokens"), list):  # as they are
            ids = prompt["tokens"]
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise UserError(
                    f"prompts[{i}].tokens must be token ids in [0, {vocab})", field=f"prompts[{i}].tokens"
                )
            return list(ids)
        if isinstance(prompt, str):
            if chat and getattr(tok, "chat_template", None):
                ids = tok.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
                )
                return list(tok.encode(ids, add_special_tokens=False))
            return list(tok.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, list) and prompt:
            for j, m in enumerate(prompt):  # the chat template reads both, as strings
                if not (
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                ):
                    raise UserError(
                        f"prompts[{i}][{j}] must be a chat message {{role, content}} of strings; "
                        f"got {repr(m)[:200]}",
                        field=f"prompts[{i}][{j}]",
                    )
            text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return list(tok.encode(text, add_special_tokens=False))
        raise UserError(
            f"prompts[{i}] must be a string, a list of chat messages ({{role, content}}) or {{tokens}}",
            field=f"prompts[{i}]",
        )

    async def sample(self, tenant: str, run_id: str, body: dict, idem: tuple | None = None) -> dict:
        nr = self.get(tenant, run_id)
        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not prompts:
            raise UserError("prompts must be a non-empty list", field="prompts")
        if len(prompts) > self.svc.limits.max_datums:
            raise UserError(
                f"prompts: at most {self.svc.limits.max_datums} per call (OPENRL_MAX_DATUMS); got {len(prompts)}",
                field="prompts",
            )
        chat = body.get("chat")
        if chat is None:
            chat = True
        elif not isinstance(chat, bool):
            raise UserError(
                f"chat must be true (apply the chat template) or false (raw text); got "
                f"{type(chat).__name__} {repr(chat)[:100]}",
                field="chat",
            )
        base = self.svc.model_of(nr.run).base
        for i, p in enumerate(prompts):  # the raw text's length first: no encoding of what cannot fit
            if isinstance(p, str):
                check_text(base, len(p), f"prompts[{i}]")
            elif isinstance(p, list):
                check_messages(base, p, f"prompts[{i}]")
        raw = {
            k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop") if k in body
        }
        num = body.get("num_samples", 1)

        def jobs_of() -> list[SampleJob]:  # on a worker thread: chat templates and tokenizers are work
            params = self.svc.checks.sampling_params(raw, base)
            jobs = []
            for i, p in enumerate(prompts):
                toks = self._encode(base.tokenizer, p, i, bool(chat), base.vocab_size)
                if not toks:
                    raise UserError(f"prompts[{i}] encodes to no tokens", field=f"prompts[{i}]")
                # each prompt checked as the Tinker path checks it (limits, context, vocabulary)
                job_params = self.svc.checks.check_sample(toks, num, params, base=base)
                seed = None if job_params.seed is None else job_params.seed + 7_919 * i
                jobs.append(
                    SampleJob(
                        prompt=toks, num_samples=num, params=replace(job_params, seed=seed), adapter=None
                    )
                )
            return jobs

        # its place in the run's order is taken as it arrives, as before any wait: a train step sent
        # after it (overlapped sampling) runs after it, however long its prompts take to encode
        seq = nr.next_seq(SEQ_SLOTS["sample"])
        try:
            jobs = await off_loop(jobs_of)
        except BaseException as e:  # refused (or cancelled) before it was accepted: no gap left behind
            if not nr.give_back(seq, SEQ_SLOTS["sample"]):
                self._fill_slots("sample", {"tenant": tenant, "run_id": run_id, "seq": seq}, e)
            raise
        inputs = {
            "tenant": tenant,
            "run_id": run_id,
            "seq": seq,
            "jobs": [replace(j, params=self.svc.seeded(j.params)) for j in jobs],
            "sample_ids": [[f"smp-{uuid.uuid4().hex}" for _ in range(num)] for _ in jobs],
            "idem": idem,
        }
        return await self._intent("sample", inputs, nr)

    async def _do_sample(self, inputs: dict) -> dict:
        tenant, run_id, jobs = inputs["tenant"], inputs["run_id"], inputs["jobs"]
        nr = self.get(tenant, run_id)
        nr.bump(inputs["seq"])
        # One batched decode of this call's prompts (with fusion on, other runs' ready sampling joins).
        rec = self.svc.sample_run(tenant, run_id, inputs["seq"], jobs, None)
        outs = await self._result(rec)
        base = self.svc.model_of(nr.run).base
        # detokenising up to prompts x num_samples completions is work: off the event loop
        samples = await off_loop(lambda: self._samples(inputs, jobs, outs, base))
        return {"run_id": run_id, "snapshot": nr.steps, "samples": samples}

    def _samples(self, inputs: dict, jobs: list[SampleJob], outs: list, base) -> list[dict]:
        """A sample call's completions stored by sample id and as the reply shows them (their text)."""
        tenant, run_id, tok = inputs["tenant"], inputs["run_id"], base.tokenizer
        samples = []
        for i, (job, out) in enumerate(zip(jobs, outs, strict=True)):
            stop_ids = set(job.params.stop_token_ids) or set(base.eos_token_ids)
            for sid, seq in zip(inputs["sample_ids"][i], out.sequences, strict=True):
                self._store(sid, StoredSample(run_id, tenant, job.prompt, seq.tokens, seq.logprobs))
                text_tokens = (
                    seq.tokens[:-1]
                    if (seq.stop_reason == "stop" and seq.tokens and seq.tokens[-1] in stop_ids)
                    else seq.tokens
                )
                text = tok.decode(text_tokens, skip_special_tokens=False)
                for s in job.params.stop_strings:
                    if seq.stop_reason == "stop" and s in text:
                        text = text[: text.index(s)]
                samples.append(
                    {
                        "sample_id": sid,
                        "prompt_index": i,
                        "text": text,
                        "tokens": seq.tokens,
                        "logprobs": seq.logprobs,
                        "stop_reason": seq.stop_reason,
                    }
                )
        return samples

    def _store(self, sid: str, sample: StoredSample) -> None:
        with self._lock:
            if sid not in self.samples:
                self.sample_counts[sample.tenant] += 1
            self.samples[sid] = sample
        self.sweep_samples(time.time())

    def sweep_samples(self, now: float) -> None:
        """Forget samples older than SAMPLE_TTL_S; beyond MAX_STORED_SAMPLES, the oldest of the tenant
        holding the most, so one tenant's sampling never drops another's samples before they train on
        them (run on every store and on each housekeeping round, so an idle service frees them too)."""
        with self._lock:
            while self.samples and now - next(iter(self.samples.values())).created_at > SAMPLE_TTL_S:
                self.sample_counts[self.samples.popitem(last=False)[1].tenant] -= 1
            while len(self.samples) > MAX_STORED_SAMPLES:
                heaviest = self.sample_counts.most_common(1)[0][0]
                oldest = next(sid for sid, smp in self.samples.items() if smp.tenant == heaviest)
                del self.samples[oldest]
                self.sample_counts[heaviest] -= 1

    # -- training -------------------------------------------------------------------------------
    async def train_step(self, tenant: str, run_id: str, body: dict, idem: tuple | None = None) -> dict:
        nr = self.get(tenant, run_id)
        items = body.get("samples")
        if not isinstance(items, list) or not items:
            raise UserError("samples must be a non-empty list of {sample_id, advantage}", field="samples")
        loss = body.get("loss", "importance_sampling")
        if loss not in RL_LOSSES:
            raise UserError(f"loss must be one of {', '.join(RL_LOSSES)}; got {loss!r}", field="loss")
        config = loss_config(loss, body.get("loss_config"))
        config["kl_ref_coef"] = kl = kl_coef(body)
        base = self.svc.model_of(nr.run).base
        optimizer = body.get("optimizer")
        adam = adam_of({} if optimizer is None else optimizer, base.defaults)
        data = []
        action_tokens = env_tokens = 0
        for i, item in enumerate(items):
            where = f"samples[{i}]"
            if not isinstance(item, dict):
                raise UserError(f"{where} must be an object {{sample_id, advantage}}", field=where)
            adv = number(item.get("advantage"), f"{where}.advantage")
            if ("episode" in item) == ("sample_id" in item):
                raise UserError(
                    f"{where}: give sample_id (one sample) or episode (its turns' sample ids), not both",
                    field=where,
                )
            if "episode" in item:  # a multi-turn episode: its turns' samples, in order
                ids = item["episode"]
                if not isinstance(ids, list) or not ids:
                    raise UserError(
                        f"{where}.episode must be a non-empty list of sample ids", field=f"{where}.episode"
                    )
                named = [(f"{where}.episode[{k}]", sid) for k, sid in enumerate(ids)]
            else:
                named = [(f"{where}.sample_id", item.get("sample_id"))]
            turns = []
            for at, sid in named:
                if not isinstance(sid, str):
                    raise UserError(
                        f"{at} must be a string (a sample id from /sample); got {repr(sid)[:200]}", field=at
                    )
                stored = self.samples.get(sid)
                if stored is None or stored.tenant != tenant or stored.run_id != run_id:
                    raise NotFound(
                        f"{at} {sid!r} is unknown for this run (samples are kept {SAMPLE_TTL_S:.0f} s)",
                        field=at,
                    )
                turns.append((stored.prompt, stored.tokens, stored.logprobs))
            layout = episode_layout(turns, float(adv))
            action_tokens += layout.action_tokens
            env_tokens += layout.env_tokens
            for seq in layout.sequences:
                if not any(seq.advantages) and not layout.action_tokens:
                    continue  # nothing sampled: nothing to train
                data.append(
                    DatumArrays(
                        np.asarray(seq.tokens[:-1], dtype=np.int64),
                        {
                            "target_tokens": np.asarray(seq.tokens[1:], dtype=np.int64),
                            "logprobs": np.asarray(seq.logprobs[1:], dtype=np.float32),
                            "advantages": np.asarray(seq.advantages[1:], dtype=np.float32),
                        },
                    )
                )
        if not data:
            raise UserError("samples: every named sample is empty; nothing to train on", field="samples")
        self.svc.checks.validate_datums(data, loss, base)
        seq = None
        if kl > 0:  # its place in the run's order is taken now, as before the wait for the reference
            seq = nr.next_seq(SEQ_SLOTS["train_step"])
            try:
                data = await self.references.with_ref_logprobs(tenant, nr.run, data, self._result)
            except BaseException as e:  # refused (or cancelled) before it was accepted: no gap left
                if not nr.give_back(seq, SEQ_SLOTS["train_step"]):
                    self._fill_slots("train_step", {"tenant": tenant, "run_id": run_id, "seq": seq}, e)
                raise
        inputs = {
            "tenant": tenant,
            "run_id": run_id,
            "data": data,  # resolved (with the reference logprobs): a replay needs no sample store
            "loss": loss,
            "config": config,
            "adam": adam,
            "idem": idem,
            "counts": [action_tokens, env_tokens],
        }
        if seq is not None:
            inputs["seq"] = seq
        return await self._intent("train_step", inputs, nr)

    async def sft_step(self, tenant: str, run_id: str, body: dict, idem: tuple | None = None) -> dict:
        """One supervised step (a warm start before RL): cross-entropy on the examples' completions,
        then AdamW; journaled, replayed and answered once per key as a train step is."""
        nr = self.get(tenant, run_id)
        examples = body.get("examples")
        lim = self.svc.limits
        if not isinstance(examples, list) or not examples:
            raise UserError("examples must be a non-empty list of {prompt, completion}", field="examples")
        if len(examples) > lim.max_datums:
            raise UserError(
                f"examples: at most {lim.max_datums} per step (OPENRL_MAX_DATUMS); got {len(examples)}",
                field="examples",
            )
        base = self.svc.model_of(nr.run).base
        chat = body.get("chat", True)
        for i, ex in enumerate(examples):  # the raw text's length first: no encoding of what cannot fit
            where = f"examples[{i}]"
            if not isinstance(ex, dict) or not isinstance(ex.get("completion"), str):
                raise UserError(f"{where} must be an object {{prompt, completion}}", field=where)
            prompt = ex.get("prompt")
            if isinstance(prompt, str):
                check_text(base, len(prompt) + len(ex["completion"]), where)
            elif isinstance(prompt, list) and prompt:
                check_messages(base, [*prompt, {"role": "assistant", "content": ex["completion"]}], where)
            else:
                raise UserError(
                    f"{where}.prompt must be a string or a list of chat messages", field=f"{where}.prompt"
                )
        adam = adam_of(body.get("optimizer") or {}, base.defaults)
        data, trained = await off_loop(
            lambda: sft_datums(base.tokenizer, examples, bool(chat), base.vocab_size)
        )
        self.svc.checks.validate_datums(data, "cross_entropy", base)
        inputs = {
            "tenant": tenant,
            "run_id": run_id,
            "data": data,
            "loss": "cross_entropy",
            "config": {},
            "adam": adam,
            "idem": idem,
            "counts": [trained, sum(len(d.tokens) + 1 for d in data) - trained],
        }
        return await self._intent("train_step", inputs, nr)

    async def _do_train_step(self, inputs: dict) -> dict:
        tenant, run_id, adam = inputs["tenant"], inputs["run_id"], inputs["adam"]
        nr = self.get(tenant, run_id)
        nr.bump(inputs["seq"] + 1)
        # The Tinker façade's own two ops, back to back in the run's lane: forward_backward (which
        # fuses with other runs' ready training), then optim_step. Shielded: a client that goes away
        # mid-step does not leave gradients waiting for an optimizer step that never comes.
        result, metrics = await asyncio.shield(
            asyncio.ensure_future(
                self._fb_then_optim(
                    tenant, run_id, inputs["seq"], inputs["data"], inputs["loss"], inputs["config"], adam
                )
            )
        )
        nr.steps += 1
        if inputs["loss"] == "cross_entropy":  # a supervised step (sft_step): the loss per trained token
            trained = max(1, int(inputs["counts"][0]))
            reply = {
                "run_id": run_id,
                "step": nr.steps,
                "loss": result.loss / trained,
                "tokens": trained,
                "grad_norm": metrics["grad_norm:mean"],
                "learning_rate": adam.learning_rate,
                "snapshot": nr.steps,
            }
            self.events.publish(tenant, {"event": "step", **reply})
            return reply
        st = result.stats or {}
        n = max(1, int(st.get("tokens", 0)))
        reply = {
            "run_id": run_id,
            "step": nr.steps,
            "loss": result.loss,
            "tokens": result.tokens,
            "ratio_mean": st.get("ratio_sum", 0.0) / n if st else None,
            "ratio_min": st.get("ratio_min") if st else None,
            "ratio_max": st.get("ratio_max") if st else None,
            "kl": st.get("kl_sum", 0.0) / n if st else None,
            # mean k3 estimate of KL(policy ‖ the run's starting weights) over the trained tokens
            "kl_ref": st["kl_ref_sum"] / n if "kl_ref_sum" in st else None,
            "kl_coef": inputs["config"].get("kl_ref_coef", 0.0),
            "clip_fraction": st.get("clipped", 0) / n if st and "clipped" in st else 0.0,
            "grad_norm": metrics["grad_norm:mean"],
            "learning_rate": adam.learning_rate,
            # the model's tokens trained with the advantages; the environment's, trained at weight 0
            "action_tokens": (inputs.get("counts") or [None, None])[0],
            "env_tokens": (inputs.get("counts") or [None, None])[1],
            "snapshot": nr.steps,
        }
        self.events.publish(tenant, {"event": "step", **reply})
        return reply

    async def _fb_then_optim(
        self, tenant: str, run_id: str, seq: int, data, loss: str, config: dict, adam: AdamParams
    ) -> tuple[ForwardResult, dict]:
        fb = self.svc.forward_backward(tenant, run_id, seq, data, loss, config, False, None)
        try:
            result = await self._result(fb)
        except ApiError as e:
            skipped = UserError(f"optim_step skipped: the step's forward/backward failed ({e.message})")
            self.svc.optim_step(tenant, run_id, seq + 1, skipped, None)  # fills its seq slot, runs nothing
            raise
        out = await self._result(self.svc.optim_step(tenant, run_id, seq + 1, adam, None))
        return result, out["metrics"]

    # -- checkpoints ----------------------------------------------------------------------------
    async def save_checkpoint(self, tenant: str, run_id: str, body: dict, idem: tuple | None = None) -> dict:
        """Weights + optimizer state as a Tinker ``weights`` checkpoint; returns its path."""
        nr = self.get(tenant, run_id)
        name = body.get("name")
        if not isinstance(name, str):
            raise UserError(
                f"name is required: the checkpoint's name (a string); got {repr(name)[:100]}", field="name"
            )
        check_name(name, "name")
        # checked here as the save checks them (it checks them again), each naming this API's field
        self.svc.checks.check_metadata(body.get("user_metadata"))
        self.svc.checks.expiry(body.get("ttl_seconds"))
        inputs = {
            "tenant": tenant,
            "run_id": run_id,
            "name": name,
            "overwrite": flag(body, "overwrite"),
            "user_metadata": body.get("user_metadata"),
            "ttl_seconds": body.get("ttl_seconds"),
            "idem": idem,
        }
        return await self._intent("checkpoint", inputs, nr)

    async def _do_checkpoint(self, inputs: dict, intent_id: str) -> dict:
        tenant, run_id = inputs["tenant"], inputs["run_id"]
        self.get(tenant, run_id).bump(inputs["seq"])
        rec = self.svc.save_state(
            tenant,
            run_id,
            inputs["seq"],
            inputs["name"],
            inputs["overwrite"],
            inputs["user_metadata"],
            None,
            ttl_seconds=inputs["ttl_seconds"],
            writer=intent_id,
        )
        return await self._result(rec)

    # -- metrics --------------------------------------------------------------------------------
    async def add_metrics(self, tenant: str, run_id: str, body: dict, idem: tuple | None = None) -> dict:
        """Store one row of client-side metrics (validated here, kept with the run; journaled)."""
        self.get(tenant, run_id)
        step = integer(body.get("step"), "step", 0)
        if len(body) - ("step" in body) > MAX_METRIC_KEYS:
            raise UserError(
                f"metrics: at most {MAX_METRIC_KEYS} values per row; got {len(body) - 1}", field="metrics"
            )
        row = {"step": step}
        for k, v in body.items():
            if k == "step":
                continue
            if len(k) > MAX_METRIC_KEY_CHARS:
                raise UserError(
                    f"metrics: a name has at most {MAX_METRIC_KEY_CHARS} characters", field=k[:64]
                )
            if k == "reward_name":
                if not isinstance(v, str) or len(v) > 128:
                    raise UserError(
                        f"reward_name must be a string of at most 128 characters; got {v!r}", field=k
                    )
                row[k] = v
            else:  # whole numbers stay whole (a reward version), others are floats
                row[k] = v if isinstance(v, int) and not isinstance(v, bool) else number(v, f"metrics.{k}")
        return await self._intent("metrics", {"tenant": tenant, "run_id": run_id, "row": row, "idem": idem})

    async def _do_metrics(self, inputs: dict) -> dict:
        tenant, run_id, row = inputs["tenant"], inputs["run_id"], inputs["row"]
        nr = self.get(tenant, run_id)
        with nr.lock:
            nr.metrics.append(row)
            excess = len(nr.metrics) - self.svc.limits.max_metric_rows
            if excess > 0:  # a memmove of pointers: cheap next to the request
                del nr.metrics[:excess]
                nr.metrics_dropped += excess
        self.events.publish(tenant, {"event": "metrics", "run_id": run_id, "metrics": row})
        return row

    # -- telemetry ------------------------------------------------------------------------------
    def tick(self, tenant: str, window_s: float = 5.0) -> dict:
        """Device activity over the last window: NVML utilisation (and memory) where a GPU and
        nvidia-ml-py exist, else the engine's busy fraction labelled "engine busy" (never "GPU"); each
        of the tenant's runs' share of the engine's busy time; the share of it spent in fused calls;
        the queue depth; queue wait p50/p99 of
        the ops that started in the window (submission to start); tokens/s trained and sampled."""
        if self._nvml is None:
            self._nvml = NvmlReader.for_device(str(getattr(self.svc.base, "device", "cpu")))
        now = time.time()
        stats = self.svc.recorder.window(now - window_s, now)
        busy: dict[str, float] = stats["busy_s"]
        total = sum(busy.values())
        mine = {r: v for r, v in busy.items() if (self.runs.get(r) and self.runs[r].run.tenant == tenant)}
        engine_busy = {"label": "engine busy", "value": min(1.0, total / window_s)}
        group = getattr(self.svc, "group", None)  # several devices serving the model
        nvml = self._nvml.read()
        memory = None
        if nvml is not None:
            memory = {
                "label": "GPU memory (NVML)",
                "used_bytes": nvml["memory_used_bytes"],
                "total_bytes": nvml["memory_total_bytes"],
            }
        return {
            "schema": EVENTS_SCHEMA_VERSION,
            "type": "tick",
            "time": now,
            "window_s": window_s,
            "utilisation": nvml or engine_busy,
            "engine_busy": engine_busy["value"],
            # each device of the model's group (world size > 1): its busy share of the window
            "devices": group.devices(window_s) if group is not None else [],
            "memory": memory,
            "runs": {r: v / total for r, v in mine.items()} if total else {},
            # share of the engine's busy time spent in fused calls (several runs' ops in one pass)
            "fused_share": stats["fused_busy_s"] / total if total else 0.0,
            "queue_depth": self.svc.engine.queue_depth(),
            "queue_wait_s": stats["queue_wait_s"],
            "tokens_per_s": stats["tokens_per_s"],
        }

    async def _result(self, rec):
        """The op's result; a 503 naming the worker (not an endless wait) if the worker has died, or
        saying the service is shutting down once the drain holds the futures (a held wait returns at
        once: looping on it would keep the event loop from finishing the shutdown)."""
        while not await self.svc.futures.wait(rec, 1.0):
            if self.svc.futures.held:
                raise ShuttingDown(
                    "openrl-service is shutting down; this request is journaled and runs when it restarts: "
                    "send it again then (with the same Idempotency-Key it is not run twice)"
                )
            self.svc.engine.require_alive()
        if rec.error is not None:
            raise rec.error
        return rec.result
