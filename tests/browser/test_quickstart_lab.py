"""The quickstart in a real JupyterLab and browser: the reward plot draws one point per completed step.

The notebook (a few steps, set through its parameters cell) runs through the UI (Run -> Run All
Cells) with an embedded service. While it runs, the page itself records how many reward-mean
markers plotly has drawn (a timer in the page, independent of the test's blocking calls); the count
must grow step by step to the number of steps the run completed. Screenshot:
``tests/artifacts/quickstart-lab.png``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat

from tests._support.lab import ACTIVE, open_notebook, report, run_all, screenshot, wait_points

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
REWARD_MEAN_TRACE = 2  # reward max, reward min (the band), then reward mean

RECORD = """
([selector, traceIndex]) => {
  window.__points = [];
  window.__pointsTimer = setInterval(() => {
    const plot = document.querySelector(selector);
    if (!plot) return;
    const trace = plot.querySelectorAll('.scatterlayer .trace')[traceIndex];
    const n = trace ? trace.querySelectorAll('.points path.point').length : 0;
    const seen = window.__points;
    if (!seen.length || seen[seen.length - 1] !== n) seen.push(n);
  }, 100);
}
"""


def quickstart_with(steps: int) -> nbformat.NotebookNode:
    nb = nbformat.read(ROOT / "notebooks" / "01-quickstart.ipynb", as_version=4)
    params = next(c for c in nb.cells if "OPENRL_DEMO_STEPS" in c.source)
    short = {"OPENRL_DEMO_STEPS": steps, "OPENRL_DEMO_SFT_STEPS": 20, "OPENRL_DEMO_BATCH": 8}
    for name, value in short.items():  # what the plot shows, not what the model learns: a short run
        params.source, n = re.subn(rf'os\.environ\.get\("{name}", \d+\)', str(value), params.source)
        assert n == 1, f"the quickstart's parameters cell has no {name}; update this test"
    return nb


def test_quickstart_reward_plot_grows_to_the_completed_steps(lab, page):
    nbformat.write(quickstart_with(STEPS), str(lab.root_dir / "quickstart.ipynb"))
    open_notebook(page, lab, "quickstart.ipynb")
    page.evaluate(RECORD, [f"{ACTIVE} .js-plotly-plot", REWARD_MEAN_TRACE])
    run_all(page, lab, timeout=600)
    assert wait_points(page, STEPS, lab, trace_index=REWARD_MEAN_TRACE) == STEPS
    seen = page.evaluate("() => { clearInterval(window.__pointsTimer); return window.__points; }")
    assert seen == sorted(seen) and seen[-1] == STEPS, f"drawn points over time: {seen}"
    assert len([n for n in seen if 0 < n < STEPS]) >= 1, f"the plot never showed a run in progress: {seen}"
    history = json.loads((lab.root_dir / "quickstart-history.json").read_text())["rl"]
    assert len(history) == STEPS  # what the run completed is what the plot shows
    text = page.locator("body").inner_text()
    assert "Error displaying widget" not in text, report(page, lab)
    assert not re.search(r"tml-[A-Za-z0-9_\-]{8,}", text), "a key is visible in the page"
    screenshot(page, "quickstart-lab")
