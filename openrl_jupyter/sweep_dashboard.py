"""The live comparison view of a sweep: one metric line per run, runs dropped at a rung greyed and
dashed, the best run highlighted, a dotted line at each rung, and the sweep's results table (its
``_repr_html_``: each run's score, the steps it averages, and the rule that ranks them; see
``openrl_jupyter.sweep``).

    dash = sweep.dashboard()     # subscribes to every run of the sweep; display it in a cell

It shares the throttled flush of ``dashboard._LiveDashboard``: run events (from the runner thread)
are buffered and drawn at most once per ``interval_s``, in one batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from openrl_jupyter.dashboard import CallLater, _LiveDashboard
from openrl_jupyter.figure_widget import FigureWidget
from openrl_jupyter.series import Rows

PALETTE = ("#636efa", "#ef553b", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880", "#ff97ff")
DROPPED = "#b0b0b0"
BEST = "#1a7f37"


class SweepDashboard(_LiveDashboard):
    """One figure (the sweep's metric per run over steps) and the results table."""

    def __init__(
        self,
        sweep: Any,
        *,
        interval_s: float = 0.5,
        max_points: int = 2000,
        clock: Callable[[], float] = time.monotonic,
        call_later: CallLater | None = None,
    ) -> None:
        super().__init__(interval_s=interval_s, max_points=max_points, clock=clock, call_later=call_later)
        self.sweep = sweep
        self._rows: dict[str, Rows] = {run.name: Rows() for run in sweep.runs}
        fig = self.fig = go.Figure()
        fig.update_layout(
            height=420,
            margin={"l": 60, "r": 20, "t": 40, "b": 40},
            title=f"sweep {sweep.name}: {sweep.metric} per run (dotted: rungs; the table's score ranks them)",
            xaxis_title="step",
            yaxis_title=sweep.metric,
            uirevision="sweep",
        )
        for step in sweep.rungs:
            fig.add_vline(x=step, line_dash="dot", line_color="#888")
        for i, run in enumerate(sweep.runs):
            self._trace(
                f"run:{run.name}", 1, name=run.name, mode="lines+markers", line={"color": PALETTE[i % 8]}
            )
        self.fig = FigureWidget(fig)  # plotly's, with its 5 MB front end sent as a message, not as state
        self.table = widgets.HTML()
        self._small = [self.table]
        self.widget = widgets.VBox([self.fig, self.table])
        unsubscribe = []
        with self._render_lock:
            for run in sweep.runs:
                unsubscribe.append(run.subscribe(lambda e, n=run.name: self.handle({**e, "run": n})))
                for row in run.history:
                    self._add(run.name, row)
            unsubscribe.append(sweep.on_change(lambda: self.handle({"kind": "sweep"})))
            self._unsubscribe = lambda: [u() for u in unsubscribe]
            self._redraw()

    def _trace(self, key: str, row: int, **props: Any) -> Any:
        i = self._traces.get(key)
        if i is None:
            self.fig.add_trace(go.Scatter(meta=key, x=[], y=[], **props))
            i = self._traces[key] = len(self.fig.data) - 1
        return self.fig.data[i]

    def _add(self, name: str, row: dict) -> None:
        step = row.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and name in self._rows:
            self._rows[name].put(step, row)

    def _apply(self, event: dict) -> None:
        if event.get("kind") == "step":
            self._add(event.get("run", ""), event.get("row") or {})

    def _draw(self) -> None:
        best = self.sweep.best if self.sweep.done else None
        for i, run in enumerate(self.sweep.runs):
            trace = self._trace(f"run:{run.name}", 1)
            rows = self._rows[run.name]
            self._set_line(trace, rows.column("step"), rows.column(self.sweep.metric))
            rung = self.sweep.stopped_at_rung.get(run.name)
            if best is run:
                trace.name = f"★ {run.name} (best)"
                trace.line = {"color": BEST, "width": 4, "dash": "solid"}
                trace.opacity = 1.0
            elif rung is not None:
                trace.name = f"{run.name} (dropped at rung {rung})"
                trace.line = {"color": DROPPED, "width": 1.5, "dash": "dash"}
                trace.opacity = 0.7
            else:
                trace.name = run.name
                trace.line = {"color": PALETTE[i % len(PALETTE)], "width": 2, "dash": "solid"}
                trace.opacity = 1.0
        self.table.value = self.sweep._repr_html_()

    def _summary(self) -> tuple[str, str]:
        return repr(self.sweep), self.sweep._repr_html_()
