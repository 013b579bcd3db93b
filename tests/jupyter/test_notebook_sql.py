"""notebooks/03-text-to-sql.ipynb executed headless by nbclient in a real kernel, on the tiny model with a
handful of steps (plumbing only: the tiny model learns no SQL; `make recipe-sql` runs it on SmolLM2)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "03-text-to-sql.ipynb"
sys.path.insert(0, str(ROOT / "examples"))

from notebook_demo import execute  # noqa: E402

KEY_RE = re.compile(r"tml-[A-Za-z0-9_\-]{8,}")
SCORE_RE = re.compile(r"held-out execution match, (baseline|after SFT|after RL): ([0-9.]+) \((\d+)/(\d+)")
EVAL_N = 12


@pytest.mark.timeout(1200)  # ~30-60 s on an idle 2-core machine; CI machines may be shared
def test_sql_recipe_notebook_runs_every_phase_on_the_tiny_model(tmp_path):
    env = {
        "OPENRL_URL": "",  # an embedded service on the tiny model, started by the notebook
        "OPENRL_TOKEN": "",
        "OPENRL_SQL_MODEL": "openrl/tiny",
        "OPENRL_SQL_EVAL_N": str(EVAL_N),
        "OPENRL_SQL_SFT_STEPS": "4",
        "OPENRL_SQL_SFT_BATCH": "4",
        "OPENRL_SQL_RL_STEPS": "2",
        "OPENRL_SQL_RL_GROUP": "4",
        "OPENRL_SQL_RL_BATCH": "2",
        "OPENRL_SQL_MAX_TOKENS": "24",
        "OPENRL_SQL_OUT": str(tmp_path),
    }
    nb = execute(NOTEBOOK, tmp_path, env, timeout_s=900)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert re.search(
        r"connected to your embedded service \(pid \d+, it stops with this kernel\) at http://127", text
    )
    assert (
        "its data (checkpoints, the key, service.log) stay in" in text
    )  # the test's own OPENRL_LOCAL_DATA_DIR

    # each phase printed its held-out score, on the same number of questions
    printed = {m.group(1): m for m in SCORE_RE.finditer(text)}
    assert list(printed) == ["baseline", "after SFT", "after RL"], text[-2000:]
    # lm-evaluation-harness asked the OpenAI endpoint the same questions and scored the same answers
    harness = re.search(r"lm-evaluation-harness through the OpenAI endpoint, after RL: ([0-9.]+)", text)
    assert harness, text[-2000:]
    assert float(harness.group(1)) == pytest.approx(float(printed["after RL"].group(2)), abs=1e-3)
    for m in printed.values():
        assert 0.0 <= float(m.group(2)) <= 1.0 and int(m.group(4)) == EVAL_N
        assert int(m.group(3)) / EVAL_N == pytest.approx(float(m.group(2)), abs=1e-3)
    assert "text-to-SQL held-out execution match: baseline" in text

    results = json.loads((tmp_path / "sql-results.json").read_text())
    assert list(results["scores"]) == ["baseline", "after SFT", "after RL"] and results["eval_n"] == EVAL_N
    assert results["lm_eval_after_rl"] == pytest.approx(results["scores"]["after RL"])
    # SFT went through the Tinker SDK's cross_entropy: 4 finite losses, the last below the first
    losses = results["sft_losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert re.search(r"SFT checkpoint: tinker://\S+/weights/sql-sft", text)
    # RL trained with the sql reward, from the SFT checkpoint
    history = results["rl_history"]
    assert results["rl_steps"] == 2 and [h["step"] for h in history] == [1, 2]
    # every sample of both steps was scored by the sql reward (the tiny model writes no valid SQL, so
    # its rewards are 0 and no sample carries an advantage: `make recipe-sql` is where updates happen)
    assert {h["reward_name"] for h in history} == {"sql"}
    assert all(h["n"] == 4 * 2 and h["failed"] == 0 and 0.0 <= h["reward_mean"] <= 1.0 for h in history)
    assert "openrl: reward sql v1 registered" in text

    # the example table: questions with the gold SQL and each phase's answer
    assert 1 <= len(results["examples"]) <= 8
    for row in results["examples"]:
        assert row["question"] and row["gold"].startswith("SELECT")
        assert all(row[k][:2] in ("✓ ", "✗ ") for k in ("baseline", "after SFT", "after RL"))
    table = nb.cells[-2].outputs[-1]["data"]
    assert "<table" in table["text/html"] and table["text/html"].count("<tr") == len(results["examples"]) + 1

    assert not KEY_RE.search((tmp_path / NOTEBOOK.name).read_text()), (
        "a key leaked into the executed notebook"
    )
    nbformat.validate(nb)


def test_load_from_must_be_a_tinker_path_and_reaches_create_run():
    from openrl_jupyter import UsageError
    from openrl_jupyter.config import make_config

    prompts = [{"prompt": "q", "sql": "SELECT 1", "db_id": "shop"}]
    with pytest.raises(UsageError, match="load_from must be a tinker:// checkpoint path"):
        make_config({}, reward=lambda p, c, **i: 0.0, prompts=prompts, load_from="/tmp/sft")
    config = make_config(
        {}, reward=lambda p, c, **i: 0.0, prompts=prompts, load_from="tinker://r/weights/sft"
    )
    assert config.extra == {"load_from": "tinker://r/weights/sft"}  # Run._create sends it with create_run
    assert make_config({}, reward=lambda p, c, **i: 0.0, prompts=prompts).extra == {}
