"""A notebook with a live run dashboard, saved with its widget state, stays light (issue 23, part 7).

nbclient stores the state of every widget in ``metadata.widgets`` (as ``make demo`` runs it, and as
JupyterLab saves a notebook with "save widget state" on). plotly's FigureWidget put its 5 MB plotly.js
bundle there: a 60-step quickstart saved at 5 MB. The dashboard's figure now gets that code as a
message, and its output carries a static fallback (the final summary and an SVG of the curves) for
readers without widgets or without the kernel.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from notebook_demo import execute  # noqa: E402

LIMIT_KB = 300
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"

CELLS = [
    "%load_ext openrl_jupyter\n%openrl connect --local",
    "%%openrl reward letters\ndef reward(prompt, completion, **info):\n"
    "    return sum(c.isalpha() for c in completion) / max(1, len(completion))",
    "PROMPTS = ['Name a colour:', 'Say hello:', 'Write a word:', 'A city you like:']",
    "run = %openrl train --reward letters --prompts PROMPTS --steps 4 --group 4 --batch 2 --max-tokens 8 --name light\nrun",
    "run.wait(timeout=300)\nprint(run.state, run.step)",
    "%openrl disconnect",
]


def test_a_notebook_with_a_run_dashboard_saved_with_widget_state_stays_light(tmp_path):
    src = tmp_path / "light.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS]), src)
    nb = execute(src, tmp_path / "out", {}, timeout_s=600)
    saved = tmp_path / "out" / "light.ipynb"
    assert "finished 4" in "".join(o.get("text", "") for o in nb.cells[4].outputs)

    state = nb.metadata["widgets"][WIDGET_STATE]["state"]  # what a reopened notebook rebuilds widgets from
    size_kb = saved.stat().st_size / 1024
    biggest = max(state.values(), key=lambda w: len(json.dumps(w)))
    assert size_kb < LIMIT_KB, (
        f"the saved notebook is {size_kb:.0f} KB; its largest widget is {biggest['model_name']} "
        f"({len(json.dumps(biggest)) / 1024:.0f} KB)"
    )
    (figure,) = [w["state"] for w in state.values() if w["model_name"] == "AnyModel"]
    assert len(figure["_esm"]) < 20_000, "plotly.js is in the figure's saved state"
    assert "data:image/svg+xml;base64," in figure["_fallback_html"]  # drawn without the kernel

    # the dashboard's output: the live widget, and a static fallback of the finished run beside it
    (shown,) = [o for o in nb.cells[3].outputs if WIDGET_VIEW in o.get("data", {})]
    plain, rich = shown["data"]["text/plain"], shown["data"]["text/html"]
    assert plain.startswith("openrl run 'light': finished, step 4/4, letters v1 mean ")
    assert "finished" in rich and "step 4/4" in rich
    encoded = rich.split("data:image/svg+xml;base64,", 1)[1].split("'", 1)[0]
    picture = base64.b64decode(encoded).decode()
    assert picture.startswith("<svg") and "reward" in picture and "<polyline" in picture
    nbformat.validate(nb)
