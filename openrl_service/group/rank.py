"""A rank other than 0: load the models rank 0 posts, form the group, then follow rank 0's commands."""

from __future__ import annotations

import logging
import signal

import torch

from openrl_service.group.comm import Group
from openrl_service.group.trainer import Follower

log = logging.getLogger("openrl.group")


def follower_main(settings) -> int:
    """Serve no HTTP and hold no lock: rank 0 decides everything. SIGTERM and SIGINT are left to rank
    0 (its drain ends with a ``stop`` to every rank); the supervisor's death kills this process."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if settings.group_log_commands:  # every command a rank executes, in the log
        log.setLevel(logging.DEBUG)
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    group = Group.from_env(timeout_s=settings.group_timeout_s)
    models = group.form()  # waits for rank 0's models, then loads the same here
    follower = Follower(group, load_trainers(settings, group, models))
    group.formed()
    group.follow(follower.execute)
    log.info("rank %d: stopped by rank 0", group.rank)
    return 0


def load_trainers(settings, group: Group, models: list[dict]) -> dict:
    """The same models as rank 0 (``models``: its entries and its trainers' micro-batch size), on this
    rank's device, each with a plain :class:`Trainer`."""
    from openrl_service.models.loading import load_base_model
    from openrl_service.training.trainer import Trainer

    trainers = {}
    for m in models:
        base = load_base_model(
            m["spec"], data_dir=settings.data_dir, name=m["name"], device=str(group.device)
        )
        trainer = Trainer(base, microbatch_tokens=m["microbatch_tokens"])
        trainer.microbatch_tokens = m["microbatch_tokens"]
        trainers[base.name] = trainer
    return trainers
