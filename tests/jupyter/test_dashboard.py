"""The live dashboards, driven without a kernel: a recording comm counts what would reach the browser,
and a fake clock with a fake ``call_later`` decides when flushes run."""

from __future__ import annotations

import base64
import json
import math
import random
import uuid

import comm
import pytest

from openrl_jupyter.dashboard import RunDashboard, ServiceDashboard, downsample
from openrl_jupyter.rewards import RewardFailure
from openrl_jupyter.series import svg_panels
from openrl_jupyter.summary import summary_html

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class RecordingComm:
    """Stands in for a kernel comm (as ipywidgets' own tests do) and records every message sent."""

    kernel = "recording"

    def __init__(self, log: list, **kwargs):
        self.comm_id = kwargs.get("comm_id") or uuid.uuid4().hex
        self.log = log

    def open(self, *args, **kwargs):
        pass

    def on_msg(self, *args, **kwargs):
        pass

    def send(self, data=None, metadata=None, buffers=None):
        self.log.append(data)

    def close(self, *args, **kwargs):
        pass


@pytest.fixture
def sent(monkeypatch):
    """The messages widgets send to the frontend (comm_open payloads are not counted)."""
    log: list = []
    monkeypatch.setattr(comm, "create_comm", lambda **kw: RecordingComm(log, **kw))
    return log


class Timers:
    """A clock the test moves, and a ``call_later`` whose callbacks run when their time comes."""

    def __init__(self):
        self.now = 0.0
        self.due: list[tuple[float, int, object]] = []
        self._seq = 0

    def clock(self) -> float:
        return self.now

    def call_later(self, delay_s, fn):
        self._seq += 1
        self.due.append((self.now + delay_s, self._seq, fn))

    def advance_to(self, t: float) -> int:
        self.now = t
        ran = 0
        while True:
            ready = sorted(d for d in self.due if d[0] <= self.now)
            if not ready:
                return ran
            self.due.remove(ready[0])
            ready[0][2]()
            ran += 1


class FakeRun:
    def __init__(self, history=None, *, state="running", total_steps=100):
        self.name = "fake"
        self.run_id = "run-a"
        self.model = "openrl/tiny"
        self.total_steps = total_steps
        self.state = state
        self.reward_name = "letters"
        self.reward_version = 1
        self.last_error = None
        self._history = list(history or [])
        self.step = max((r["step"] for r in self._history), default=0)
        self.calls: list[str] = []
        self.listeners: list = []

    @property
    def history(self):
        return [dict(r) for r in self._history]

    def pause(self):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def stop(self):
        self.calls.append("stop")

    def subscribe(self, fn):
        self.listeners.append(fn)
        return lambda: self.listeners.remove(fn)

    def emit(self, event):
        for fn in list(self.listeners):
            fn(event)


def row(step, reward=0.5, version=1, **extra):
    return {
        "step": step,
        "reward_mean": reward,
        "reward_std": 0.1,
        "reward_min": reward - 0.2,
        "reward_max": reward + 0.2,
        "reward_name": "letters",
        "reward_version": version,
        "failed": 0,
        "n": 8,
        "loss": 0.01 * step,
        "ratio_mean": 1.0,
        "ratio_min": 0.9,
        "ratio_max": 1.1,
        "kl": 0.001,
        "clip_fraction": 0.0,
        "grad_norm": 1.0,
        "tokens": 100,
        "time": 1_700_000_000.0 + step,
        "elapsed_s": float(step),
        **extra,
    }


def tick(t, value, runs, label="engine busy"):
    return {
        "schema": 1,
        "type": "tick",
        "time": t,
        "window_s": 5.0,
        "utilisation": {"label": label, "value": value},
        "runs": runs,
        "queue_depth": 0,
    }


def trace(fig, name):
    found = [t for t in fig.data if t.name == name]
    assert len(found) == 1, [t.name for t in fig.data]
    return found[0]


