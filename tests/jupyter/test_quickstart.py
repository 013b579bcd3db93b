"""notebooks/01-quickstart.ipynb executed headless by nbclient in a real kernel, as `make demo` does."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from notebook_demo import NOTEBOOK, execute  # noqa: E402

KEY_RE = re.compile(r"tml-[A-Za-z0-9_\-]{8,}")


@pytest.mark.timeout(2400)  # ~1-2 min on an idle 2-core machine; CI machines may be shared
def test_quickstart_notebook_learns_and_leaks_no_key(tmp_path):
    nb = execute(NOTEBOOK, tmp_path, {"OPENRL_DEMO_STEPS": "60", "OPENRL_DEMO_OUT": str(tmp_path)})
    history = json.loads((tmp_path / "quickstart-history.json").read_text())
    assert [h["step"] for h in history] == list(range(1, 61))
    means = [h["reward_mean"] for h in history]
    gain = statistics.fmean(means[-5:]) - statistics.fmean(means[:5])
    assert gain >= 0.3, f"mean reward rose by only {gain:.2f} over 60 steps"
    # the mid-run edit of the reward cell took effect at a step boundary, and nothing was lost
    versions = [h["reward_version"] for h in history]
    switch = versions.index(2)
    assert versions == [1] * switch + [2] * (60 - switch) and switch >= 20
    assert (tmp_path / "quickstart-reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    saved = (tmp_path / NOTEBOOK.name).read_text()
    assert not KEY_RE.search(saved), "a key leaked into the executed notebook"
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    run_cell = next(c for c in nb.cells if c.source.startswith("run = %openrl train"))
    bundle = run_cell.outputs[-1]["data"]
    assert "application/vnd.jupyter.widget-view+json" in bundle  # the live dashboard
    assert "quick" in bundle["text/html"] and "quick" in bundle["text/plain"]  # the fallback
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert re.search(
        r"connected to your embedded service \(pid \d+, it stops with this kernel\) at http://127", text
    )
    assert (
        "its data (checkpoints, the key, service.log) stay in" in text
    )  # the test's own OPENRL_LOCAL_DATA_DIR
    assert re.search(r"tinker://\S+/weights/quick-paused", text)
    assert "demo: mean reward" in text
    nbformat.validate(nb)
