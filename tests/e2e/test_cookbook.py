"""tinker-cookbook 0.5.8 (with tinker 0.38.0, in its own venv: `make cookbook-venv`) runs its recipes
unmodified against a service on loopback. The tokenizer comes from the service's hub mirror
(HF_ENDPOINT, HF_TOKEN = the API key, an empty HF_HOME); nothing else is reachable."""

from __future__ import annotations

import json
from pathlib import Path

from tests._support.clientenv import client_env, cookbook_python, run_client
from tests.conftest import ALICE_KEY, TINY


def _run_recipe(server, args: list[str], tmp_path: Path, log_path: Path) -> list[dict]:
    """Run a cookbook recipe in the cookbook venv against ``server``; its metrics.jsonl rows."""
    env = client_env(server.url, ALICE_KEY, tmp_path / "hf-home")
    proc = run_client(cookbook_python(), args, env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _rows(log_path / "metrics.jsonl")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _final_checkpoints_exist(server, log_path: Path) -> None:
    """The recipe's final save landed on this service: the run lists both checkpoints."""
    final = _rows(log_path / "checkpoints.jsonl")[-1]
    run_id = final["state_path"].removeprefix("tinker://").split("/")[0]
    listed = server.client().get(f"/api/v1/training_runs/{run_id}/checkpoints").json()["checkpoints"]
    paths = {c["tinker_path"] for c in listed}
    assert {final["state_path"], final["sampler_path"]} <= paths, (final, paths)


def test_math_rl_arithmetic_two_steps(make_server, tmp_path):
    server = make_server()
    log_path = tmp_path / "math_rl"
    args = [
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        "env=arithmetic",
        f"model_name={TINY}",
        "renderer_name=role_colon",
        "loss_fn=importance_sampling",
        "groups_per_batch=4",
        "group_size=4",
        "max_tokens=8",
        "max_steps=2",
        "eval_every=0",
        "save_every=0",
        "behavior_if_log_dir_exists=delete",
        f"base_url={server.url}",
        f"log_path={log_path}",
    ]
    rows = _run_recipe(server, args, tmp_path, log_path)
    assert len(rows) == 2, rows
    assert [r["progress/batch"] for r in rows] == [0, 1]
    for r in rows:
        assert r["env/all/total_episodes"] == 16  # 4 groups x 4 samples
        assert r["env/all/ac_tokens_per_turn"] <= 8
    _final_checkpoints_exist(server, log_path)


def test_supervised_chat_sl_from_a_local_jsonl(make_server, tmp_path):
    """The cookbook's SL recipe (chat_sl) reads conversations from a local file: no dataset hub needed."""
    server = make_server()
    data = tmp_path / "conversations.jsonl"
    with data.open("w") as f:
        for a in range(8):
            messages = [
                {"role": "user", "content": f"What is {a} + {a}?"},
                {"role": "assistant", "content": str(a + a)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    log_path = tmp_path / "chat_sl"
    args = [
        "-m",
        "tinker_cookbook.recipes.chat_sl.train",
        f"dataset={data}",
        f"model_name={TINY}",
        "renderer_name=role_colon",
        "batch_size=4",
        "max_length=256",
        "max_steps=2",
        "lora_rank=8",
        "learning_rate=1e-3",
        "save_every=0",
        "eval_every=0",
        "infrequent_eval_every=0",
        "behavior_if_log_dir_exists=delete",
        f"base_url={server.url}",
        f"log_path={log_path}",
    ]
    rows = _run_recipe(server, args, tmp_path, log_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["num_sequences"] == 4 and r["train_mean_nll"] > 0 for r in rows)
    _final_checkpoints_exist(server, log_path)
