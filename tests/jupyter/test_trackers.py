"""Runs log to the trackers labs use — W&B (offline), MLflow (a local SQLite store) and TensorBoard (event
files) — through the libraries themselves, and each library's own reader gets back what the run
recorded: every step's statistics, the config and the reward's source. A tracker that cannot start
never stops the run; the notebook side imports none of them (nor torch) until a run asks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrl_jupyter import session as sess
from openrl_jupyter.rewards import registry
from tests._support.runs import PROMPTS, SMALL, forget_runs, letters
from tests.conftest import ALICE_KEY
from tests.jupyter.test_run import unique

BIN = Path(sys.executable).parent


@pytest.fixture
def session(server, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-root"))
    monkeypatch.setenv("WANDB_PROJECT", "openrl-test")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "openrl-test")
    monkeypatch.setenv("OPENRL_TENSORBOARD_DIR", str(tmp_path / "tb"))
    for set_by_wandb in ("WANDB_SERVICE", "CRC32C_SW_MODE"):  # wandb exports these for its children
        monkeypatch.setenv(set_by_wandb, "")
        monkeypatch.delenv(set_by_wandb)  # ...and the test's end removes them again
    (tmp_path / "wandb-root").mkdir()
    monkeypatch.chdir(tmp_path)  # MLflow's artifacts land under ./mlruns
    s = sess.connect(server.url, token=ALICE_KEY, name="tracked")
    yield s
    forget_runs(s)
    sess.disconnect("tracked")


def scored(prompt, completion, **info):
    """A reward whose source the trackers keep."""
    return letters(prompt, completion)


def test_every_tracker_reads_back_the_runs_history_config_and_reward(session, tmp_path):
    name = unique("tracked")
    registry.register(name, scored)
    run = session.train(
        reward=name, prompts=PROMPTS, steps=3, log=["wandb", "mlflow", "tensorboard"], **SMALL
    )
    run.wait(180)
    assert run.wait_logged(60)
    assert run.trackers == {"wandb": "closed", "mlflow": "closed", "tensorboard": "closed"}
    history = {row["step"]: row for row in run.history}
    assert sorted(history) == [1, 2, 3]

    # W&B: its own reader of the offline run's .wandb transaction log
    (run_dir,) = (tmp_path / "wandb-root" / "wandb").glob("offline-run-*")
    out = subprocess.run(
        [str(BIN / "wandb"), "leet", "inspect", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    logged = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(logged) == [1, 2, 3]
    for step, row in history.items():
        assert logged[step]["reward_mean"] == pytest.approx(row["reward_mean"])
        assert logged[step]["loss"] == pytest.approx(row["loss"])
    config = next(r["run"]["config"]["update"] for r in records if r["type"] == "run")
    assert config["run"] == run.name and config["rank"] == run.config.rank and config["steps"] == 3
    sources = [r for r in records if r["type"] == "config" and f"reward/{name}/v1" in json.dumps(r)]
    assert sources and "def scored" in json.dumps(sources[-1])
    assert next(r for r in records if r["type"] == "run")["run"]["project"] == "openrl-test"

    # MLflow: its client on the SQLite store
    import mlflow

    client = mlflow.tracking.MlflowClient()
    (found,) = client.search_runs(
        [client.get_experiment_by_name("openrl-test").experiment_id], f"tags.`openrl.run` = '{run.name}'"
    )
    metrics = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "reward_mean")}
    assert metrics == pytest.approx({s: r["reward_mean"] for s, r in history.items()})
    assert found.data.params["lr"] == str(run.config.lr) and found.info.status == "FINISHED"
    text = mlflow.artifacts.load_text(f"{found.info.artifact_uri}/rewards/{name}/v1.py")
    assert "def scored" in text

    # TensorBoard: its own EventAccumulator on the event files
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / run.name), size_guidance={SCALARS: 0})
    acc.Reload()
    events = {e.step: e.value for e in acc.Scalars("reward_mean")}
    assert events == pytest.approx({s: r["reward_mean"] for s, r in history.items()})
    assert f"reward/{name}" in acc.Tags()["tensors"] or f"reward/{name}" in str(acc.Tags())


def test_a_sweeps_runs_are_grouped_under_its_name(session, tmp_path):
    name = unique("swept")
    registry.register(name, scored)
    sweep = session.sweep(
        reward=name,
        prompts=PROMPTS,
        grid={"lr": [1e-3, 2e-3]},
        steps=1,
        name="sw",
        log="tensorboard",
        **SMALL,
    )
    sweep.wait(240)
    for r in sweep.runs:
        assert r.wait_logged(60)
    folders = sorted(p.name for p in (tmp_path / "tb" / "sw").iterdir())
    assert len(folders) == 2 and all(f.startswith("sw") for f in folders)


def test_a_tracker_that_cannot_start_is_reported_and_the_run_goes_on(session, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    name = unique("untracked")
    registry.register(name, scored)
    run = session.train(reward=name, prompts=PROMPTS, steps=2, log="wandb", **SMALL)
    run.wait(180)
    assert run.wait_logged(30)
    assert run.step == 2 and str(run.state) == "finished"
    assert run.trackers["wandb"].startswith("not logging: wandb is not installed")


def test_unknown_trackers_are_refused_before_the_run_starts(session, monkeypatch):
    name = unique("refused")
    registry.register(name, scored)
    with pytest.raises(Exception, match="unknown tracker 'neptune'"):
        session.train(reward=name, prompts=PROMPTS, steps=1, log=["neptune"], **SMALL)
    monkeypatch.setenv("OPENRL_LOG", "mlflow,bogus")
    with pytest.raises(Exception, match="unknown tracker 'bogus'"):
        session.train(reward=name, prompts=PROMPTS, steps=1, **SMALL)


def test_the_notebook_side_imports_no_tracker_and_no_torch_until_asked():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import openrl_jupyter, openrl_jupyter.trackers, openrl_jupyter.run\n"
        "from openrl_jupyter.config import make_config\n"
        "assert not {'wandb', 'mlflow', 'tensorboardX'} & set(sys.modules), sorted(sys.modules)\n"
        "from openrl_jupyter.trackers import KINDS\n"
        "import wandb, mlflow, tensorboardX\n"  # and each imports without torch
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENRL_LOG"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_reward_redefined_mid_run_is_logged_as_its_second_version(session, tmp_path):
    """The trackers keep each reward version's source, from the step it applies."""
    import threading

    name = unique("versions")
    first_step, release = threading.Event(), threading.Event()

    def gated(prompt, completion, **info):  # v1 holds the first step until v2 is registered
        first_step.set()
        assert release.wait(60)
        return letters(prompt, completion)

    registry.register(name, gated)
    run = session.train(reward=name, prompts=PROMPTS, steps=2, log="mlflow", **SMALL)
    assert first_step.wait(60)

    def second_version(prompt, completion, **info):
        return 0.5 + 0.5 * letters(prompt, completion)

    registry.register(name, second_version)
    release.set()
    run.wait(180)
    assert run.wait_logged(60)
    assert [r["reward_version"] for r in run.history] == [1, 2]
    import mlflow

    client = mlflow.tracking.MlflowClient()
    (found,) = client.search_runs(
        [client.get_experiment_by_name("openrl-test").experiment_id], f"tags.`openrl.run` = '{run.name}'"
    )
    versions = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "reward_version")}
    assert versions == {1: 1.0, 2: 2.0}
    v1 = mlflow.artifacts.load_text(f"{found.info.artifact_uri}/rewards/{name}/v1.py")
    v2 = mlflow.artifacts.load_text(f"{found.info.artifact_uri}/rewards/{name}/v2.py")
    assert "def gated" in v1 and "def second_version" in v2


def test_mlflow_file_store_works_offline_too(session, tmp_path, monkeypatch):
    """MLflow's file store (./mlruns), which MLflow 3.13+ keeps only behind MLFLOW_ALLOW_FILE_STORE."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    name = unique("filestore")
    registry.register(name, scored)
    run = session.train(reward=name, prompts=PROMPTS, steps=2, log="mlflow", **SMALL)
    run.wait(180)
    assert run.wait_logged(60) and run.trackers == {"mlflow": "closed"}
    import mlflow

    client = mlflow.tracking.MlflowClient()
    (found,) = client.search_runs(
        [client.get_experiment_by_name("openrl-test").experiment_id], f"tags.`openrl.run` = '{run.name}'"
    )
    steps = [m.step for m in client.get_metric_history(found.info.run_id, "reward_mean")]
    assert steps == [1, 2] and (tmp_path / "mlruns").is_dir()
