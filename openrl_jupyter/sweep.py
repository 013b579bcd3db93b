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
rows up to the window's end. The repr, ``_repr_html_`` (and the dashboard's table), ``to_pandas()``'s
``score`` and ``score_steps`` columns and ``sweep.best`` all show this same number, and say which
steps it averages; ``sweep.score_rule()`` says it in words.

Successive halving: at each rung (a step number) a run that reaches it is held (paused between steps)
until every live run has reached it, so they are compared at the same step; they are ranked by their
score over the steps since the previous rung, the better ``keep`` share (rounded up, at least one)
resumes and the others are stopped, with ``stop_reason`` "stopped by the sweep at rung k (…)". A run
that pauses on an error, or that the user pauses, does not hold the others up: it is ranked on the
rows it has. ``budget`` caps the steps of all runs together: once spent, every live run is stopped.
When every run is done, the surviving run with the best score that did not fail is ``sweep.best`` and
its weights are saved as the checkpoint ``<sweep>-best`` (``sweep.checkpoint``, a ``tinker://`` path).

Grid keys are ``train`` options: lr, rank, loss, group, batch, max_tokens, temperature, seed,
normalize_std, overlap, kl_coef, loss_agg, lr_schedule, epochs, minibatches, warmup_steps, top_p,
top_k, and reward (a list of reward names or functions, to compare rewards). Every other ``train``
option (eval_every, save_every, stop...) applies to every run alike.
This module imports without torch, pandas or widgets.
"""

from __future__ import annotations

import contextlib
import html
import itertools
import math
import numbers
import re
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from openrl_jupyter._exceptions import OpenRLError, UsageError

if TYPE_CHECKING:
    from openrl_jupyter.run import Run

GRID_KEYS = (
    "lr",
    "rank",
    "loss",
    "group",
    "batch",
    "max_tokens",
    "temperature",
    "seed",
    "normalize_std",
    "overlap",
    "reward",
    "kl_coef",
    "loss_agg",
    "lr_schedule",
    "epochs",
    "minibatches",
    "warmup_steps",
    "top_p",
    "top_k",
)
MAX_POINTS = 64  # runs one sweep may start (the service's per-tenant run quota is the real limit)
POLL_S = 0.2
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # + "-best": a checkpoint name
_SHORT = {
    "lr": "lr",
    "rank": "r",
    "group": "g",
    "batch": "b",
    "max_tokens": "t",
    "temperature": "temp",
    "seed": "s",
    "kl_coef": "kl",
    "epochs": "ep",
    "minibatches": "mb",
    "warmup_steps": "wu",
    "top_p": "p",
    "top_k": "k",
}
_LOSS_SHORT = {"importance_sampling": "is", "ppo": "ppo"}


def _num(v: Any) -> str:
    """A compact number for a run name: 1e-4, 3e-5, 0.5, 8 (numpy numbers as their Python twins)."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        v = int(v)
    elif isinstance(v, numbers.Real) and not isinstance(v, bool):
        v = float(v)
    if isinstance(v, float) and v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e4):
        mantissa, exp = f"{v:e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exp)}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _reward_label(v: Any) -> str:
    if callable(v):
        name = getattr(v, "__name__", "") or "reward"
        return "lambda" if name == "<lambda>" else name
    return str(v)


def point_label(point: Mapping[str, Any]) -> str:
    """The suffix of a grid point's run name: ``lr1e-4-r8-ppo``."""
    parts = []
    for key, v in point.items():
        if key == "loss":
            parts.append(_LOSS_SHORT.get(v, str(v)))
        elif key == "reward":
            parts.append(_reward_label(v))
        elif key == "normalize_std":
            parts.append("std" if v else "nostd")
        elif key == "overlap":
            parts.append(f"ov{int(v)}")
        elif key in ("loss_agg", "lr_schedule"):
            parts.append(str(v))
        else:
            parts.append(f"{_SHORT[key]}{_num(v)}")
    return re.sub(r"[^A-Za-z0-9._-]", "_", "-".join(parts))


def expand_grid(grid: Any) -> list[dict[str, Any]]:
    """Every combination of the grid's values (in the grid's order), after checking it."""
    if not isinstance(grid, Mapping) or not grid:
        raise UsageError(
            f"grid must be a non-empty dict of train options to lists of values "
            f"(keys: {', '.join(GRID_KEYS)}); got {grid!r}"
        )
    columns: dict[str, list] = {}
    for key, values in grid.items():
        if key not in GRID_KEYS:
            raise UsageError(
                f"grid key {key!r} is not a train option a sweep can vary; use one of {', '.join(GRID_KEYS)}"
            )
        if getattr(values, "ndim", None) == 1 and callable(getattr(values, "tolist", None)):
            values = list(values)  # a 1-D numpy array: its elements (numpy scalars; checked per run)
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise UsageError(
                f"grid[{key!r}] must be a list of values; got {type(values).__name__} {values!r}"
            )
        if not values:
            raise UsageError(f"grid[{key!r}] is empty: give at least one value")
        labels = [_reward_label(v) if key == "reward" else repr(v) for v in values]
        if len(set(labels)) != len(labels):
            raise UsageError(f"grid[{key!r}] repeats a value: {list(values)!r}")
        columns[key] = list(values)
    n = math.prod(len(v) for v in columns.values())
    if n > MAX_POINTS:
        raise UsageError(f"the grid has {n} points; a sweep starts at most {MAX_POINTS} runs")
    keys = list(columns)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*columns.values())]


