"""The dashboards' figure: plotly's FigureWidget with its 5 MB front end sent as a message, not as state.

A recording comm stands in for the kernel's (as ipywidgets' own tests do): it keeps what the widget
opened with (its state, which nbclient and JupyterLab save) and every message it sent, buffers included.
"""

from __future__ import annotations

import uuid

import comm
import plotly.graph_objects as go
import pytest

from openrl_jupyter.figure_widget import BUNDLE, MSG, FigureWidget


class Recording:
    kernel = "recording"

    def __init__(self, log: list, **kwargs):
        self.comm_id = kwargs.get("comm_id") or uuid.uuid4().hex
        self.log = log
        self.log.append(("open", kwargs.get("data") or {}, kwargs.get("buffers")))
        self.handler = None

    def open(self, *args, **kwargs):
        pass

    def on_msg(self, handler):
        self.handler = handler

    def send(self, data=None, metadata=None, buffers=None):
        self.log.append(("send", data, buffers))

    def close(self, *args, **kwargs):
        pass


@pytest.fixture
def log(monkeypatch):
    out: list = []
    monkeypatch.setattr(comm, "create_comm", lambda **kw: Recording(out, **kw))
    return out


def custom(log):
    return [(d["content"], b) for kind, d, b in log if kind == "send" and d.get("method") == "custom"]


def test_the_figure_opens_without_plotly_js_and_sends_it_once_as_a_message(log):
    fig = FigureWidget(go.Figure(go.Scatter(x=[1, 2], y=[3, 4], name="r")))
    opened = [
        d["state"] for kind, d, _ in log if kind == "open" and d["state"].get("_model_name") == "AnyModel"
    ]
    (state,) = opened
    assert len(state["_esm"]) < 20_000 and "openrl:plotly-bundle" in state["_esm"]
    assert state["_fallback_html"] == ""  # until its owner draws a snapshot
    ((content, buffers),) = custom(log)
    assert content["type"] == MSG and bytes(buffers[0]) == BUNDLE.read_bytes()
    assert len(BUNDLE.read_bytes()) > 1_000_000  # what used to sit in every figure's saved state
    fig.close()


def test_a_front_end_that_asks_gets_the_figure_as_it_is_then_the_code(log):
    fig = FigureWidget(go.Figure(go.Scatter(x=[1], y=[1])))
    fig.add_trace(go.Scatter(x=[1, 2], y=[5, 6], name="added later"))  # sent as an edit, not as state
    del log[:]
    fig._handle_msg({"content": {"data": {"method": "custom", "content": {"type": MSG}}}, "buffers": []})
    updates = [d["state"] for kind, d, _ in log if kind == "send" and d.get("method") == "update"]
    assert any(
        [t.get("name") for t in u.get("_widget_data", [])] == [None, "added later"] for u in updates
    ), updates
    ((content, buffers),) = custom(log)
    assert content["type"] == MSG and len(buffers[0]) == len(BUNDLE.read_bytes())
    fig._handle_msg({"content": {"data": {"method": "custom", "content": {"type": "other"}}}, "buffers": []})
    assert len(custom(log)) == 1  # other messages are not answered
    fig.close()