@pytest.fixture
def timers():
    return Timers()


@pytest.fixture
def make_dash(sent, timers):
    made = []

    def make(run, **kw):
        dash = RunDashboard(run, clock=timers.clock, call_later=timers.call_later, **kw)
        made.append(dash)
        return dash

    yield make
    for dash in made:
        dash.close()


# -- downsample -------------------------------------------------------------------------------------------


def test_downsample_leaves_short_lines_alone():
    xs, ys = list(range(10)), [float(i % 3) for i in range(10)]
    assert downsample(xs, ys, 10) == (xs, ys)
    assert downsample([], [], 5) == ([], [])


def test_downsample_bounds_points_and_keeps_ends_and_extremes():
    rng = random.Random(0)
    n = 50_000
    xs = list(range(n))
    ys = [rng.uniform(-1, 1) for _ in range(n)]
    ys[1234], ys[31_000] = -9.0, 9.0
    for max_points in (2, 3, 10, 101, 2000):
        dx, dy = downsample(xs, ys, max_points)
        assert len(dx) == len(dy) <= max_points
        assert dx[0] == 0 and dx[-1] == n - 1
        assert dx == sorted(dx) and all(ys[x] == y for x, y in zip(dx, dy, strict=True))
        if max_points >= 10:
            assert min(dy) == -9.0 and max(dy) == 9.0
    dx, _ = downsample(xs, ys, 2000)
    assert dx[-1000:] == xs[-1000:], "the recent half stays at full resolution"


def test_downsample_skips_missing_values_but_keeps_a_gap():
    xs = list(range(100))
    ys = [None] * 50 + [float(i) for i in range(50)]
    dx, dy = downsample(xs, ys, 20)
    assert len(dx) <= 20 and dx[0] == 0 and dx[-1] == 99
    assert None in dy[1:], "an all-missing bucket keeps one point so the line shows the gap"
    assert math.nan not in dy


def test_downsample_rejects_impossible_budgets():
    with pytest.raises(ValueError, match="max_points must be ≥ 2"):
        downsample([1, 2, 3], [1, 2, 3], 1)
    with pytest.raises(ValueError, match="same length"):
        downsample([1, 2], [1], 5)


# -- RunDashboard -----------------------------------------------------------------------------------------


def test_a_burst_of_steps_costs_at_most_two_flushes_and_nothing_in_between(make_dash, sent, timers):
    run = FakeRun()
    dash = make_dash(run)
    for i in range(100):
        flushes, messages = dash.flush_count, len(sent)
        timers.advance_to(i / 100)
        dash.handle({"kind": "step", "row": row(i + 1)})
        if dash.flush_count == flushes:
            assert len(sent) == messages, f"event {i + 1} reached the frontend outside a flush"
    timers.advance_to(1.0)
    assert 1 <= dash.flush_count <= 2
    assert not timers.due, "no flush is left pending once everything is drawn"
    assert trace(dash.fig, "reward mean").x[-1] == 100
    assert len(trace(dash.fig, "reward mean").x) == 100
    assert "step 100/100" in dash.header.value
    assert dash.progress.value == 100


def test_ten_thousand_steps_stay_within_max_points(make_dash, timers):
    dash = make_dash(FakeRun(total_steps=10_000))
    rng = random.Random(1)
    rewards = [rng.uniform(0, 1) for _ in range(10_000)]
    rewards[1234], rewards[4321] = -5.0, 7.0
    for i, r in enumerate(rewards):
        dash.handle({"kind": "step", "row": row(i + 1, r)})
    for i in range(3000):
        dash.handle({"kind": "tick", "tick": tick(1_700_000_000.0 + i, 0.5, {"run-a": 0.5, "run-b": 0.5})})
    timers.advance_to(1.0)
    assert dash.flush_count == 1
    assert len(dash.fig.data) >= 9
    for t in dash.fig.data:
        assert len(t.x) == len(t.y) <= 2000, t.name
    mean = trace(dash.fig, "reward mean")
    assert mean.x[0] == 1 and mean.x[-1] == 10_000
    assert min(mean.y) == -5.0 and max(mean.y) == 7.0
    assert "step 10000/10000" in dash.header.value


