"""Background RL runs: ``session.train(...)`` / ``%openrl train`` return a :class:`Run` at once.

    run = session.train(reward="letters", prompts=PROMPTS, steps=60, group=8)
    run.pause(); run.resume(); run.save("half-way"); run.stop(); run.wait()
    run.history[-1]     # {"step": 60, "reward_mean": ..., "reward_version": 2, "loss": ..., ...}

Each step, on the shared runner thread (see ``runner.py``):

1. picks the newest version of the named reward (so a re-defined reward applies from the next
   step); a function given as ``train(reward=fn)`` is pinned to the run and always used;
2. samples ``group`` completions for each of ``batch`` prompts from the run's current weights;
3. scores them in the runner's thread pool (``async def`` rewards on the runner loop);
4. turns rewards into group-relative advantages (reward − group mean, optionally ÷ group std);
5. sends one train step naming the samples; the service computes the importance-sampling loss
   with the sampler's logprobs, so the ratio/KL statistics it returns are honest;
6. stores the step's reward statistics with the run on the service and notifies the dashboard.
   An environment run (``train(env=...)``) plays episodes instead of steps 2-4 (``rollouts.py``).

A step whose samples all fail, or whose service call fails, pauses the run with the error; nothing
trained is lost and ``resume()`` retries the step (with the newest reward version). A failing reward
shows at once in the cell that started the run and on its dashboard (``rewards.RewardFailure``: the
exception, the reward's version, a sample), not only at ``wait()``. A service that is unavailable
(connection refused, or 503 while it drains or restarts) does not pause the run: its log (and
dashboard) says "service unavailable — retrying in N s" and the step is retried by itself, backing off
from 1 s to 30 s, until the service answers again. A step whose train_step got no answer (the service
may have applied it) is not sampled again: the retry (or ``resume()``) re-sends that same train_step
with the same ``X-Idempotency-Key``, and the service answers the first reply. Pausing and stopping take
effect between steps. While the run is not done (paused included) it heartbeats the service every third
of the service's ``idle_timeout_s`` (at most 2 min apart, and a third of its ``orphan_after_s``), so a
paused run is not reaped as abandoned nor listed as orphaned.

Run control from outside the kernel (the JupyterLab side panel, ``POST /openrl/v1/runs/{id}/control``):
each heartbeat (and, before each step, the run itself) reads the run's ``control`` from the service, so a
pause from the panel pauses it at its next step, a resume continues it, and a stop ends it
(``run.stop_reason`` "stopped from the panel"). Every state change is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from openrl_jupyter import evals, rollouts, updates
from openrl_jupyter._exceptions import (
    NotFoundError,
    OpenRLError,
    RunFailed,
    RunPaused,
    RunTimeout,
    ServiceUnavailable,
    UsageError,
)
from openrl_jupyter.config import TrainConfig
from openrl_jupyter.prepare import samples_step
from openrl_jupyter.rewards import RewardFailure, RewardVersion, Scored
from openrl_jupyter.run_state import (  # noqa: F401 - RunState, heartbeat_interval and stopped_from_outside are imported from here too
    ACTIVE,
    HEARTBEAT_MAX_S,
    RunState,
    from_panel,
    heartbeat_interval,
    one_line,
    stopped_from_outside,
)
from openrl_jupyter.runner import CellOutput, get_runner, notify
from openrl_jupyter.steps import PreparedStep, reported, step_row
from openrl_jupyter.trackers import Trackers

MAX_KEPT_SAMPLES = 512
# a step the service could not take is retried after 1, 2, 4... s, at most this
UNAVAILABLE_RETRY_MAX_S = 30.0
CONTROL_POLL_S = 1.0  # while paused, the run asks the service for a resume or stop this often
CONTROL_WAIT_S = 3.0  # the most a step waits for the service's control answer before going on
STOPPED_IN_NOTEBOOK = "stopped in the notebook (run.stop())"


class _StepPaused(Exception):
    """Internal: the step cannot complete; pause with this message."""


class Run:
    """A background RL run; its methods are safe to call from any cell (any thread)."""

    def __init__(self, session: Any, config: TrainConfig):
        self.session = session
        self.config = config
        self.name = config.name or f"run-{uuid.uuid4().hex[:6]}"
        self.model = config.model or session.model or "?"
        self.total_steps = config.steps
        self.run_id: str | None = None
        self.reward_name = config.reward
        self.reward_version: int | None = None
        self.last_error: str | None = None
        self.reward_failure: RewardFailure | None = None  # the reward's last failure, with a sample
        self.started_at = time.time()
        self._state = RunState.STARTING
        self._step = 0
        self._history: list[dict] = []
        self._samples: deque[dict] = deque(maxlen=MAX_KEPT_SAMPLES)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._listeners: list[Callable[[dict], None]] = []
        self._feed_unsubscribe: Callable[[], None] | None = None
        self._want_pause = False
        self._want_stop = False
        self._paused_on_error = False
        # --overlap 1: (step, sampling, prompts)
        self._prefetch: tuple[int, asyncio.Task, list[dict]] | None = None
        self._wake: asyncio.Event | None = None
        self._dashboard = None
        self._rng = random.Random(config.seed)
        self._order: list[int] = []
        self._runner = get_runner()
        self._future = None
        self._heartbeat_s = HEARTBEAT_MAX_S
        self._pending: PreparedStep | None = None  # a step whose train_step has not been answered
        self._outages = 0  # consecutive attempts the service was unavailable for
        self.stop_reason: str | None = None  # why it stopped: run.stop(), or the panel's reason
        self._control_at: float | None = None  # the service's control state last obeyed (its "at")
        self._report_lock: asyncio.Lock | None = None
        self._cell = CellOutput()  # where a reward failure is shown at once: the cell that started it
        self._trackers: Trackers | None = None  # W&B, MLflow, TensorBoard (config.log)
        self._episodes: list = []  # an environment run's newest step's episodes
        self.best: dict | None = None  # eval_every: the best evaluation's step, eval_reward and checkpoint
        self.checkpoints: list[str] = []  # save_every: the checkpoints saved, oldest first

    def start(self, timeout: float = 120.0) -> Run:
        """Create the run on the service (errors raise here, in the cell), then train in the background."""
        self._cell = CellOutput.capture()
        try:
            created = self._runner.submit(self._create()).result(timeout)
        except Exception as exc:
            self._set_state(RunState.FAILED, one_line(exc))
            raise
        self.run_id = created["run_id"]
        self.model = created.get("base_model") or self.model  # the service's word: the dashboard shows it
        if self.config.log:
            self._trackers = Trackers.for_run(self)
        self._heartbeat_s = min(
            heartbeat_interval(created.get("idle_timeout_s")),
            heartbeat_interval(created.get("orphan_after_s")),
        )
        # a control the run already has (a detached job's stop or pause, recorded before the run
        # existed) applies before its first step
        self._obey(created.get("control"))
        self._future = self._runner.submit(self._main())
        return self

    # -- what a cell reads --------------------------------------------------------------------------
    @property
    def state(self) -> RunState:
        return self._state

    @property
    def step(self) -> int:
        """The last completed step (0 before the first)."""
        return self._step

    @property
    def history(self) -> list[dict]:
        """One dict per completed step (a copy): step, reward stats and version, loss, ratio, KL..."""
        with self._lock:
            return [dict(r) for r in self._history]

    @property
    def done(self) -> bool:
        return self._state not in ACTIVE

    def samples(self, k: int = 8) -> list[dict]:
        """The latest ``k`` completions with their prompt, reward (None if failed), error and step."""
        with self._lock:
            return [dict(s) for s in list(self._samples)[-k:]] if k > 0 else []

    def to_pandas(self):
        """``history`` as a pandas DataFrame, one row per step: ``step`` is a column (so
        ``frame[["step", "reward_mean"]]`` works) and the index too (``frame.loc[3]`` is step 3;
        the index is unnamed so that ``sort_values("step")`` is not ambiguous). Needs pandas."""
        try:
            import pandas as pd
        except ImportError:
            raise UsageError("to_pandas() needs pandas: pip install pandas") from None
        frame = pd.DataFrame(self.history)
        if "step" not in frame:
            return frame
        frame.index = pd.Index(frame["step"].to_list())
        return frame

    # -- control --------------------------------------------------------------------------------
    def pause(self, *, wait: bool = False, timeout: float | None = None) -> Run:
        """Pause after the current step; with ``wait=True`` return once no step is in flight."""
        with self._lock:
            if self._state in ACTIVE and not self._want_stop:
                self._want_pause = True
                if self._state in (RunState.RUNNING, RunState.STARTING):
                    self._set_state(RunState.PAUSING)
        if wait:
            self._wait_for(lambda: self._state in (RunState.PAUSED,) or self.done, timeout, "pause")
            self._sync_dashboard()
        return self

    def resume(self) -> Run:
        """Continue a paused run (a step that paused on an error is retried)."""
        with self._lock:
            if self.done:
                raise UsageError(f"run {self.name!r} is {self._state}; it cannot resume")
            self._want_pause = False
            self._paused_on_error = False
            if self._state in (RunState.PAUSED, RunState.PAUSING):
                self._set_state(RunState.RUNNING)
        self._poke()
        return self

    def stop(self, *, wait: bool = False, timeout: float | None = None) -> Run:
        """Stop after the current step (the weights stay on the service; ``save`` still works)."""
        with self._lock:
            if not self.done:
                self._want_stop = True
                self._paused_on_error = False  # stopping is the answer to the error: wait() waits for it
                self.stop_reason = self.stop_reason or STOPPED_IN_NOTEBOOK
                self._set_state(RunState.STOPPING)
        self._poke()
        if wait:
            self.wait(timeout)
        return self

    def wait(self, timeout: float | None = None, *, step: int | None = None) -> Run:
        """Block until the run finishes or stops, or, with ``step``, until that step is done.

        Raises RunPaused when the run pauses on an error (a user's pause keeps waiting), RunFailed
        when it failed, and RunTimeout after ``timeout`` seconds (the run goes on)."""
        what = "finish" if step is None else f"reach step {step}"
        target = self.total_steps if step is None else step
        self._wait_for(lambda: self._step >= target or self.done or self._paused_on_error, timeout, what)
        if step is None:
            self._wait_for(lambda: self.done or self._paused_on_error, timeout, what)
        self._sync_dashboard()
        if self._state == RunState.FAILED:
            raise RunFailed(f"run {self.name!r} failed at step {self._step}: {self.last_error}")
        if self._paused_on_error and (step is None or self._step < step):
            raise RunPaused(f"run {self.name!r} paused at step {self._step}: {self.last_error}")
        return self

    def save(self, name: str | None = None, *, overwrite: bool = False, timeout: float | None = 600.0) -> str:
        """Save the current weights (with optimizer state) as a checkpoint; returns its tinker:// path,
        which the Tinker SDK can load (``create_training_client_from_state``)."""
        name = name or f"{self.name}-step{self._step}"
        if self.run_id is None:
            raise UsageError(f"run {self.name!r} was never created on the service: {self.last_error}")
        client = self.session.async_client()
        extra = {"overwrite": True} if overwrite else {}
        return self._runner.submit(client.save(self.run_id, name, **extra)).result(timeout)

    def export(self, dest: Any, *, merged: bool = False, overwrite: bool = False) -> dict:
        """Save the current weights and download them into the folder ``dest``: a PEFT adapter, or with
        ``merged=True`` a Hugging Face model folder (see ``Session.export``)."""
        return self.session.export(self.name, dest, merged=merged, overwrite=overwrite)

    def subscribe(self, fn: Callable[[dict], None]) -> Callable[[], None]:
        """Call ``fn(event)`` (on the runner thread) for every step, state, log, samples and
        telemetry event; returns the function that unsubscribes."""
        with self._lock:
            self._listeners.append(fn)
            if self._feed_unsubscribe is None and not self.done:
                self._feed_unsubscribe = self.session.feed().subscribe(self._on_feed)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)
                if not self._listeners and self._feed_unsubscribe is not None:
                    self._feed_unsubscribe()
                    self._feed_unsubscribe = None

        return unsubscribe

    def dashboard(self, **options: Any):
        """The run's live dashboard widget (created once; displaying the run shows it)."""
        from openrl_jupyter.dashboard import RunDashboard

        if self._dashboard is None or options:
            if self._dashboard is not None:
                self._dashboard.close()
            self._dashboard = RunDashboard(self, **options)
        return self._dashboard

    def _sync_dashboard(self) -> None:
        """After a wait, on the kernel thread: the dashboard's last update is this cell's (nbclient)."""
        if self._dashboard is not None:
            with contextlib.suppress(Exception):
                self._dashboard.sync()

    # -- reprs (never the key) ----------------------------------------------------------------------
    def __repr__(self) -> str:
        last = self._history[-1] if self._history else {}
        mean = last.get("reward_mean")
        reward = f" reward={mean:.3f}" if isinstance(mean, float) else ""
        version = f" v{self.reward_version}" if self.reward_version else ""
        return (
            f"<openrl Run {self.name!r} {self._state} step {self._step}/{self.total_steps}"
            f" reward {self.reward_name}{version}{reward}>"
        )

    def _ipython_display_(self) -> None:
        """Its live dashboard (its output rewritten when the run settles), else its summary."""
        from IPython.display import display

        from openrl_jupyter.summary import summary_html, widgets_frontend

        if widgets_frontend():
            try:
                return self.dashboard()._ipython_display_()
            except Exception as exc:  # noqa: BLE001 - the summary still shows the run
                self._log(f"dashboard unavailable: {type(exc).__name__}: {exc}")
        display({"text/plain": repr(self), "text/html": summary_html(self)}, raw=True)

    # -- internals ------------------------------------------------------------------------------
    def _wait_for(self, predicate: Callable[[], bool], timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RunTimeout(
                        f"run {self.name!r} did not {what} within {timeout} s "
                        f"(state {self._state}, step {self._step}/{self.total_steps})"
                    )
                self._changed.wait(0.25 if left is None else min(0.25, left))

    def _poke(self) -> None:
        if self._wake is not None and self._runner.alive:
            self._runner.call_soon(self._wake.set)

    def _emit(self, event: dict) -> None:
        with self._lock:
            listeners = list(self._listeners)
        notify(listeners, event)

    def _on_feed(self, event: dict) -> None:
        if event.get("type") == "tick":
            self._emit({"kind": "tick", "tick": event})

    def _set_state(self, state: RunState, error: str | None = None) -> None:
        with self._lock:
            self._state = state
            if error is not None:
                self.last_error = error
            self._changed.notify_all()
        self._emit({"kind": "state", "state": str(state), "error": error})
        if self._trackers is not None and state in (RunState.FINISHED, RunState.STOPPED, RunState.FAILED):
            self._trackers.finish(str(state.value))
        if self.run_id is not None and self._runner.alive:
            self._runner.submit(self._report_state())

    async def _beat(self) -> Any:
        """One heartbeat carrying the run's state as it is when sent; one at a time, so the service
        gets the states in order (a stale "running" never lands after "paused"). Answers the reply."""
        if self._report_lock is None:
            self._report_lock = asyncio.Lock()
        async with self._report_lock:
            return await self.session.async_client().heartbeat(self.run_id, state=str(self._state))

    async def _report_state(self) -> None:
        """Tell the service the run's state (the side panel lists it)."""
        with contextlib.suppress(OpenRLError):
            await self._beat()

    async def _sync_control(self) -> None:
        """Report the state and obey the service's control (pause / resume / stop from the panel);
        skipped while the service is unavailable, and never waits on it more than CONTROL_WAIT_S."""
        if self._outages or self.run_id is None:
            return
        try:
            reply = await asyncio.wait_for(self._beat(), CONTROL_WAIT_S)
        except (OpenRLError, asyncio.TimeoutError):
            return  # the step's own requests say what is wrong with the service
        self._obey(reply.get("control") if isinstance(reply, dict) else None)

    def _obey(self, control: Any) -> None:
        """Apply a control state the service sent, once per change (its ``at``)."""
        if not isinstance(control, dict) or control.get("at") == self._control_at:
            return
        self._control_at = control.get("at")
        wanted, reason = control.get("state"), control.get("reason")
        if self.done:
            return
        if wanted in ("stop_requested", "stopped"):
            with self._lock:
                self._want_stop = True
                self.stop_reason = from_panel("stopped", reason)
                self._set_state(RunState.STOPPING)
            self._log(self.stop_reason)
            self._poke()
        elif wanted in ("pause_requested", "paused"):
            with self._lock:
                if self._want_stop or self._want_pause:
                    return
                self._want_pause = True
                if self._state in (RunState.RUNNING, RunState.STARTING):
                    self._set_state(RunState.PAUSING)
            self._log(from_panel("paused", reason))
        elif wanted == "running" and (self._want_pause or self._state == RunState.PAUSED):
            self._log("resumed from the panel")
            self.resume()

    def _log(self, text: str) -> None:
        self._emit({"kind": "log", "step": self._step, "text": text})

    def _next_prompts(self, k: int | None = None) -> list[dict]:
        prompts = self.config.prompts
        out = []
        for _ in range(self.config.batch if k is None else k):
            if not self._order:
                self._order = list(range(len(prompts)))
                self._rng.shuffle(self._order)
            out.append(prompts[self._order.pop()])
        return out

    async def _gate(self) -> bool:
        """Between steps: obey the service's control, wait while paused (asking it again every
        CONTROL_POLL_S); False when the run should stop."""
        while True:
            await self._sync_control()
            with self._lock:
                if self._want_stop:
                    return False
                if not self._want_pause:
                    if self._state != RunState.RUNNING:
                        self._set_state(RunState.RUNNING)
                    return True
                if self._state != RunState.PAUSED:
                    self._set_state(RunState.PAUSED)
                self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), CONTROL_POLL_S)

    async def _create(self) -> dict:
        self._wake = asyncio.Event()
        cfg = self.config
        return await self.session.async_client().create_run(
            name=self.name, rank=cfg.rank, base_model=cfg.model, seed=cfg.seed, steps=cfg.steps, **cfg.extra
        )

    async def _main(self) -> None:
        beating = asyncio.ensure_future(self._heartbeat())
        try:
            await self._steps()
        finally:
            beating.cancel()

    async def _heartbeat(self) -> None:
        """While the run exists and is not done (paused included), tell the service it is wanted,
        so an idle notebook's run is not reaped as abandoned."""
        while not self.done:
            await asyncio.sleep(self._heartbeat_s)
            try:
                reply = await self._beat()
                self._obey(reply.get("control") if isinstance(reply, dict) else None)
            except NotFoundError as exc:  # the service lost the run: the next step fails with this
                self._log(f"heartbeat: {one_line(exc)}")
                return
            except OpenRLError as exc:  # a blip: the next beat tries again
                self._log(f"heartbeat: {one_line(exc)}")

    async def _steps(self) -> None:
        client = self.session.async_client()
        cfg = self.config
        self._log(f"created run {self.run_id} on {self.session.url}")
        with self._lock:
            if self._state == RunState.STARTING:
                self._set_state(RunState.RUNNING)
        prompts: list[dict] | None = None
        while self._step < cfg.steps:
            if not await self._gate():
                self._drop_prefetch()
                self._set_state(RunState.STOPPED)
                self._stop_ticks()
                return
            if prompts is None:
                prompts = self._next_prompts()
            try:
                prompts = await self._one_step(client, self._step + 1, prompts)
                if self._outages:
                    self._outages = 0
                    self._log(f"step {self._step}: the service is back; continuing")
            except ServiceUnavailable as exc:
                await self._unavailable(self._step + 1, exc)
            except _StepPaused as exc:
                self._pause_with(str(exc))
            except NotFoundError as exc:
                self._set_state(RunState.FAILED, one_line(exc))
                self._stop_ticks()
                return
            except OpenRLError as exc:
                self._pause_with(f"step {self._step + 1}: {one_line(exc)}")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug shows as an error on a paused run
                self._pause_with(
                    f"step {self._step + 1}: {traceback.format_exc(limit=6)}{type(exc).__name__}"
                )
        self._set_state(RunState.FINISHED)
        self._stop_ticks()

    def _drop_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch[1].cancel()
            self._prefetch = None

    def _stop_ticks(self) -> None:
        """A finished run's dashboard stops following the service's telemetry (its last view stays)."""
        with self._lock:
            unsubscribe, self._feed_unsubscribe = self._feed_unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()

    async def _unavailable(self, step: int, exc: ServiceUnavailable) -> None:
        """The service cannot take the step now (unreachable, draining, restarting): say so, wait, and
        let the loop retry it; pause() and stop() cut the wait short. A train_step left unanswered is
        re-sent with its key, so the service applies it once."""
        delay = min(UNAVAILABLE_RETRY_MAX_S, 2.0**self._outages)
        self._outages += 1
        self._log(f"step {step}: service unavailable — retrying in {delay:g} s ({one_line(exc)})")
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay)

    def _pause_with(self, error: str) -> None:
        with self._lock:
            self._want_pause = True
            self._paused_on_error = True
        self._log(error)
        self._set_state(RunState.PAUSED, error)

    def _sample(self, client, step: int, prompts: list[dict], salt: int = 0):
        cfg = self.config
        params: dict[str, Any] = {
            "num_samples": cfg.group,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            **cfg.knobs.sampling(),
        }
        if cfg.seed is not None:
            params["seed"] = (cfg.seed * 100_003 + step * 1_009 + salt * 7) % 2**31
        return client.sample(self.run_id, [p["prompt"] for p in prompts], **params)

    async def _one_step(self, client, step: int, prompts: list[dict]) -> list[dict] | None:
        """One step; returns the prompts of the next step when they are already being sampled
        (``overlap``), else None. A step whose train_step got no answer (the service may have
        applied it) is kept and, on the next attempt, sent again with the same key instead of
        being sampled and trained anew."""
        pending = self._pending
        if pending is None or pending.step != step:
            pending = self._pending = await self._prepare(client, step, prompts)
        trained = await updates.train(self, client, pending)
        self._pending = None
        row = step_row(pending, trained, self.started_at)
        row.update(await evals.periodic(self, client, step))
        await self._report(client, row)
        self._record(row, pending.version)
        return pending.next_prompts

    async def _prepare(self, client, step: int, prompts: list[dict]) -> PreparedStep:
        """Sample, score and compute advantages: everything of a step before its update."""
        if self.config.env:  # an environment run: episodes instead of samples (rollouts.py)
            return await rollouts.prepare_step(self, client, step, prompts)
        return await samples_step(self, client, step, prompts)

    def episodes(self) -> list:
        """The newest step's episodes (an environment run): turns, reward, why each ended."""
        with self._lock:
            return list(self._episodes)

    async def _draw(self, client, step: int, prompts: list[dict]) -> tuple[dict, list[dict], int]:
        """This step's samples (and their prompts), taken from the prefetch when ``overlap`` drew them
        one step ahead (then off-policy by one update, which the ratio corrects for)."""
        if self._prefetch is not None and self._prefetch[0] == step:
            _, task, prompts = self._prefetch
            self._prefetch = None
            try:
                return await task, prompts, 1
            except OpenRLError:  # the early sample failed: draw this step's samples now instead
                return await self._sample(client, step, prompts), prompts, 0
        self._drop_prefetch()
        return await self._sample(client, step, prompts), prompts, 0

    def _prefetch_next(self, client, step: int) -> list[dict] | None:
        """With ``overlap``, sample step k+1 now, from the weights before step k's update, while step k
        is scored; returns its prompts."""
        if not self.config.overlap or step >= self.config.steps:
            return None
        next_prompts = self._next_prompts()
        task = asyncio.ensure_future(self._sample(client, step + 1, next_prompts))
        self._prefetch = (step + 1, task, next_prompts)
        return next_prompts

    def _shown(
        self,
        scored: Scored,
        version: RewardVersion,
        step: int,
        texts: list[str],
        completions: list[str],
        can_pause: bool = True,
    ) -> Scored:
        """Keep and show a step's samples (or episodes); show a failure at once (the dashboard, and the
        starting cell: once per reward version, and at every pause); pause if every one failed (unless
        ``can_pause`` is False: a step's refill, whose first samples scored)."""
        kept = [
            {"step": step, "prompt": p, "completion": c, "reward": r, "error": e}
            for p, c, r, e in zip(texts, completions, scored.rewards, scored.errors, strict=True)
        ]
        with self._lock:
            self._samples.extend(kept)
        self._emit({"kind": "samples", "step": step, "samples": kept[-16:]})
        failure = scored.failure(run=self.name, step=step, prompts=texts, completions=completions)
        if failure is None:
            return scored
        if failure.paused and not can_pause:
            failure = dataclasses.replace(failure, paused=False)
        self.reward_failure = failure
        self._emit({"kind": "reward_error", "failure": failure})
        self._cell.show(failure, once=None if failure.paused else (failure.reward, failure.version))
        if failure.paused:
            raise _StepPaused(
                f"step {step}: every sample failed in reward {version.name} v{version.version}; "
                f"the run is paused (fix the reward, then resume()):\n{failure.traceback or failure.error}"
            )
        self._log(f"step {step}: {failure.failed} of {failure.n} samples failed: {failure.error}")
        return scored

    async def _report(self, client, row: dict) -> None:
        """Store the step's reward statistics with the run on the service."""
        try:
            await client.add_metrics(self.run_id, row["step"], **reported(row))
        except OpenRLError as exc:  # the step is trained: never retry it for its statistics
            self._log(f"step {row['step']}: the service did not store its metrics ({one_line(exc)})")

    @property
    def trackers(self) -> dict[str, str]:
        """Each tracker the run logs to (``log=``) and how it stands: "logging", "closed" (the run is
        done and everything was written) or "not logging: <why>"."""
        return dict(self._trackers.status) if self._trackers is not None else {}

    def wait_logged(self, timeout: float | None = 60.0) -> bool:
        """Whether the run's trackers (``log=``) have written everything and closed, once it is done;
        waits up to ``timeout``. True when it logs nowhere."""
        return self._trackers is None or self._trackers.wait(timeout)

    def _record(self, row: dict, version: RewardVersion) -> None:
        """The step is done: history, step counter, listeners (the dashboard), trackers."""
        if self._trackers is not None:
            self._trackers.step(row, (version.name, version.version, version.fn))
        with self._lock:
            self._history.append(row)
            self._step = row["step"]
            self.reward_version = version.version
            self._changed.notify_all()
        self._emit({"kind": "step", "row": dict(row)})
