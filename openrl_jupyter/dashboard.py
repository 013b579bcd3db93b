"""Live dashboards in a notebook: one run (``RunDashboard``) or every run of the service (``ServiceDashboard``).

    dash = RunDashboard(run)        # what ``run.dashboard()`` returns and ending a cell with ``run`` shows
    dash                            # header, progress, one plotly figure, samples, log, pause/resume/stop

Design. Events arrive on the runner thread, often many per second, while a browser pays for every
comm message: re-assigning one plotly trace costs 4 messages carrying the whole array, and plotly's
``FigureWidget`` opens with the 5 MB plotly.js bundle in its state (jupyter-notes §2.3), which a
notebook saved with widget state keeps. So:

* ``handle(event)`` never touches a widget. It appends the event to a buffer under a lock and, when
  no flush is pending, schedules one with ``call_later`` at ``last_flush + interval_s`` (or now, if
  that has passed): a trailing-edge throttle. Whatever arrives in between rides along, so the
  browser sees at most one update per ``interval_s`` and the last update always carries the last
  event. Building the dashboard counts as a flush, so a burst right after it waits one interval.
* ``flush()`` folds the buffered events into a Python-side history (full resolution, deduplicated
  by step, and it stays there), then redraws inside ``fig.batch_update()`` and every small widget's
  ``hold_sync()``: one batch of messages per flush, and none for traces whose data did not change.
* Each trace gets at most ``max_points`` (500) points: ``downsample`` (series.py) keeps the recent half
  at full resolution and each older bucket's minimum and maximum, so spikes and the first point
  survive; values go at 4 significant digits.
* One figure per dashboard (``make_subplots``), never one per metric: ``figure_widget.FigureWidget``,
  plotly's widget with its bundle sent as a message, so widget state stays small (kilobytes).
* ``_repr_mimebundle_`` adds ``text/plain`` and ``text/html`` summaries next to the widget view,
  so nbconvert, a saved notebook or a frontend without widgets still shows the run. Shown with a
  display id, that output is rewritten when the run settles (paused, finished, stopped, failed): the
  final summary and a static SVG of its curves (``series.svg_panels``), which the figure also draws
  when a saved notebook is opened without its kernel.

Utilisation comes from the service's telemetry ticks and is plotted under the tick's own label:
NVML GPU utilisation where the service has a GPU, else "engine busy" (the engine's busy time, not a
device counter); the dashboard does not pretend otherwise. Both dashboards share the throttle, the trace bookkeeping and
the utilisation panel through ``_LiveDashboard``.
"""

from __future__ import annotations

import base64
import html
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from openrl_jupyter.figure_widget import FigureWidget
from openrl_jupyter.live import MAX_POINTS, CallLater, _LiveDashboard
from openrl_jupyter.series import Rows, downsample, svg_panels
from openrl_jupyter.summary import STATE_COLOURS, clip, fmt, plural, summary_pair

__all__ = ["RunDashboard", "ServiceDashboard", "downsample"]

LOG_LINES = 200
SNAPSHOT_S = 10.0  # the static picture of a running run's curves is redrawn at most this often
SETTLED = ("paused", "finished", "stopped", "failed")
SAMPLE_ROWS = 8
ACTIVE_STATES = ("starting", "running", "pausing", "paused")
BAR_STYLES = {"finished": "success", "failed": "danger", "paused": "warning", "stopped": "warning"}


def _error_html(error: str) -> str:
    """A run's error in the header: its first line, and the rest (a traceback) folded under it."""
    first, _, rest = error.strip().partition("\n")
    head = f"<span style='color:#cf222e'>error: {html.escape(clip(first, 300))}</span>"
    if not rest.strip():
        return head
    return (
        f"<details style='display:inline'><summary>{head}</summary>"
        f"<pre style='margin:0;font-size:85%'>{html.escape(rest)}</pre></details>"
    )