def test_history_is_drawn_once_per_step_and_events_after_it_add_up(make_dash, timers):
    run = FakeRun([row(1, 0.1), row(2, 0.2), row(2, 0.25), row(3, 0.3)])
    dash = make_dash(run)
    mean = trace(dash.fig, "reward mean")
    assert list(mean.x) == [1, 2, 3] and list(mean.y) == [0.1, 0.25, 0.3]
    band_low, band_high = trace(dash.fig, "reward min"), trace(dash.fig, "reward max")
    assert band_low.fill == "tonexty" and list(band_low.y) == pytest.approx([-0.1, 0.05, 0.1])
    assert list(band_high.y) == pytest.approx([0.3, 0.45, 0.5])
    run.emit({"kind": "step", "row": row(3, 0.3)})
    run.emit({"kind": "step", "row": row(4, 0.4, loss=None)})
    run.emit({"kind": "step", "row": {"step": "five"}})
    run.emit({"kind": "step", "row": {"step": 5, "reward_mean": 0.5}})
    timers.advance_to(0.5)
    assert list(mean.x) == [1, 2, 3, 4, 5]
    assert trace(dash.fig, "loss").y[-2:] == (None, None)
    assert "step 5/100" in dash.header.value


def test_reward_version_change_is_marked_where_it_happened(make_dash):
    history = [row(s, version=1 if s < 4 else 2) for s in range(1, 8)]
    dash = make_dash(FakeRun(history))
    shapes = dash.fig.layout.shapes
    assert [(s.x0, s.x1, s.label.text) for s in shapes] == [(4, 4, "v2")]
    assert "letters v2" in dash.header.value


def test_utilisation_is_stacked_per_run_under_the_ticks_label(make_dash, timers):
    run = FakeRun()
    dash = make_dash(run)
    run.emit({"kind": "tick", "tick": tick(1_700_000_000.0, 0.8, {"run-a": 0.75, "run-b": 0.25})})
    run.emit({"kind": "tick", "tick": tick(1_700_000_001.0, 0.4, {"run-b": 1.0})})
    timers.advance_to(0.5)
    mine, other = trace(dash.fig, "fake"), trace(dash.fig, "run-b")
    assert mine.stackgroup == other.stackgroup is not None
    assert list(mine.y) == pytest.approx([0.6, 0.0])
    assert list(other.y) == pytest.approx([0.2, 0.4])
    assert list(trace(dash.fig, "engine busy (all)").y) == pytest.approx([0.8, 0.4])
    layout = json.dumps(dash.fig.layout.to_plotly_json())
    assert dash.fig.layout.yaxis5.title.text == "engine busy"
    assert "GPU" not in layout


def test_buttons_drive_the_run_and_follow_its_state(make_dash, timers):
    run = FakeRun()
    dash = make_dash(run)
    assert not dash.pause_button.disabled and dash.resume_button.disabled and not dash.stop_button.disabled
    dash.pause_button.click()
    dash.resume_button.click()
    dash.stop_button.click()
    assert run.calls == ["pause", "resume", "stop"]
    run.emit({"kind": "state", "state": "paused", "error": None})
    timers.advance_to(0.5)
    assert dash.pause_button.disabled and not dash.resume_button.disabled and not dash.stop_button.disabled
    run.emit({"kind": "state", "state": "failed", "error": "reward <letters> raised"})
    timers.advance_to(1.0)
    assert dash.pause_button.disabled and dash.resume_button.disabled and dash.stop_button.disabled
    assert "failed" in dash.header.value
    assert "reward &lt;letters&gt; raised" in dash.header.value and "<letters>" not in dash.header.value
    assert dash.progress.bar_style == "danger"


