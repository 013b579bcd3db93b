"""Widget JS works in our headless JupyterLab: a plotly FigureWidget (an anywidget) draws points added later.

Runs a two-cell notebook through the UI (Run -> Run All Cells) and counts the markers plotly drew, so the
kernel, jupyter-widgets, anywidget and the plotly front end are all exercised. Screenshot:
``tests/artifacts/lab-smoke.png``.
"""

from __future__ import annotations

from tests._support.lab import open_notebook, report, run_all, screenshot, wait_points, write_notebook

N = 7

SETUP = """\
import plotly.graph_objects as go

fig = go.FigureWidget(go.Scatter(x=[], y=[], mode="lines+markers", name="smoke"))
fig.update_layout(title="lab smoke", width=640, height=320, margin=dict(l=40, r=20, t=40, b=30))
fig"""

APPEND = f"""\
import time

xs, ys = [], []
for i in range({N}):
    xs.append(i)
    ys.append(i * i)
    with fig.batch_update():
        fig.data[0].x = list(xs)
        fig.data[0].y = list(ys)
    time.sleep(0.05)
len(fig.data[0].x)"""


def test_figurewidget_draws_points_added_by_a_later_cell(lab, page):
    write_notebook(lab.root_dir / "smoke.ipynb", SETUP, APPEND)
    open_notebook(page, lab, "smoke.ipynb")
    run_all(page, lab)
    assert wait_points(page, N, lab) == N
    text = page.locator("body").inner_text()
    assert "Error displaying widget" not in text, report(page, lab)
    screenshot(page, "lab-smoke")
