"""The Tinker SDK's own `tinker` CLI, run as a user runs it (TINKER_BASE_URL and TINKER_API_KEY in its
environment) against a real service: models, runs, checkpoint list/info/download/delete, each tenant
seeing only its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests._support.clientenv import client_env
from tests.conftest import ALICE_KEY, BOB_KEY, TINY

CLI = Path(sys.executable).parent / "tinker"


def cli(server, tmp_path: Path, *args: str, key: str = ALICE_KEY) -> subprocess.CompletedProcess:
    env = client_env(server.url, key, tmp_path / "hf", TINKER_BASE_URL=server.url)
    return subprocess.run(
        [str(CLI), *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )


def as_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def saved(server):
    """One of alice's runs with a training checkpoint and a sampler checkpoint."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    seq = list(b"the cli sees this")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    weights = tc.save_state("cli-state").result().path
    sampler = tc.save_weights_for_sampler("cli-sampler").result().path
    yield tc.model_id, weights, sampler
    sc.close("success").result()


def test_the_tinker_cli_lists_models_runs_and_checkpoints(server, saved, tmp_path):
    if not CLI.is_file():
        pytest.skip(f"{CLI} is missing: the tinker SDK installs it (make venv)")
    run_id, weights, sampler = saved
    models = as_json(cli(server, tmp_path, "-f", "json", "model", "list"))
    assert TINY in json.dumps(models)
    runs = as_json(cli(server, tmp_path, "-f", "json", "run", "list", "--limit", "0"))
    assert run_id in json.dumps(runs)
    info = as_json(cli(server, tmp_path, "-f", "json", "run", "info", run_id))
    assert run_id in json.dumps(info) and TINY in json.dumps(info)
    listed = json.dumps(
        as_json(cli(server, tmp_path, "-f", "json", "checkpoint", "list", "--run-id", run_id))
    )
    assert weights in listed and sampler in listed
    one = as_json(cli(server, tmp_path, "-f", "json", "checkpoint", "info", weights))
    assert weights in json.dumps(one)
    # the table format (the default) prints the same checkpoints for a person to read
    table = cli(server, tmp_path, "checkpoint", "list", "--run-id", run_id)
    assert table.returncode == 0 and "cli-state" in table.stdout and "cli-sampler" in table.stdout


def test_the_tinker_cli_downloads_and_deletes_a_checkpoint(server, saved, tmp_path):
    if not CLI.is_file():
        pytest.skip(f"{CLI} is missing: the tinker SDK installs it (make venv)")
    run_id, weights, sampler = saved
    got = cli(server, tmp_path, "checkpoint", "download", weights, "--output", str(tmp_path / "out"))
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    files = {p.name for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert "adapter_config.json" in files and any(f.endswith(".safetensors") for f in files), files
    # bob sees none of alice's runs and cannot delete her checkpoint
    assert run_id not in cli(server, tmp_path, "-f", "json", "run", "list", key=BOB_KEY).stdout
    refused = cli(server, tmp_path, "checkpoint", "delete", sampler, "-y", key=BOB_KEY)
    assert "not found" in refused.stdout + refused.stderr  # the CLI reports it per path (and exits 0)
    assert sampler in json.dumps(
        as_json(cli(server, tmp_path, "-f", "json", "checkpoint", "list", "--run-id", run_id))
    )
    gone = cli(server, tmp_path, "checkpoint", "delete", sampler, "-y")
    assert gone.returncode == 0, gone.stdout[-2000:] + gone.stderr[-2000:]
    listed = json.dumps(
        as_json(cli(server, tmp_path, "-f", "json", "checkpoint", "list", "--run-id", run_id))
    )
    assert sampler not in listed and weights in listed