def failure(**kw):
    fields = {
        "run": "fake",
        "reward": "letters",
        "version": 2,
        "step": 7,
        "error": "ZeroDivisionError: division by zero",
        "prompt": "Say <hi>:",
        "completion": "x" * 5000,
        "failed": 8,
        "n": 8,
        "paused": True,
        "traceback": 'Traceback (most recent call last):\n  File "<cell>", line 2, in reward\nZeroDivisionError',
    }
    return RewardFailure(**{**fields, **kw})


def test_a_reward_failure_is_boxed_with_its_version_and_sample_until_a_clean_step(make_dash, timers):
    run = FakeRun([row(5), row(6)])
    dash = make_dash(run)
    assert dash.failure_box.value == ""
    run.emit({"kind": "reward_error", "failure": failure()})
    run.emit({"kind": "state", "state": "paused", "error": "step 7: every sample failed\nTraceback ..."})
    timers.advance_to(0.5)
    box = dash.failure_box.value
    assert "reward letters v2 failed</b> on 8 of 8 samples at step 7" in box
    assert "ZeroDivisionError: division by zero" in box and "run.resume()" in box
    assert "Say &lt;hi&gt;:" in box and "<hi>" not in box  # escaped
    assert "x" * 150 in box and "x" * 300 not in box  # the sample is clipped
    assert "error: step 7: every sample failed" in dash.header.value  # the header keeps its first line
    plain = dash._repr_mimebundle_()["text/plain"]
    assert "reward letters v2 failed on 8 of 8 samples at step 7" in plain  # the static fallback too

    run.emit({"kind": "state", "state": "running", "error": None})
    run.emit({"kind": "step", "row": row(7, version=3, failed=0)})
    timers.advance_to(1.0)
    assert dash.failure_box.value == ""


def test_a_dashboard_built_after_the_failure_shows_it(make_dash, timers):
    run = FakeRun(state="paused")
    run.reward_failure = failure(paused=True)
    dash = make_dash(run)
    assert "reward letters v2 failed" in dash.failure_box.value


def test_a_failing_button_action_is_shown_not_lost(make_dash, timers):
    run = FakeRun()

    def refuse():
        raise RuntimeError("run 'fake' already finished")

    run.pause = refuse
    dash = make_dash(run)
    dash.pause_button.click()
    timers.advance_to(0.5)
    assert "RuntimeError: run &#x27;fake&#x27; already finished" in dash.header.value


def test_logs_and_samples_are_shown_escaped_and_trimmed(make_dash, timers):
    run = FakeRun()
    dash = make_dash(run)
    for i in range(250):
        run.emit({"kind": "log", "step": 3, "text": f"line {i}"})
    run.emit({"kind": "log", "step": 4, "text": "score <b>bold</b>"})
    samples = [
        {"prompt": "2+2=", "completion": "<script>alert(1)</script>", "reward": 1.0, "error": None},
        {"prompt": "p" * 5000, "completion": "x", "reward": None, "error": "ValueError: <nan>"},
    ]
    run.emit({"kind": "samples", "step": 4, "samples": samples})
    timers.advance_to(0.5)
    log = dash.log.value
    assert "[4] score &lt;b&gt;bold&lt;/b&gt;" in log and "<b>bold" not in log
    assert "line 249" in log and "line 0\n" not in log and log.count("line ") == 199
    table = dash.samples.value
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in table and "<script>" not in table
    assert "ValueError: &lt;nan&gt;" in table
    assert "p" * 5000 not in table and "…" in table
    assert "samples of step 4" in table


