"""A rank other than 0: join the group, load the models when rank 0 says, then follow its commands."""

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
    group = Group.join(timeout_s=settings.group_timeout_s)
    follower: Follower | None = None

    def execute(name: str, payload: dict):
        nonlocal follower
        if name == "setup":
            follower = Follower(group, load_trainers(settings, group, payload))
            return None
        if follower is None:
            return None  # a ping before the models are up
        return follower.execute(name, payload)

    group.follow(execute)
    log.info("rank %d: stopped by rank 0", group.rank)
    return 0


def load_trainers(settings, group: Group, payload: dict) -> dict:
    """The same models as rank 0 (``payload["models"]``: its entries and its trainers' micro-batch
    size), on this rank's device, each with a plain :class:`Trainer`."""
    from openrl_service.models.loading import load_base_model
    from openrl_service.training.trainer import Trainer

    trainers = {}
    for m in payload["models"]:
        base = load_base_model(
            m["spec"], data_dir=settings.data_dir, name=m["name"], device=str(group.device)
        )
        trainer = Trainer(base, microbatch_tokens=m["microbatch_tokens"])
        trainer.microbatch_tokens = m["microbatch_tokens"]
        trainers[base.name] = trainer
    return trainers