def survivors(n: int, keep: float) -> int:
    """How many of ``n`` ranked runs a rung keeps: the better ``keep`` share, rounded up, at least 1."""
    return max(1, math.ceil(n * keep - 1e-9))


def plan_rungs(rungs: Any, steps: int, n: int, keep: float) -> list[int]:
    """The step numbers of the rungs. ``rungs``: a list of steps, a count, or None (as many as halve
    ``n`` runs to one). A count of k puts them at steps/2^k, ..., steps/4, steps/2."""
    if rungs is None:
        count, left = 0, n
        while left > 1:
            left = survivors(left, keep)
            count += 1
        rungs = count
    if isinstance(rungs, bool):
        raise UsageError(f"rungs must be a count or a list of step numbers; got {rungs!r}")
    if isinstance(rungs, int):
        if not 0 <= rungs <= 16:
            raise UsageError(f"rungs must be a count from 0 to 16 (or a list of steps); got {rungs}")
        at = sorted({max(1, round(steps / 2 ** (rungs - i))) for i in range(rungs)})
        return [s for s in at if s < steps]
    if isinstance(rungs, (str, bytes)) or not isinstance(rungs, Sequence):
        raise UsageError(f"rungs must be a count or a list of step numbers; got {rungs!r}")
    at = list(rungs)
    for s in at:
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s < steps:
            raise UsageError(f"rungs must be steps from 1 to steps-1 ({steps - 1}); got {s!r}")
    if at != sorted(set(at)):
        raise UsageError(f"rungs must be increasing step numbers; got {at!r}")
    return at


class Score(NamedTuple):
    """A run's score: the mean of the sweep's metric over its rows from step ``first`` to ``last``."""

    value: float | None  # None: no row in the window has the metric
    first: int | None  # the first and last step averaged (None with value)
    last: int | None

    @property
    def steps(self) -> str:
        """The steps averaged, as the repr and ``to_pandas()['score_steps']`` write them: "21-40", "7"."""
        if self.first is None:
            return ""
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


def window_mean(history: Sequence[Mapping[str, Any]], metric: str, since: int, upto: int | None) -> Score:
    """The mean of ``metric`` over the history rows with ``since < step <= upto`` (None: no end), and
    the steps it covers: the one place a sweep's score is computed."""
    end = math.inf if upto is None else upto
    rows = [
        r
        for r in history
        if since < r["step"] <= end
        and isinstance(r.get(metric), (int, float))
        and not isinstance(r.get(metric), bool)
    ]
    if not rows:
        return Score(None, None, None)
    return Score(statistics.fmean(r[metric] for r in rows), rows[0]["step"], rows[-1]["step"])


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
            k = self.stopped_at_rung[run.name]
            since, upto = (self.rungs[k - 2] if k > 1 else 0), self.rungs[k - 1]
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
            "a run dropped at a rung keeps the score it was ranked on there"
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
        """One row per run, indexed by run name: its grid parameters; ``score`` (what ranks the
        runs, see :meth:`score_of`) and ``score_steps`` (the steps it averages, "21-40");
        ``final_<metric>`` (the last step's value) and ``max_<metric>`` (``min_`` when mode="min":
        the best single step) for reference, neither of which ranks anything; ``steps`` done,
        ``state``, ``stopped_at_rung`` (<NA> for a survivor) and ``best`` (True for ``sweep.best``).
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
            score = self.score_of(run)
            row = {"run": run.name}
            row.update(
                {k: _reward_label(v) if k == "reward" else v for k, v in self.params[run.name].items()}
            )
            row.update(
                {
                    "score": score.value,
                    "score_steps": score.steps,
                    f"final_{self.metric}": values[-1] if values else None,
                    f"{peak}_{self.metric}": pick(values) if values else None,
                    "steps": run.step,
                    "state": str(run.state),
                    "stopped_at_rung": self.stopped_at_rung.get(run.name),
                    "best": best is run,
                }
            )
            out.append(row)
        return out

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
            rung = f"dropped at rung {r['stopped_at_rung']}" if r["stopped_at_rung"] else ""
            over = f" ({_steps_words(r['score_steps'])})" if r["score_steps"] else ""
            lines.append(
                f" {mark} {r['run']:<40} {r['state']:<9} step {r['steps']:>4}  "
                f"score {_fmt(r['score'])}{over}  {rung}".rstrip()
            )
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
            cells = [
                r["run"],
                *(r[k] for k in keys),
                r["state"],
                r["steps"],
                _fmt(r["score"]),
                r["score_steps"],
            ]
            cells.append(f"rung {r['stopped_at_rung']}" if r["stopped_at_rung"] else "")
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


def _fmt(v: Any) -> str:
    return "—" if v is None else f"{v:.4g}"


def _steps(at: Sequence[int]) -> str:
    return ", ".join(str(s) for s in at)


def _steps_words(steps: str) -> str:
    """A ``score_steps`` in words: "3-4" is "steps 3-4", "7" is "step 7"."""
    return f"steps {steps}" if "-" in steps else f"step {steps}"