def test_fallback_html_summarises_the_run(make_dash):
    run = FakeRun([row(1, 0.25), row(2, 0.75, version=2)], state="paused", total_steps=10)
    dash = make_dash(run)
    bundle = dash._repr_mimebundle_()
    assert WIDGET_VIEW in bundle
    for part in ("fake", "paused", "step 2/10", "letters v2", "0.75"):
        assert part in bundle["text/html"] and part in bundle["text/plain"]
    run.name = "<evil>"
    assert "&lt;evil&gt;" in summary_html(run) and "<evil>" not in summary_html(run)


def test_a_settled_run_rewrites_its_shown_output_with_the_final_summary_and_curves(
    make_dash, timers, monkeypatch
):
    """What a saved notebook keeps of a dashboard: its output's text/html (readers without widgets) and
    the figure's snapshot (a reopened notebook without its kernel), both as of when the run settled."""
    import IPython.display

    shown: list[tuple[str, str, dict]] = []
    monkeypatch.setattr(
        IPython.display, "display", lambda b, raw, display_id: shown.append(("show", display_id, b))
    )
    monkeypatch.setattr(
        IPython.display, "update_display", lambda b, raw, display_id: shown.append(("update", display_id, b))
    )
    run = FakeRun([row(1, 0.2), row(2, 0.4)], total_steps=3)
    dash = make_dash(run)
    dash._ipython_display_()
    ((how, display_id, first),) = shown
    assert how == "show" and WIDGET_VIEW in first and "running" in first["text/plain"]
    run.emit({"kind": "step", "row": row(3, 0.6, version=2)})
    timers.advance_to(0.5)
    assert len(shown) == 1  # a running run's output is left alone (each rewrite redraws it)
    run.emit({"kind": "state", "state": "finished", "error": None})
    timers.advance_to(1.0)
    how, same_id, final = shown[-1]
    assert (how, same_id) == ("update", display_id)
    assert final["text/plain"] == "openrl run 'fake': finished, step 3/3, letters v2 mean 0.6"
    assert WIDGET_VIEW in final and "data:image/svg+xml;base64," in final["text/html"]
    picture = base64.b64decode(final["text/html"].split("base64,", 1)[1].split("'", 1)[0]).decode()
    assert picture.count("<polyline") >= 5 and ">v2<" in picture  # reward mean/min/max, loss, KL; the switch
    assert "data:image/svg+xml;base64," in dash.fig._fallback_html  # what the figure draws with no kernel
    dash.sync()  # after run.wait(), on the kernel thread: said again, in the waiting cell
    assert shown[-1][:2] == ("update", display_id) and len(shown) == 3


def test_the_static_picture_breaks_lines_at_missing_values_and_says_when_empty():
    picture = svg_panels(
        [
            ("reward", [("mean", [1, 2, 3, 4], [0.1, None, 0.3, 0.4], "#636efa")], [(3, "v<2>")]),
            ("loss", [("loss", [], [], "#ef553b")], []),
        ]
    )
    assert picture.count("<polyline") == 2  # 1 | 3-4: the missing step is a gap
    assert "v&lt;2&gt;" in picture and "no data yet" in picture
    assert len(picture) < 4000


def test_close_stops_listening(make_dash, sent, timers):
    run = FakeRun()
    dash = make_dash(run)
    dash.close()
    assert run.listeners == []
    before = len(sent)
    dash.handle({"kind": "step", "row": row(1)})
    timers.advance_to(5.0)
    assert dash.flush_count == 0 and len(sent) == before


# -- ServiceDashboard -------------------------------------------------------------------------------------


class FakeFeed:
    def __init__(self):
        self.listeners: list = []

    def subscribe(self, fn):
        self.listeners.append(fn)
        return lambda: self.listeners.remove(fn)

    def emit(self, event):
        for fn in list(self.listeners):
            fn(event)


def run_event(kind, run_id, **fields):
    return {"schema": 1, "type": "run", "time": 1_700_000_000.0, "event": kind, "run_id": run_id, **fields}


