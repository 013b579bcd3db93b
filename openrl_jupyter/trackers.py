"""Experiment tracking: a run's config, per-step history and reward versions, logged to the trackers labs
use, through the libraries themselves.

    session.train(reward="r", prompts=p, log=["wandb", "mlflow", "tensorboard"])
    %openrl train --reward r --prompts p --log mlflow --log tensorboard
    OPENRL_LOG=wandb,mlflow                                  # the default for every run of the kernel

    wandb        a W&B run (project $WANDB_PROJECT, else "openrl"; a sweep's runs share its name as
                 their group). Offline with WANDB_MODE=offline: the history stays in the run's .wandb
                 file until ``wandb sync``.
    mlflow       an MLflow run under experiment $MLFLOW_EXPERIMENT_NAME, else "openrl", in the store
                 $MLFLOW_TRACKING_URI names (MLflow's default: ./mlflow.db, a local SQLite file).
    tensorboard  event files under $OPENRL_TENSORBOARD_DIR, else ./runs, one folder per run (a sweep's
                 runs in a folder of the sweep's name), written with tensorboardX (no torch).

Each library is imported only when a run asks for it; none of them needs torch. The calls happen on one
thread per run, never on the thread that trains, so a slow tracker (a network W&B) never delays a step;
a tracker that fails is reported once in the run's log and left out, and the run goes on.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from openrl_jupyter._exceptions import UsageError

log = logging.getLogger(__name__)

NAMES = ("wandb", "mlflow", "tensorboard")
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow (or mlflow-skinny)", "tensorboard": "tensorboardX"}
PROJECT = "openrl"
FLUSH_TIMEOUT_S = 60.0


def parse(value: str | Iterable[str] | None, *, where: str = "log") -> tuple[str, ...]:
    """The trackers asked for: a name, a comma-separated string or a list; None: $OPENRL_LOG."""
    if value is None:
        value = os.environ.get("OPENRL_LOG", "")
    items = re.split(r"[,\s]+", value) if isinstance(value, str) else list(value)
    names = []
    for item in items:
        if not isinstance(item, str):
            raise UsageError(f"{where} must be tracker names ({', '.join(NAMES)}); got {item!r}")
        name = item.strip().lower()
        if not name:
            continue
        if name not in NAMES:
            raise UsageError(f"{where}: unknown tracker {item!r}; one of {', '.join(NAMES)}")
        if name not in names:
            names.append(name)
    return tuple(names)


def _scalars(row: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def reward_source(fn: Callable | None) -> str | None:
    try:
        return inspect.getsource(fn) if fn is not None else None
    except (OSError, TypeError):
        return None


class _Wandb:
    def __init__(self, name: str, config: dict, group: str | None):
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or PROJECT,
            name=name,
            group=group,
            config=config,
            reinit="create_new",
        )

    def step(self, step: int, row: dict) -> None:
        self.run.log(_scalars(row), step=step)

    def reward(self, name: str, version: int, source: str | None) -> None:
        self.run.config.update(
            {f"reward/{name}/v{version}": source or "(source not available)"}, allow_val_change=True
        )

    def finish(self, state: str) -> None:
        self.run.summary["state"] = state
        self.run.finish(exit_code=0 if state == "finished" else 1)


class _MLflow:
    def __init__(self, name: str, config: dict, group: str | None):
        import mlflow

        self.mlflow = mlflow
        self.client = mlflow.tracking.MlflowClient()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        tags = {"mlflow.runName": name, "openrl.run": name}
        if group:
            tags["openrl.sweep"] = group
        self.run_id = self.client.create_run(experiment_id, tags=tags, run_name=name).info.run_id
        params = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in config.items()]
        self.client.log_batch(self.run_id, params=params)

    def step(self, step: int, row: dict) -> None:
        now = int(time.time() * 1000)
        metrics = [self.mlflow.entities.Metric(k, v, now, step) for k, v in _scalars(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def reward(self, name: str, version: int, source: str | None) -> None:
        self.client.log_text(self.run_id, source or "(source not available)", f"rewards/{name}/v{version}.py")

    def finish(self, state: str) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if state == "finished" else "FAILED")


class _TensorBoard:
    def __init__(self, name: str, config: dict, group: str | None):
        from tensorboardX import SummaryWriter

        root = os.environ.get("OPENRL_TENSORBOARD_DIR") or "runs"
        self.logdir = os.path.join(root, *([group] if group else []), name)
        self.writer = SummaryWriter(logdir=self.logdir)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in config.items()), 0)

    def step(self, step: int, row: dict) -> None:
        for k, v in _scalars(row).items():
            self.writer.add_scalar(k, v, step)

    def reward(self, name: str, version: int, source: str | None) -> None:
        text = "\n".join("    " + line for line in (source or "(source not available)").splitlines())
        self.writer.add_text(f"reward/{name}", text, version)

    def finish(self, state: str) -> None:
        self.writer.add_text("state", state, 0)
        self.writer.close()


KINDS = {"wandb": _Wandb, "mlflow": _MLflow, "tensorboard": _TensorBoard}


class Trackers:
    """One run's trackers, fed from a queue by their own thread; ``say(text)`` reports a failure."""

    def __init__(
        self, names: tuple[str, ...], name: str, config: dict, group: str | None, say: Callable[[str], None]
    ):
        self.names, self._say = names, say
        self.status = dict.fromkeys(names, "starting")  # name -> "logging", "closed", or why it stopped
        self._queue: queue.Queue = queue.Queue()
        self._live: dict[str, Any] = {}
        self._versions: set[tuple[str, int]] = set()
        self._thread = threading.Thread(
            target=self._work, args=(name, config, group), daemon=True, name=f"openrl-log-{name}"
        )
        self._thread.start()

    @classmethod
    def for_run(cls, run: Any) -> Trackers:
        """The trackers ``run.config.log`` names, given the run's config (a sweep's runs: its name as
        their group)."""
        c = run.config
        fields = ("reward", "steps", "group", "batch", "lr", "rank", "max_tokens", "temperature", "loss")
        config = {
            "run": run.name,
            "run_id": run.run_id,
            "model": run.model,
            "service": run.session.url,
            **{f: getattr(c, f) for f in fields},
            "normalize_std": c.normalize_std,
            "seed": c.seed,
            "overlap": c.overlap,
            "prompts": len(c.prompts),
            **({"load_from": c.extra["load_from"]} if c.extra.get("load_from") else {}),
        }
        group = (c.extra.get("user_metadata") or {}).get("openrl.sweep")
        return cls(c.log, run.name, config, group, run._log)

    def step(self, row: dict, reward: tuple[str, int, Callable | None] | None = None) -> None:
        if reward is not None and reward[:2] not in self._versions:
            self._versions.add(reward[:2])
            self._queue.put(("reward", (reward[0], reward[1], reward_source(reward[2]))))
        self._queue.put(("step", (int(row["step"]), dict(row))))

    def finish(self, state: str) -> None:
        """Close every tracker after what was queued (``wait`` waits for it)."""
        self._queue.put(("finish", (state,)))

    def wait(self, timeout: float | None = FLUSH_TIMEOUT_S) -> bool:
        """Whether every tracker has written what it was given and closed, waiting up to ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _work(self, name: str, config: dict, group: str | None) -> None:
        for kind in self.names:
            try:
                self._live[kind] = KINDS[kind](name, config, group)
                self.status[kind] = "logging"
            except ImportError:
                self._fail(kind, f"{PACKAGES[kind]} is not installed in this kernel (pip install it)")
            except Exception as e:  # noqa: BLE001 - a tracker must never stop the run
                self._fail(kind, f"could not start ({type(e).__name__}: {e})")
        while True:
            what, args = self._queue.get()
            for kind, tracker in list(self._live.items()):
                try:
                    getattr(tracker, what)(*args)
                except Exception as e:  # noqa: BLE001
                    self._fail(kind, f"{what} failed ({type(e).__name__}: {e})")
                    del self._live[kind]
            if what == "finish":
                for kind in self._live:
                    self.status[kind] = "closed"
                return

    def _fail(self, kind: str, why: str) -> None:
        self.status[kind] = f"not logging: {why}"
        self._say(f"--log {kind}: {why}; not logging there")
