"""notebooks/01-quickstart.ipynb executed headless by nbclient in a real kernel, as `make demo` does."""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from notebook_demo import NOTEBOOK, execute  # noqa: E402

KEY_RE = re.compile(r"tml-[A-Za-z0-9_\-]{8,}")


WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.mark.timeout(2400)  # ~3 min on an idle 2-core machine; CI machines may be shared
def test_quickstart_notebook_learns_to_add_and_leaks_no_key(tmp_path):
    """The notebook as `make demo` runs it, with its own defaults: a warm start, then RL, then a quiz."""
    nb = execute(NOTEBOOK, tmp_path, {"OPENRL_DEMO_OUT": str(tmp_path)})
    result = json.loads((tmp_path / "quickstart-history.json").read_text())
    sft, history = result["sft"], result["rl"]
    assert sft[0]["loss"] > 3 and sft[-1]["loss"] < 0.6, "the warm start did not learn the sums"
    steps = [h["step"] for h in history]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 20
    # what the model learned: greedy answers to all 100 sums, and the quiz printed at the end
    evals = [h["eval_reward"] for h in history if h.get("eval_reward") is not None]
    assert evals[-1] >= 0.9, f"greedy accuracy on the 100 sums after RL: {evals}"
    right, asked = result["quiz"]
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    quiz = [
        line.split() for line in text.splitlines() if re.fullmatch(r"\d\+\d=\s+\S+\s+(right|WRONG)", line)
    ]
    assert len(quiz) == asked == 8 and right == sum(q[2] == "right" for q in quiz)
    for prompt, answer, verdict in quiz:  # every verdict is the sum's own
        assert (verdict == "right") == (answer == str(eval(prompt[:-1])))
    assert right >= 7, f"the quiz after RL: {quiz}"
    # the mid-run edit of the reward cell took effect at a step boundary, and nothing was lost
    versions = [h["reward_version"] for h in history]
    switch = versions.index(2)
    assert versions == [1] * switch + [2] * (len(versions) - switch) and switch >= len(versions) // 3
    assert all(h["kl_ref"] is not None for h in history)  # the KL panel has a line that moves
    assert max(h["kl_ref"] for h in history) > 0
    assert (tmp_path / "quickstart-reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    saved = (tmp_path / NOTEBOOK.name).read_text()
    assert not KEY_RE.search(saved), "a key leaked into the executed notebook"
    assert not [o for o in outputs if o.output_type == "error"]
    drawn = [c for c in nb.cells if any(WIDGET in o.get("data", {}) for o in c.get("outputs", []))]
    assert [c.source.splitlines()[0] for c in drawn] == [
        next(c for c in nb.cells if c.source.startswith("run = %openrl train")).source.splitlines()[0]
    ], "the run's dashboard is drawn once, by the cell that starts it"
    bundle = drawn[0].outputs[-1]["data"]
    assert "adder" in bundle["text/html"] and "adder" in bundle["text/plain"]  # the fallback
    picture = base64.b64decode(bundle["text/html"].split("base64,", 1)[1].split("'", 1)[0]).decode()
    assert "(x: seconds)" in picture and ">eval<" in picture  # utilisation and the greedy evaluation
    assert re.search(
        r"connected to your embedded service \(pid \d+, it stops with this kernel\) at http://127", text
    )
    assert "its data (checkpoints, the key, service.log) stay in" in text  # the test's OPENRL_LOCAL_DATA_DIR
    assert re.search(r"tinker://\S+/weights/adder-paused", text)
    assert "demo: mean reward" in text and "greedy accuracy" in text
    nbformat.validate(nb)