def test_service_dashboard_draws_each_run_and_stacks_utilisation(sent, timers):
    feed = FakeFeed()
    dash = ServiceDashboard(
        feed, runs=[{"run_id": "r1", "name": "alpha"}], clock=timers.clock, call_later=timers.call_later
    )
    try:
        messages = len(sent)
        feed.emit(run_event("created", "r2", name="beta"))
        for step in (1, 2, 3):
            feed.emit(run_event("metrics", "r1", metrics={"step": step, "reward_mean": 0.1 * step}))
        for step in (1, 2):
            feed.emit(run_event("metrics", "r2", metrics={"step": step, "reward_mean": 0.5}))
            feed.emit(run_event("step", "r2", step=step, loss=0.1))
        feed.emit(tick(1_700_000_000.0, 0.9, {"r1": 2 / 3, "r2": 1 / 3}))
        assert dash.flush_count == 0 and len(sent) == messages
        timers.advance_to(0.5)
        assert dash.flush_count == 1 and len(sent) > messages
        by_key = {t.meta: t for t in dash.fig.data}
        assert by_key["reward:r1"].name == "alpha" and list(by_key["reward:r1"].x) == [1, 2, 3]
        assert list(by_key["reward:r1"].y) == pytest.approx([0.1, 0.2, 0.3])
        assert by_key["reward:r2"].name == "beta" and list(by_key["reward:r2"].y) == [0.5, 0.5]
        stacked = {t.name: list(t.y) for t in dash.fig.data if t.stackgroup}
        assert stacked == {"alpha": pytest.approx([0.6]), "beta": pytest.approx([0.3])}
        assert dash.fig.layout.yaxis2.title.text == "engine busy"
        assert "2 runs" in dash.header.value and "engine busy 90%" in dash.header.value
        assert "fused" not in dash.header.value  # no fused call in that window: nothing said
        feed.emit(tick(1_700_000_001.0, 0.95, {"r1": 0.5, "r2": 0.5}) | {"fused_share": 0.25})
        timers.advance_to(1.0)
        assert "fused 25%" in dash.header.value
        assert "devices" not in dash.header.value  # one device: nothing more to say
        two = [
            {"rank": 0, "busy": 0.8, "memory_bytes": 1 << 30},
            {"rank": 1, "busy": 0.7, "memory_bytes": 1 << 30},
        ]
        feed.emit(tick(1_700_000_001.2, 0.95, {"r1": 0.5, "r2": 0.5}) | {"devices": two})
        timers.advance_to(2.0)
        assert "devices rank 0 80% · rank 1 70%" in dash.header.value  # a model served by a group
        assert "(devices rank 0 80% · rank 1 70%)" in dash._repr_mimebundle_()["text/html"]
        feed.emit(run_event("deleted", "r2"))
        timers.advance_to(3.0)
        assert "1 run<" in dash.header.value
        assert "beta (deleted)" in [t.name for t in dash.fig.data]
        assert "1 run (alpha)" in dash._repr_mimebundle_()["text/html"]
    finally:
        dash.close()
    assert feed.listeners == []


