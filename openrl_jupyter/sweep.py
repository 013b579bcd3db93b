"""Sweeps ("autoresearch"): many runs at once on one service, with successive halving.

    sweep = session.sweep(reward="letters", prompts=PROMPTS, steps=40,
                          grid={"lr": [1e-4, 3e-4], "rank": [8, 16], "loss": ["ppo"]})
    sweep.wait(); sweep.best; sweep.to_pandas()

``session.sweep`` starts one :class:`~openrl_jupyter.run.Run` per grid point at once (each through
``session.train``; all of them share the service, whose engine packs their steps together), named
``<sweep>-lr1e-4-r8-ppo`` and so on. Every run is created with ``user_metadata {"openrl.sweep":
<sweep name>}`` (the lab panel groups by it); ``detach=`` on ``session.sweep`` runs the whole sweep in
a job that outlives the kernel (``openrl_jupyter.jobs``).

How runs are ranked — one number, the **score** (:meth:`Sweep.score_of`, through :func:`window_mean`):
the mean of the sweep's ``metric`` (default ``reward_mean``; ``mode`` says whether higher or lower is
better) over the run's history rows in a window of steps. For a run still in the sweep the window is
every step after the last rung decided (all its steps before the first); for a run dropped at rung k
it is the window it was ranked on there, from rung k-1 to rung k, so its score is the one in its
``stop_reason``. A run with no row in its window (it ended right at the rung) is scored on all its
rows up to the window's end. The tables (the repr, ``_repr_html_``, the dashboard's, ``to_pandas()``)
show the survivors' scores in one column (``score``, ``score_steps``: the steps it averages), and a
dropped run's only beside the best run's score over the same steps (``rung_score`` vs
``best_rung_score``, over ``rung_steps``): scores over different windows are never set side by side.
``sweep.score_rule()`` says it in words.

Successive halving: at each rung (a step number) a run that reaches it is held (paused between steps)
until every live run has reached it, so they are compared at the same step; they are ranked by their
score over the steps since the previous rung, the better ``keep`` share (rounded up, at least one)
resumes and the others are stopped, with ``stop_reason`` "stopped by the sweep at rung k (…)". A run
that pauses on an error, or that the user pauses, does not hold the others up: it is ranked on the
rows it has. ``budget`` caps the steps of all runs together: once spent, every live run is stopped.
When every run is done, the surviving run with the best score that did not fail is ``sweep.best`` and
its weights are saved as the checkpoint ``<sweep>-best`` (``sweep.checkpoint``, a ``tinker://`` path).

Where the rungs fall (:func:`~openrl_jupyter.sweep_plan.plan_rungs`): each twice as far in as the one
before (..., steps/4, steps/2), as many as halve the runs to one, but none before an eighth of the
steps (at least step 2, at most step 10) nor within two steps of another — so a 4-step sweep has one
rung, at step 2, and a 40-step sweep of 8 runs has three, at steps 5, 10 and 20. ``rungs=k`` asks for
the last k of those; ``rungs=[5, 10]`` names the steps.

Grid keys are ``train`` options: lr, rank, loss, group, batch, max_tokens, temperature, seed,
normalize_std, overlap, kl_coef, loss_agg, lr_schedule, epochs, minibatches, warmup_steps, top_p,
top_k, and reward (a list of reward names or functions, to compare rewards). Every other ``train``
option (eval_every, save_every, stop...) applies to every run alike.
This module imports without torch, pandas or widgets.
"""

from __future__ import annotations

import contextlib
import html
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from openrl_jupyter._exceptions import OpenRLError, UsageError
from openrl_jupyter.sweep_plan import (
    GRID_KEYS,
    MAX_POINTS,
    Score,
    expand_grid,
    plan_rungs,
    point_label,
    reward_label,
    survivors,
    window_mean,
)

if TYPE_CHECKING:
    from openrl_jupyter.run import Run

__all__ = [
    "GRID_KEYS",
    "MAX_POINTS",
    "Score",
    "Sweep",
    "expand_grid",
    "plan_rungs",
    "point_label",
    "survivors",
    "window_mean",
]
POLL_S = 0.2
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # + "-best": a checkpoint name