class RunDashboard(_LiveDashboard):
    """The live view of one run: header, progress, metrics figure, latest samples, log, buttons.

        dash = RunDashboard(run)      # subscribes to the run and draws its history so far
        dash                          # display it (ending a cell with ``run`` does the same)
        dash.close()                  # stop listening

    Rows of the figure: reward mean with its min–max band and a marker where the reward version
    changed; loss; mean importance ratio and KL estimate; utilisation stacked by run over time.
    """

    utilisation_row = 4
    digits = 4

    def __init__(
        self,
        run: Any,
        *,
        interval_s: float = 0.5,
        max_points: int = MAX_POINTS,
        clock: Callable[[], float] = time.monotonic,
        call_later: CallLater | None = None,
    ) -> None:
        super().__init__(interval_s=interval_s, max_points=max_points, clock=clock, call_later=call_later)
        self.run = run
        self._rows = Rows()
        self._state = str(run.state)
        self._error: str | None = run.last_error
        self._failure: Any = getattr(run, "reward_failure", None)  # a RewardFailure (rewards.py)
        self._action_error: str | None = None
        self._step = int(run.step or 0)
        self._logs: deque[str] = deque(maxlen=LOG_LINES)
        self._samples_step: int | None = None
        self._samples: list[dict] = []
        self._rows_dirty = True
        self._markers: list[tuple[int, str]] | None = None
        self._snapshot_key: Any = None
        self._snapshot_at = -math.inf

        self.header = widgets.HTML()
        self.failure_box = widgets.HTML()  # the reward's last failure: error, version, a sample
        self.progress = widgets.IntProgress(min=0, max=max(1, int(run.total_steps or 1)), value=0)
        self.fig = self._make_figure()
        self.samples = widgets.HTML()
        self.log = widgets.HTML()
        self.pause_button = widgets.Button(description="pause", icon="pause", tooltip="run.pause()")
        self.resume_button = widgets.Button(description="resume", icon="play", tooltip="run.resume()")
        self.stop_button = widgets.Button(
            description="stop", icon="stop", button_style="danger", tooltip="run.stop()"
        )
        self.pause_button.on_click(lambda _: self._act(run.pause))
        self.resume_button.on_click(lambda _: self._act(run.resume))
        self.stop_button.on_click(lambda _: self._act(run.stop))
        buttons = widgets.HBox([self.pause_button, self.resume_button, self.stop_button])
        self._small = [
            self.header,
            self.failure_box,
            self.progress,
            self.samples,
            self.log,
            self.pause_button,
            self.resume_button,
            self.stop_button,
        ]
        self.widget = widgets.VBox(
            [self.header, self.failure_box, self.progress, buttons, self.fig, self.samples, self.log]
        )
        self._small.append(buttons)

        with self._render_lock:
            # subscribe first, then read the run: what happened while the widgets were being built
            # (a reward that failed at step 1, the pause) is in what is read, not lost between them
            self._unsubscribe = run.subscribe(self.handle)
            self._state, self._error = str(run.state), run.last_error
            self._failure = getattr(run, "reward_failure", None)
            with self._lock:  # events queued before that read are in it: a stale state must not win
                self._pending = [e for e in self._pending if e.get("kind") not in ("state", "reward_error")]
            for row in run.history:
                self._add_row(row)
            self._redraw()

    def _make_figure(self) -> go.FigureWidget:
        fig = self.fig = make_subplots(
            rows=4,
            cols=1,
            specs=[[{}], [{}], [{"secondary_y": True}], [{}]],
            subplot_titles=("reward mean (min–max band)", "loss", "importance ratio and KL", "utilisation"),
            vertical_spacing=0.09,
        )
        fig.update_layout(height=900, margin={"l": 60, "r": 20, "t": 40, "b": 40}, uirevision="run")
        fig.update_xaxes(matches="x", row=2, col=1)
        fig.update_xaxes(matches="x", row=3, col=1)
        fig.update_xaxes(title_text="step", row=3, col=1)
        fig.update_yaxes(title_text="ratio", row=3, col=1)
        fig.update_yaxes(title_text="KL", row=3, col=1, secondary_y=True)
        fig.update_yaxes(tickformat=".0%", range=[0, 1], row=4, col=1)
        band = {"mode": "lines", "line": {"width": 0}, "showlegend": False, "hoverinfo": "skip"}
        self._trace("reward_max", 1, name="reward max", legendgroup="reward", **band)
        self._trace(
            "reward_min",
            1,
            name="reward min",
            legendgroup="reward",
            fill="tonexty",
            fillcolor="rgba(99,110,250,0.2)",
            **band,
        )
        self._trace(
            "reward_mean",
            1,
            name="reward mean",
            legendgroup="reward",
            mode="lines+markers",
            marker={"size": 4},
            line={"color": "rgb(99,110,250)"},
        )
        self._trace("loss", 2, name="loss", mode="lines", connectgaps=True)
        self._trace("ratio_mean", 3, name="ratio mean", mode="lines", connectgaps=True)
        self._trace("kl", 3, secondary_y=True, name="KL", mode="lines", connectgaps=True)
        # kl_coef > 0: KL to the run's starting weights; eval_every: the held-out score
        self._trace("kl_ref", 3, secondary_y=True, name="KL to reference", mode="lines", connectgaps=True)
        self._trace(
            "eval_reward", 1, name="eval reward", mode="markers", marker={"size": 8, "symbol": "diamond"}
        )
        return FigureWidget(fig)

    def _act(self, action: Callable[[], Any]) -> None:
        try:
            action()
        except Exception as exc:
            self.handle({"kind": "action_error", "error": f"{type(exc).__name__}: {exc}"})
        else:
            self.handle({"kind": "action_error", "error": None})

    def _add_row(self, row: dict) -> None:
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        self._rows.put(step, row)
        self._step = max(self._step, step)
        self._rows_dirty = True

    def _apply(self, event: dict) -> None:
        kind = event.get("kind")
        if kind == "step":
            row = event.get("row") or {}
            self._add_row(row)
            if row.get("failed") == 0:
                self._failure = None  # a clean step: the box goes, the log keeps what happened
        elif kind == "reward_error":
            self._failure = event.get("failure")
        elif kind == "state":
            self._state = str(event.get("state"))
            if event.get("error") is not None:
                self._error = str(event["error"])
            elif self._state == "running":
                self._error = None  # resumed: the error it paused on is in the log
        elif kind == "log":
            step = event.get("step")
            for line in str(event.get("text", "")).splitlines() or [""]:
                self._logs.append(f"[{step}] {line}" if step is not None else line)
        elif kind == "samples":
            self._samples_step = event.get("step")
            self._samples = list(event.get("samples") or [])[-SAMPLE_ROWS:]
        elif kind == "tick":
            self._util_dirty |= self._util.add(event.get("tick") or {})
        elif kind == "action_error":
            self._action_error = event.get("error")

    def _run_label(self, run_id: str) -> str:
        return str(self.run.name) if run_id == self.run.run_id else run_id

    def _reward(self) -> tuple[Any, Any]:
        last = self._rows.last()
        name = last.get("reward_name") or self.run.reward_name
        version = last.get("reward_version") if "reward_version" in last else self.run.reward_version
        return name, version

    def _draw(self) -> None:
        total = int(self.run.total_steps or 0)
        name, version = self._reward()
        colour = STATE_COLOURS.get(self._state, "#57606a")
        run_id = f" <code>{html.escape(str(self.run.run_id))}</code>" if self.run.run_id else ""
        reward = html.escape(f"{name}" + (f" v{version}" if version is not None else ""))
        lines = [
            f"<b>{html.escape(str(self.run.name))}</b>{run_id} · {html.escape(str(self.run.model))}"
            f" · step {self._step}/{total} · <span style='color:{colour}'>{html.escape(self._state)}</span>"
            f" · reward {reward} · mean {html.escape(fmt(self._rows.last().get('reward_mean')))}"
        ]
        last = self._rows.last()
        if last.get("turns") is not None:  # an environment run: its episodes' shape
            lines.append(
                f"episodes: {fmt(last.get('turns'))} turns · {fmt(last.get('tool_calls'))} tool calls · "
                f"{fmt(last.get('tool_errors'))} malformed calls (means per episode)"
            )
        if self._error:
            lines.append(_error_html(self._error))
        if self._action_error:
            lines.append(f"<span style='color:#9a6700'>{html.escape(self._action_error)}</span>")
        self.header.value = "<div>" + "<br>".join(lines) + "</div>"
        self.failure_box.value = self._failure.html() if self._failure is not None else ""
        self.progress.max = max(1, total)
        self.progress.value = min(self._step, self.progress.max)
        self.progress.bar_style = BAR_STYLES.get(self._state, "")
        active = self._state in ACTIVE_STATES
        self.pause_button.disabled = self._state not in ("starting", "running")
        self.resume_button.disabled = self._state not in ("pausing", "paused")
        self.stop_button.disabled = not active
        self.samples.value = self._samples_html()
        lines_html = html.escape("\n".join(self._logs))
        self.log.value = (
            "<div style='max-height:14em;overflow-y:auto;display:flex;flex-direction:column-reverse'>"
            f"<pre style='margin:0;font-size:85%'>{lines_html}</pre></div>"
        )
        if self._rows_dirty:
            self._rows_dirty = False
            self._draw_rows()
        self._draw_snapshot()
        self._draw_utilisation()

    def _settled(self) -> Any:
        return (self._state, self._step, self._failure) if self._state in SETTLED else None

    def _draw_snapshot(self) -> None:
        """Keep the figure's static picture (what a saved notebook shows without its kernel) current:
        at once when the run settles, else at most every SNAPSHOT_S."""
        now, key = self._clock(), (self._state, len(self._rows.keys), self._rows.keys[-1:])
        if key == self._snapshot_key or (self._state not in SETTLED and now - self._snapshot_at < SNAPSHOT_S):
            return
        self._snapshot_key, self._snapshot_at = key, now
        self.fig._fallback_html = f"<div>{self._snapshot_img()}</div>"

    def _snapshot_img(self) -> str:
        """The curves as an <img> of an SVG data URI: sanitizers that drop inline SVG (an untrusted
        notebook in JupyterLab) keep it."""
        svg = base64.b64encode(self._snapshot_svg().encode()).decode()
        return (
            f"<img alt='reward, loss and KL per step, and utilisation' src='data:image/svg+xml;base64,{svg}'>"
        )

    def _snapshot_svg(self) -> str:
        steps, rows = self._rows.keys, self._rows
        reward = [
            ("mean", steps, rows.column("reward_mean"), "#636efa"),
            ("min", steps, rows.column("reward_min"), "#b4b9fb"),
            ("max", steps, rows.column("reward_max"), "#b4b9fb"),
        ]
        kl = [("KL", steps, rows.column("kl"), "#00cc96")]
        if any(v is not None for v in rows.column("kl_ref")):  # kl_coef > 0: KL to the starting weights
            kl.append(("to reference", steps, rows.column("kl_ref"), "#ab63fa"))
        if any(v is not None for v in rows.column("eval_reward")):  # greedy evaluation (eval_every)
            reward.append(("eval", steps, rows.column("eval_reward"), "#00a000"))
        panels = [
            ("reward", reward, [(float(s), label) for s, label in self._version_changes()]),
            ("loss", [("loss", steps, rows.column("loss"), "#ef553b")], []),
            ("KL", kl, []),
        ]
        util = self._util
        if util.times:  # the device's busy share over the run's seconds, and this run's part of it
            xs = [t - util.times[0] for t in util.times]
            lines = [("all runs", xs, util.total, "#19d3f3")]
            if self.run.run_id in util.by_run:
                lines.append(("this run", xs, util.by_run[self.run.run_id], "#ffa15a"))
            panels.append((f"{util.label or 'utilisation'} (x: seconds)", lines, []))
        return svg_panels(panels)

    def _draw_rows(self) -> None:
        steps = self._rows.keys
        for key in (
            "reward_mean",
            "reward_min",
            "reward_max",
            "loss",
            "ratio_mean",
            "kl",
            "kl_ref",
            "eval_reward",
        ):
            self._set_line(self.fig.data[self._traces[key]], steps, self._rows.column(key))
        markers = self._version_changes()
        if markers != self._markers:
            self._markers = markers
            self.fig.layout.shapes = [
                {
                    "type": "line",
                    "xref": "x",
                    "yref": "y domain",
                    "x0": step,
                    "x1": step,
                    "y0": 0,
                    "y1": 1,
                    "line": {"color": "#888", "width": 1, "dash": "dot"},
                    "label": {"text": label, "textposition": "end", "font": {"size": 10}},
                }
                for step, label in markers
            ]

    def _version_changes(self) -> list[tuple[int, str]]:
        changes: list[tuple[int, str]] = []
        prev: tuple[Any, Any] | None = None
        for step, row in zip(self._rows.keys, self._rows.rows, strict=True):
            version = row.get("reward_version")
            if version is None:
                continue
            name = row.get("reward_name")
            if prev is not None and (name, version) != prev:
                label = f"v{version}" if name == prev[0] else f"{name} v{version}"
                changes.append((int(step), label))
            prev = (name, version)
        return changes

    def _samples_html(self) -> str:
        if not self._samples:
            return ""
        cells = []
        for s in self._samples:
            if s.get("error"):
                outcome = f"<span style='color:#cf222e'>{html.escape(clip(s['error'], 200))}</span>"
            else:
                outcome = html.escape(fmt(s.get("reward")))
            cells.append(
                f"<tr><td style='text-align:left'>{html.escape(clip(s.get('prompt')))}</td>"
                f"<td style='text-align:left;white-space:pre-wrap'>{html.escape(clip(s.get('completion')))}</td>"
                f"<td>{outcome}</td></tr>"
            )
        return (
            f"<details open><summary>samples of step {html.escape(str(self._samples_step))}</summary>"
            "<table><tr><th>prompt</th><th>completion</th><th>reward</th></tr>"
            + "".join(cells)
            + "</table></details>"
        )

    def _summary(self) -> tuple[str, str]:
        name, version = self._reward()
        plain, rich = summary_pair(
            str(self.run.name),
            self._state,
            self._step,
            self.run.total_steps,
            self._rows.last().get("reward_mean"),
            name,
            version,
        )
        if self._failure is not None:
            plain, rich = f"{plain}\n{self._failure.text()}", rich + self._failure.html()
        if self._rows.keys:  # the static picture, for a saved notebook where no widget is drawn
            rich += self._snapshot_img()
        return plain, rich