def test_the_plain_summaries_need_neither_plotly_nor_ipywidgets():
    """A saved notebook or a kernel without the widget extras still shows a run's summary."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['plotly'] = sys.modules['ipywidgets'] = None\n"
        "from types import SimpleNamespace as NS\n"
        "from openrl_jupyter.summary import summary_html, summary_text\n"
        "run = NS(name='q<1>', state='running', step=3, total_steps=10, reward_name='letters',\n"
        "         reward_version=2, history=[{'reward_mean': 0.5, 'reward_version': 2}])\n"
        "print(summary_text(run)); print(summary_html(run))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text, rich = out.stdout.splitlines()
    assert text == "openrl run 'q<1>': running, step 3/10, letters v2 mean 0.5"
    assert "<b>q&lt;1&gt;</b>" in rich and "letters v2" in rich


def test_the_event_feed_survives_a_key_rotation(server):
    """The service refuses the session's key (401: it was rotated or revoked) while a dashboard
    watches: the feed says why in ``last_error`` and keeps reconnecting with bounded backoff, and once
    the client factory hands out a working key the events flow again; close() still stops it."""
    import threading

    from openrl_jupyter.client import AsyncClient
    from openrl_jupyter.feed import EventFeed
    from tests.conftest import ALICE_KEY

    key = {"now": "tml-rotated-away-0000000000000000"}
    clients: dict[str, AsyncClient] = {}
    calls = {"n": 0}
    retried, ticked = threading.Event(), threading.Event()

    def factory() -> AsyncClient:  # what Session.async_client does, with the key of the moment
        calls["n"] += 1
        if calls["n"] == 3:  # reconnected twice after the first refusal
            retried.set()
        if key["now"] not in clients:
            clients[key["now"]] = AsyncClient(server.url, token=key["now"], retries=0)
        return clients[key["now"]]

    feed = EventFeed(factory, max_backoff_s=0.5)
    feed.subscribe(lambda event: ticked.set() if event.get("type") == "tick" else None)
    try:
        assert retried.wait(60), f"the feed stopped after the 401: {feed.last_error}"
        assert "401" in feed.last_error and "key" in feed.last_error, feed.last_error
        assert not ticked.is_set()
        key["now"] = ALICE_KEY  # the new key: the next reconnect uses it
        assert ticked.wait(60), f"the feed never reconnected after the 401: {feed.last_error}"
    finally:
        feed.close()
    n = calls["n"]
    assert feed._task_future is None and calls["n"] == n  # closed: no reconnecting any more


def test_an_environment_runs_episodes_are_summed_up_in_the_header(make_dash, timers):
    run = FakeRun([row(1, turns=2.5, tool_calls=1.25, tool_errors=0.5)])
    dash = make_dash(run)
    assert "episodes: 2.5 turns · 1.25 tool calls · 0.5 malformed calls" in dash.header.value
    plain = make_dash(FakeRun([row(1)]))
    assert "episodes:" not in plain.header.value


def test_kl_to_the_reference_and_the_eval_reward_are_drawn_when_the_run_has_them(make_dash, timers):
    history = [row(1, 0.1, kl_ref=0.0), row(2, 0.2, kl_ref=0.01, eval_reward=0.3), row(3, 0.3, kl_ref=0.02)]
    dash = make_dash(FakeRun(history))
    assert list(trace(dash.fig, "KL to reference").y) == [0.0, 0.01, 0.02]
    assert list(trace(dash.fig, "eval reward").y) == [None, 0.3, None]
    assert "to reference" in dash._snapshot_svg()
    plain = make_dash(FakeRun([row(1, 0.1), row(2, 0.2)]))
    assert "to reference" not in plain._snapshot_svg()


def test_the_static_picture_shows_utilisation_and_the_greedy_evaluation(make_dash, timers):
    """What a reader of a saved notebook sees without the kernel: the device's busy share beside the
    curves (this run's part and everyone's), and the periodic greedy evaluation on the reward panel."""
    run = FakeRun([row(1, 0.2), row(2, 0.4, eval_reward=0.7)])
    dash = make_dash(run)
    assert "engine busy" not in dash._snapshot_svg()  # no tick yet: no panel that says nothing
    run.emit({"kind": "tick", "tick": tick(1_700_000_000.0, 0.8, {run.run_id: 0.75, "run-b": 0.25})})
    run.emit({"kind": "tick", "tick": tick(1_700_000_002.0, 0.4, {run.run_id: 1.0})})
    timers.advance_to(0.5)
    picture = dash._snapshot_svg()
    assert "engine busy (x: seconds)" in picture and "this run" in picture and "all runs" in picture
    assert ">eval<" in picture
    assert picture.count("<polyline") >= 7  # reward mean/min/max, eval, loss, KL, utilisation
