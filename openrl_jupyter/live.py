"""What every live dashboard shares: the throttled flush, the output that is rewritten when a run
settles, trace bookkeeping and the utilisation panel (``_LiveDashboard``; see ``dashboard.py`` for
the design). The dashboards are ``dashboard.RunDashboard``, ``dashboard.ServiceDashboard`` and
``sweep_dashboard.SweepDashboard``.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from openrl_jupyter.series import Utilisation, downsample, downsample_indices

log = logging.getLogger(__name__)

CallLater = Callable[[float, Callable[[], None]], Any]
MAX_POINTS = 500  # per trace: the recent half as is, older buckets' min and max (series.downsample)


class _LiveDashboard(abc.ABC):
    """The throttled flush shared by the dashboards; subclasses fold events in and draw."""

    utilisation_row = 1
    digits: int | None = None  # plotted values to this many significant digits (None: as they are)

    def __init__(
        self,
        *,
        interval_s: float,
        max_points: int,
        clock: Callable[[], float],
        call_later: CallLater | None,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be ≥ 0; got {interval_s}")
        if max_points < 2:
            raise ValueError(f"max_points must be ≥ 2; got {max_points}")
        self.interval_s = interval_s
        self.max_points = max_points
        self.flush_count = 0
        self._clock = clock
        self._call_later = call_later or _runner_call_later
        self._lock = threading.Lock()
        self._render_lock = threading.RLock()
        self._pending: list[dict] = []
        self._scheduled = False
        self._closed = False
        self._last_flush = clock()
        self._traces: dict[str, int] = {}
        self._util = Utilisation()
        self._util_dirty = False
        self._unsubscribe: Callable[[], None] | None = None
        self._display_id: str | None = None  # set once shown: its output is updated when the run settles
        self._displayed_settled: Any = None
        self.fig: go.FigureWidget
        self.widget: widgets.VBox
        self._small: list[widgets.DOMWidget] = []

    def handle(self, event: dict) -> None:
        """Take one event (from any thread); it reaches the widgets at the next flush."""
        with self._lock:
            if self._closed:
                return
            self._pending.append(event)
            if self._scheduled:
                return
            self._scheduled = True
            now = self._clock()
            due = max(now, self._last_flush + self.interval_s)
        self._call_later(due - now, self._on_timer)

    def flush(self) -> None:
        """Apply every pending event to the widgets in one batch (a no-op when nothing is pending)."""
        with self._render_lock:
            with self._lock:
                events, self._pending = self._pending, []
                self._scheduled = False
                self._last_flush = self._clock()
                if self._closed or not events:
                    return
            for event in events:
                try:
                    self._apply(event)
                except Exception:
                    log.exception("dashboard skipped an event it could not read: %.200r", event)
            self._redraw()
            self.flush_count += 1
            settled = self._settled()
            if settled is not None and settled != self._displayed_settled:
                self._update_display(settled)

    def sync(self) -> None:
        """On the kernel thread, after a cell waited for the run: apply what is pending and, when the
        run has settled, rewrite the shown output's static fallback, so that what this cell's
        notebook saves (nbclient too, which hears only the running cell) is the final state."""
        with self._render_lock:
            self.flush()
            settled = self._settled()
            if settled is not None:
                self._update_display(settled)

    def _ipython_display_(self) -> None:
        """Shown with a display id: when the run settles (paused, finished, stopped, failed), the
        output's text/html is rewritten with the final summary and a static picture of the curves."""
        from IPython.display import display

        self._display_id = self._display_id or uuid.uuid4().hex
        display(self._repr_mimebundle_(), raw=True, display_id=self._display_id)

    def _update_display(self, settled: Any) -> None:
        self._displayed_settled = settled
        if self._display_id is None:
            return
        from IPython.display import update_display

        try:
            if hasattr(self.fig, "sync_data"):  # the re-rendered output's view starts from the whole figure
                self.fig.sync_data()
            update_display(self._repr_mimebundle_(), raw=True, display_id=self._display_id)
        except Exception:  # noqa: BLE001 - the live widget still shows the run
            log.exception("dashboard could not update its saved fallback")

    def _settled(self) -> Any:
        """A key of the settled state worth saving (None while the run is under way)."""
        return None

    def close(self) -> None:
        """Stop listening and close the widgets (a closed dashboard ignores later events)."""
        with self._lock:
            self._closed = True
            self._pending = []
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        with self._render_lock:
            for w in [*self._small, self.fig, self.widget]:
                w.close()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        plain, rich = self._summary()
        bundle["text/plain"] = plain
        bundle["text/html"] = rich
        return bundle

    def _on_timer(self) -> None:
        try:
            self.flush()
        except Exception:
            log.exception("dashboard flush failed")

    def _redraw(self) -> None:
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.fig.batch_update())
            for w in self._small:
                stack.enter_context(w.hold_sync())
            self._draw()

    @abc.abstractmethod
    def _apply(self, event: dict) -> None:
        """Fold one event into the Python-side state (no widget is touched)."""

    @abc.abstractmethod
    def _draw(self) -> None:
        """Write the state into the widgets (inside one batch)."""

    @abc.abstractmethod
    def _summary(self) -> tuple[str, str]:
        """The plain and HTML one-line summaries for the fallback repr."""

    def _run_label(self, run_id: str) -> str:
        return run_id

    def _trace(self, key: str, row: int, *, secondary_y: bool = False, **props: Any) -> Any:
        """The trace ``key`` of subplot ``row``, added on first use.

        The fixed traces are added while ``self.fig`` is still a plain ``go.Figure``, so they reach
        the browser inside the widget's one comm_open instead of as messages of their own.
        """
        i = self._traces.get(key)
        if i is None:
            extra = {"secondary_y": True} if secondary_y else {}
            self.fig.add_trace(go.Scatter(meta=key, x=[], y=[], **props), row=row, col=1, **extra)
            i = self._traces[key] = len(self.fig.data) - 1
        return self.fig.data[i]

    def _set_line(self, trace: Any, xs: Sequence[Any], ys: Sequence[Any]) -> None:
        xs, ys = downsample(xs, ys, self.max_points)
        trace.x, trace.y = xs, ys if self.digits is None else [_round(y, self.digits) for y in ys]

    def _draw_utilisation(self) -> None:
        util, row = self._util, self.utilisation_row
        label = util.label or "utilisation"
        self.fig.update_yaxes(title_text=label, row=row, col=1)
        if not self._util_dirty:
            return
        self._util_dirty = False
        idx = downsample_indices(util.total, self.max_points)
        xs = [datetime.fromtimestamp(util.times[i]) for i in idx]
        for run_id, column in util.by_run.items():
            trace = self._trace(
                f"util:{run_id}", row, mode="lines", stackgroup="utilisation", line={"width": 0.5}
            )
            trace.name = self._run_label(run_id)
            trace.x, trace.y = xs, [round(column[i], 3) for i in idx]
        total = self._trace("util:total", row, name=f"{label} (all)", mode="lines", line={"dash": "dot"})
        total.name = f"{label} (all)"
        total.x, total.y = xs, [round(util.total[i], 3) for i in idx]


def _round(y: Any, digits: int) -> Any:
    """A plotted value to ``digits`` significant digits: what a hover shows, at a third of the bytes
    (every update carries whole traces, and a notebook saved with widget state keeps them)."""
    return float(f"{y:.{digits}g}") if isinstance(y, float) and math.isfinite(y) else y


def _runner_call_later(delay_s: float, fn: Callable[[], None]) -> None:
    from openrl_jupyter.runner import get_runner

    get_runner().call_later(delay_s, fn)