class ServiceDashboard(_LiveDashboard):
    """Every run of this tenant at a glance: reward mean per run, and utilisation stacked by run.

        dash = ServiceDashboard(session.feed(), runs=session.client.list_runs())
        dash                          # what ``%openrl dashboard`` shows

    ``feed.subscribe(fn)`` delivers the service's events (``GET /openrl/v1/events``) and returns
    the function that unsubscribes; ``runs`` names the runs that existed before it was opened.
    """

    utilisation_row = 2
    digits = 4

    def __init__(
        self,
        feed: Any,
        *,
        runs: Iterable[dict] | None = None,
        interval_s: float = 0.5,
        max_points: int = MAX_POINTS,
        clock: Callable[[], float] = time.monotonic,
        call_later: CallLater | None = None,
    ) -> None:
        super().__init__(interval_s=interval_s, max_points=max_points, clock=clock, call_later=call_later)
        self._runs: dict[str, dict] = {}
        self._rewards: dict[str, Rows] = {}
        self._dirty: set[str] = set()
        for r in runs or ():
            if r.get("run_id"):
                self._run(r["run_id"]).update(name=r.get("name"), step=r.get("step"))

        self.header = widgets.HTML()
        base = make_subplots(
            rows=2,
            cols=1,
            subplot_titles=("reward mean per run", "utilisation by run"),
            vertical_spacing=0.12,
        )
        base.update_layout(height=600, margin={"l": 60, "r": 20, "t": 40, "b": 40}, uirevision="service")
        base.update_xaxes(title_text="step", row=1, col=1)
        base.update_yaxes(tickformat=".0%", range=[0, 1], row=2, col=1)
        self.fig = FigureWidget(base)
        self._small = [self.header]
        self.widget = widgets.VBox([self.header, self.fig])
        with self._render_lock:
            self._unsubscribe = feed.subscribe(self.handle)
            self._redraw()

    def _run(self, run_id: str) -> dict:
        return self._runs.setdefault(
            run_id, {"name": None, "step": None, "reward_mean": None, "deleted": False}
        )

    def _run_label(self, run_id: str) -> str:
        run = self._runs.get(run_id) or {}
        label = run.get("name") or run_id
        return f"{label} (deleted)" if run.get("deleted") else label

    def _apply(self, event: dict) -> None:
        if event.get("type") == "tick":
            self._util_dirty |= self._util.add(event)
            return
        run_id = event.get("run_id")
        if event.get("type") != "run" or not run_id:
            return
        run = self._run(run_id)
        kind = event.get("event")
        if kind == "created":
            run.update(name=event.get("name") or run["name"], deleted=False)
        elif kind == "deleted":
            run["deleted"] = True
        elif kind == "step" and isinstance(event.get("step"), int):
            run["step"] = max(run["step"] or 0, event["step"])
        elif kind == "metrics":
            metrics = event.get("metrics") or {}
            step = metrics.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                rows = self._rewards.setdefault(run_id, Rows())
                rows.put(step, metrics)
                run["reward_mean"] = rows.last().get("reward_mean")
                self._dirty.add(run_id)
        self._dirty.add(f"name:{run_id}")

    def _live_runs(self) -> list[str]:
        return [run_id for run_id, r in self._runs.items() if not r["deleted"]]

    def _draw(self) -> None:
        live = self._live_runs()
        util = self._util
        parts = [f"<b>{plural(len(live), 'run')}</b>"]
        if util.value is not None:
            parts.append(f"{html.escape(util.label or 'utilisation')} {util.value:.0%}")
        if util.fused_share:
            parts.append(f"fused {float(util.fused_share):.0%}")
        if len(util.devices) > 1:  # a model served by several devices: each one's share
            parts.append("devices " + html.escape(per_device(util.devices)))
        if util.queue_depth is not None:
            parts.append(f"queue {html.escape(str(util.queue_depth))}")
        table = "".join(
            f"<tr><td>{html.escape(self._run_label(run_id))}</td><td><code>{html.escape(run_id)}</code></td>"
            f"<td>{html.escape(fmt(self._runs[run_id]['step']))}</td>"
            f"<td>{html.escape(fmt(self._runs[run_id]['reward_mean']))}</td></tr>"
            for run_id in live
        )
        self.header.value = (
            "<div>"
            + " · ".join(parts)
            + "</div>"
            + (
                "<table><tr><th>run</th><th>id</th><th>step</th><th>reward mean</th></tr>"
                + table
                + "</table>"
                if table
                else ""
            )
        )
        for run_id, rows in self._rewards.items():
            if run_id not in self._dirty and f"name:{run_id}" not in self._dirty:
                continue
            trace = self._trace(f"reward:{run_id}", 1, mode="lines+markers", marker={"size": 3})
            trace.name = self._run_label(run_id)
            if run_id in self._dirty:
                self._set_line(trace, rows.keys, rows.column("reward_mean"))
        for key in [k for k in self._dirty if k.startswith("name:")]:
            run_id = key[5:]
            if f"util:{run_id}" in self._traces:
                self.fig.data[self._traces[f"util:{run_id}"]].name = self._run_label(run_id)
        self._dirty.clear()
        self._draw_utilisation()

    def _summary(self) -> tuple[str, str]:
        live = self._live_runs()
        util = self._util
        usage = (
            f"{util.label or 'utilisation'} {util.value:.0%}"
            if util.value is not None
            else "no telemetry yet"
        )
        if len(util.devices) > 1:
            usage += f" (devices {per_device(util.devices)})"
        names = ", ".join(self._run_label(r) for r in live)
        plain = f"openrl service: {plural(len(live), 'run')} ({names}); {usage}"
        return plain, f"<div>{html.escape(plain)}</div>"


def per_device(devices: list[dict]) -> str:
    """``rank 0 45% · rank 1 40%``: each device's busy share of the last telemetry window."""
    return " · ".join(f"rank {d.get('rank', '?')} {float(d.get('busy') or 0.0):.0%}" for d in devices)