class Sweep:
    """Runs of a grid, started at once on one session, with successive halving (see the module)."""

    def __init__(
        self,
        session: Any,
        *,
        reward: Any = None,
        prompts: Any,
        grid: Any,
        steps: int = 60,
        budget: int | None = None,
        rungs: Any = None,
        keep: float = 0.5,
        metric: str = "reward_mean",
        mode: str = "max",
        name: str | None = None,
        save_best: bool = True,
        **options: Any,
    ):
        points = expand_grid(grid)
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep < 1:
            raise UsageError(f"keep must be a share between 0 and 1 (exclusive), e.g. 0.5; got {keep!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1_000_000:
            raise UsageError(f"steps must be an integer from 1 to 1000000; got {steps!r}")
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < len(points)
        ):
            raise UsageError(
                f"budget must be a number of steps (all runs together) of at least the number of runs "
                f"({len(points)}); got {budget!r}"
            )
        if not isinstance(metric, str) or not metric:
            raise UsageError(
                f"metric must be the name of a history column, e.g. 'reward_mean'; got {metric!r}"
            )
        if mode not in ("max", "min"):
            raise UsageError(f"mode must be 'max' (higher metric is better) or 'min'; got {mode!r}")
        if reward is None and "reward" not in grid and options.get("env") is None:
            raise UsageError(
                "reward is missing: give reward=... (or a 'reward' list in the grid), or env=..."
            )
        if reward is not None and "reward" in grid:
            raise UsageError("give reward=... or a 'reward' list in the grid, not both")
        for key in ("name", "model_name"):
            if key in options:
                raise UsageError(f"{key} is not a per-run option of a sweep; the sweep names its runs")
        clash = sorted(set(options) & set(grid))
        if clash:
            raise UsageError(f"{', '.join(clash)} is both in the grid and given as an option; give it once")
        if name is not None and (not isinstance(name, str) or not _NAME_RE.match(name)):
            raise UsageError(
                "name must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit "
                f"(it names the runs and the best checkpoint); got {name!r}"
            )
        self.session = session
        self.name = name or f"sweep-{uuid.uuid4().hex[:6]}"
        self.points = points
        self.steps = steps
        self.budget = budget
        self.keep = float(keep)
        self.metric = metric
        self.mode = mode
        self.rungs = plan_rungs(rungs, steps, len(points), self.keep)
        self._reward = reward
        self._prompts = prompts
        self._options = options
        self._save_best = save_best
        self.runs: list[Run] = []
        self.params: dict[str, dict[str, Any]] = {}  # run name -> its grid point
        self.stopped_at_rung: dict[str, int] = {}  # run name -> the rung (1-based) that dropped it
        self.rung_log: list[dict] = []  # one entry per rung decided: step, ranking, kept, dropped
        self.checkpoint: str | None = None
        self.save_error: str | None = None
        self.started_at = time.time()
        self.finished_at: float | None = None
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._held: set[str] = set()
        self._next_rung = 0
        self._budget_spent = False
        self._stopping = False
        self._unsubscribe: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._watchers: list[Callable[[], None]] = []
        self._dashboard = None

    # -- starting -------------------------------------------------------------------------------
    def start(self) -> Sweep:
        """Start every run (each ``train`` returns at once, so they all step concurrently)."""
        try:
            for point in self.points:
                opts = dict(self._options)
                opts.update(point)
                reward = opts.pop("reward", self._reward)
                run_name = f"{self.name}-{point_label(point)}"
                labels = {**(opts.pop("user_metadata", None) or {}), "openrl.sweep": self.name}
                run = self.session.train(
                    reward=reward,
                    prompts=self._prompts,
                    steps=self.steps,
                    name=run_name,
                    user_metadata=labels,  # the lab panel groups a sweep's runs by this
                    **opts,
                )
                with self._lock:
                    self.runs.append(run)
                    self.params[run.name] = dict(point)
                self._unsubscribe.append(run.subscribe(self._listener(run)))
        except BaseException:
            for run in self.runs:
                run.stop()
            raise
        self._thread = threading.Thread(target=self._monitor, name=f"openrl-{self.name}", daemon=True)
        self._thread.start()
        return self

    def _listener(self, run: Run) -> Callable[[dict], None]:
        def on_event(event: dict) -> None:
            if event.get("kind") == "step":
                # on the runner thread, before the run's next step begins: hold it here at a rung
                with self._lock:
                    rung = self._current_rung()
                    if rung is not None and run.step >= rung and run.name not in self.stopped_at_rung:
                        self._held.add(run.name)
                        run.pause()
                    self._check_budget()
            self._wake.set()

        return on_event

    # -- what a cell reads ----------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def best(self) -> Run | None:
        """The run with the best score (:meth:`score_of`) of those that neither failed
        (``RunState.FAILED``: the service lost it, so it has no weights to save) nor were dropped at
        a rung; None when no such run has scored."""
        from openrl_jupyter.run import RunState

        scored = [r for r in self._live() if r.state != RunState.FAILED and self.score(r) is not None]
        ranked = self._rank(scored, None)
        return ranked[0] if ranked else None

    def score_of(self, run: Run, upto: int | None = None, since: int | None = None) -> Score:
        """The run's score and the steps it averages: the mean ``metric`` of its history rows with
        since < step <= upto. By default (what every display and ``best`` use) the window is the
        steps after the last rung decided, or, for a run dropped at rung k, rung k-1 to rung k (the
        window it was ranked on). A window with no rows (the run ended right at a rung) falls back
        to all of the run's rows up to ``upto``."""
        if since is None and upto is None and run.name in self.stopped_at_rung:
            since, upto = self._rung_window(self.stopped_at_rung[run.name])
        since = self._last_rung() if since is None else since
        score = window_mean(run.history, self.metric, since, upto)
        if score.value is None and since > 0:
            score = window_mean(run.history, self.metric, 0, upto)
        return score

    def score(self, run: Run, upto: int | None = None, since: int | None = None) -> float | None:
        """The run's score (see :meth:`score_of`); None when it has no rows with the metric."""
        return self.score_of(run, upto, since).value

    def score_rule(self) -> str:
        """How the runs are ranked now, in words: "score = mean reward_mean (higher is better) over
        each run's steps since rung 2 (step 20); ..."."""
        better = "higher" if self.mode == "max" else "lower"
        head = f"score = mean {self.metric} ({better} is better) over "
        decided = self._next_rung
        if not self.rungs:
            return head + "each run's steps (no rungs)"
        if decided == 0:
            return (
                head + f"each run's steps so far (no rung decided yet; rungs at steps {_steps(self.rungs)})"
            )
        return head + (
            f"each run's steps since rung {decided} (step {self.rungs[decided - 1]}); "
            "a dropped run is compared with the best over the steps it was ranked on"
        )

    def wait(self, timeout: float | None = None) -> Sweep:
        """Block until every run is done and the best is saved; TimeoutError after ``timeout`` s."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"sweep {self.name!r} is not done after {timeout} s; it goes on")
        return self

    def stop(self, *, wait: bool = False, timeout: float | None = None) -> Sweep:
        """Stop every live run after its current step."""
        with self._lock:
            self._stopping = True
            for run in self.runs:
                if not run.done:
                    run.stop_reason = run.stop_reason or "stopped with the sweep (sweep.stop())"
                    run.stop()
        self._wake.set()
        if wait:
            self.wait(timeout)
        return self

    def on_change(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` after each rung is decided and when the sweep is done; returns the
        function that unsubscribes."""
        with self._lock:
            self._watchers.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._watchers:
                    self._watchers.remove(fn)

        return unsubscribe

    def _notify(self) -> None:
        from openrl_jupyter.runner import notify

        with self._lock:
            watchers = list(self._watchers)
        notify([lambda _e, f=f: f() for f in watchers], {})

    def dashboard(self, **options: Any):
        """The live comparison dashboard (one line per run; dropped runs grey, the best highlighted;
        the results table); needs ipywidgets and plotly."""
        from openrl_jupyter.sweep_dashboard import SweepDashboard

        if self._dashboard is None or options:
            if self._dashboard is not None:
                self._dashboard.close()
            self._dashboard = SweepDashboard(self, **options)
        return self._dashboard

    def to_pandas(self):
        """One row per run, indexed by run name: its grid parameters; for a run still in the sweep
        ``score`` (what ranks the runs, see :meth:`score_of`) and ``score_steps`` (the steps it
        averages, "21-40"); for a run dropped at a rung ``stopped_at_rung`` (<NA> for a survivor),
        ``rung_score`` (its score over the steps it was ranked on there, ``rung_steps``) and
        ``best_rung_score`` (``sweep.best``'s score over those same steps) — never in ``score``, whose
        survivors are scored over later steps; ``final_<metric>`` (the last step's value) and
        ``max_<metric>`` (``min_`` when mode="min": the best single step) for reference, neither of
        which ranks anything; ``steps`` done, ``state`` and ``best`` (True for ``sweep.best``).
        ``frame.attrs["score"]`` is :meth:`score_rule`."""
        try:
            import pandas as pd
        except ImportError:
            raise UsageError("to_pandas() needs pandas: pip install pandas") from None
        frame = pd.DataFrame(self.rows()).set_index("run")
        frame["stopped_at_rung"] = frame["stopped_at_rung"].astype("Int64")  # 1, 2... or <NA>
        frame.attrs["score"] = self.score_rule()
        return frame

    def rows(self) -> list[dict]:
        """The rows of ``to_pandas()`` as dicts (with the run's name under ``run``)."""
        best = self.best
        pick, peak = (max, "max") if self.mode == "max" else (min, "min")
        out = []
        for run in self.runs:
            values = [r[self.metric] for r in run.history if isinstance(r.get(self.metric), (int, float))]
            rung = self.stopped_at_rung.get(run.name)
            score = self.score_of(run)
            row = {"run": run.name}
            row.update({k: reward_label(v) if k == "reward" else v for k, v in self.params[run.name].items()})
            row.update(
                {
                    "score": None if rung else score.value,
                    "score_steps": "" if rung else score.steps,
                    f"final_{self.metric}": values[-1] if values else None,
                    f"{peak}_{self.metric}": pick(values) if values else None,
                    "steps": run.step,
                    "state": str(run.state),
                    "stopped_at_rung": rung,
                    "rung_score": score.value if rung else None,
                    "rung_steps": score.steps if rung else "",
                    # the best run over the very steps this one was ranked on: the fair comparison
                    "best_rung_score": self._best_over(best, rung) if rung and best is not None else None,
                    "best": best is run,
                }
            )
            out.append(row)
        return out

    def _best_over(self, best: Run, k: int) -> float | None:
        since, upto = self._rung_window(k)
        return self.score(best, upto, since)

    def _rung_window(self, k: int) -> tuple[int, int]:
        """(since, upto): the steps rung ``k`` (1-based) ranked the runs on."""
        return (self.rungs[k - 2] if k > 1 else 0), self.rungs[k - 1]

    # -- halving --------------------------------------------------------------------------------
    def _current_rung(self) -> int | None:
        return self.rungs[self._next_rung] if self._next_rung < len(self.rungs) else None

    def _last_rung(self) -> int:
        return self.rungs[self._next_rung - 1] if self._next_rung > 0 else 0

    def _rank(self, runs: list[Run], upto: int | None, since: int | None = None) -> list[Run]:
        """Best score first; runs with no rows last (a failed run never wins over one that stepped)."""
        scored = [(self.score(r, upto, since), i, r) for i, r in enumerate(runs)]
        sign = -1 if self.mode == "max" else 1
        scored.sort(key=lambda t: (t[0] is None, sign * t[0] if t[0] is not None else 0.0, t[1]))
        return [r for s, _, r in scored if s is not None] + [r for s, _, r in scored if s is None]

    def _live(self) -> list[Run]:
        return [r for r in self.runs if r.name not in self.stopped_at_rung]

    def _at_rung(self, run: Run, rung: int) -> bool:
        """Whether ``run`` no longer holds the rung up: it reached it, is done, or is paused on its own."""
        from openrl_jupyter.run import RunState

        if run.step >= rung or run.done:
            return True
        return run.state == RunState.PAUSED and run.name not in self._held

    def _decide(self) -> bool:
        """Decide the current rung if every live run reached it; True when one was decided."""
        from openrl_jupyter.run import RunState

        with self._lock:
            rung = self._current_rung()
            if rung is None or self._stopping:
                return False
            live = self._live()
            if not all(self._at_rung(r, rung) for r in live):
                return False
            k = self._next_rung + 1
            since = self._last_rung()
            ranked = self._rank([r for r in live if r.state != RunState.FAILED], rung, since)
            ranked += [r for r in live if r.state == RunState.FAILED]
            n_keep = survivors(len(ranked), self.keep)
            kept, dropped = ranked[:n_keep], ranked[n_keep:]
            cut = self.score(kept[-1], rung, since) if kept else None
            for run in dropped:
                self.stopped_at_rung[run.name] = k
                own = self.score_of(run, rung, since)
                over = f" over {_steps_words(own.steps)}" if own.steps else ""
                run.stop_reason = (
                    f"stopped by the sweep at rung {k} (step {rung}): score (mean {self.metric}{over}) "
                    f"{_fmt(own.value)} vs {_fmt(cut)} for the last of the {n_keep} kept"
                )
                run.stop()
            self.rung_log.append(
                {
                    "rung": k,
                    "step": rung,
                    "ranking": [(r.name, self.score(r, rung, since)) for r in ranked],
                    "kept": [r.name for r in kept],
                    "dropped": [r.name for r in dropped],
                }
            )
            self._next_rung += 1
            nxt = self._current_rung()
            release = []
            for run in kept:
                if run.name in self._held:
                    if nxt is not None and run.step >= nxt and not run.done:
                        continue  # already at the next rung too: it stays held
                    self._held.discard(run.name)
                    release.append(run)
        for run in release:
            with contextlib.suppress(UsageError):  # it ended meanwhile (e.g. stopped from the panel)
                run.resume()
        return True

    def _check_budget(self) -> None:
        if self.budget is None or self._budget_spent:
            return
        total = sum(r.step for r in self.runs)
        if total >= self.budget:
            self._budget_spent = True
            for run in self.runs:
                if not run.done:
                    run.stop_reason = f"stopped by the sweep: its budget of {self.budget} steps is spent"
                    run.stop()

    def _monitor(self) -> None:
        try:
            while True:
                self._wake.wait(POLL_S)
                self._wake.clear()
                decided = False
                while self._decide():
                    decided = True
                if decided:
                    self._notify()
                with self._lock:
                    if self._stopping or self._budget_spent or self._current_rung() is None:
                        # nothing left to decide: nobody should stay held
                        for run in self.runs:
                            if run.name in self._held:
                                self._held.discard(run.name)
                                if not self._stopping and not self._budget_spent:
                                    with contextlib.suppress(UsageError):
                                        run.resume()
                if all(r.done for r in self.runs):
                    break
            for unsubscribe in self._unsubscribe:
                with contextlib.suppress(Exception):
                    unsubscribe()
            best = self.best
            if self._save_best and best is not None and best.run_id is not None:
                try:
                    self.checkpoint = best.save(f"{self.name}-best", overwrite=True)
                except (OpenRLError, TimeoutError) as exc:
                    self.save_error = f"{type(exc).__name__}: {exc}"
        finally:
            self.finished_at = time.time()
            self._done.set()
            self._notify()

    # -- display --------------------------------------------------------------------------------
    def __repr__(self) -> str:
        rows = self.rows()
        state = "done" if self.done else "running"
        lines = [
            f"<openrl Sweep {self.name!r} {state}: {len(self.runs)} runs, {self.steps} steps, "
            f"rungs at {self.rungs or 'none'}, keep {self.keep:g}>",
            f"  ranked by {self.score_rule()}",
        ]
        for r in rows:
            mark = "*" if r["best"] else " "
            head = f" {mark} {r['run']:<40} {r['state']:<9} step {r['steps']:>4}  "
            lines.append((head + _score_words(r)).rstrip())
        if self.checkpoint:
            lines.append(f"best saved: {self.checkpoint}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = self.rows()
        keys = list(self.points[0]) if self.points else []
        head = "".join(
            f"<th>{html.escape(h)}</th>"
            for h in ["run", *keys, "state", "steps", "score", "score steps", "dropped at"]
        )
        body = []
        for r in rows:
            style = (
                ' style="font-weight:bold;background:#e6f4ea"'
                if r["best"]
                else (' style="color:#999"' if r["stopped_at_rung"] else "")
            )
            cells = [r["run"], *(r[k] for k in keys), r["state"], r["steps"]]
            cells += [_fmt(r["score"]), r["score_steps"]] if not r["stopped_at_rung"] else ["", ""]
            cells.append(_score_words(r) if r["stopped_at_rung"] else "")
            body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
        title = html.escape(
            f"sweep {self.name}: {len(self.runs)} runs, rungs at {self.rungs or 'none'}"
            f"{' — done' if self.done else ''}"
        )
        rule = f"<div>ranked by {html.escape(self.score_rule())}</div>"
        saved = (
            f"<div>best saved: <code>{html.escape(self.checkpoint)}</code></div>" if self.checkpoint else ""
        )
        return f"<div><b>{title}</b>{rule}<table><tr>{head}</tr>{''.join(body)}</table>{saved}</div>"


def _score_words(row: dict) -> str:
    """A row's score as the tables write it: a survivor's "score 0.85 (steps 3-4)"; a dropped run's
    "dropped at rung 1: score 0.05 vs 0.82 for the best (step 1)", both over the same steps."""
    over = row["rung_steps"] if row["stopped_at_rung"] else row["score_steps"]
    steps = f" ({_steps_words(over)})" if over else ""
    if not row["stopped_at_rung"]:
        return f"score {_fmt(row['score'])}{steps}"
    return (
        f"dropped at rung {row['stopped_at_rung']}: score {_fmt(row['rung_score'])} vs "
        f"{_fmt(row['best_rung_score'])} for the best{steps}"
    )


def _fmt(v: Any) -> str:
    return "—" if v is None else f"{v:.4g}"


def _steps(at: Sequence[int]) -> str:
    return ", ".join(str(s) for s in at)


def _steps_words(steps: str) -> str:
    """A ``score_steps`` in words: "3-4" is "steps 3-4", "7" is "step 7"."""
    return f"steps {steps}" if "-" in steps else f"step {steps}"
