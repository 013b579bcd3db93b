"""Names the service and the notebook side agree on for runs and detached jobs, written once.

CONTROL_ACTIONS     what a run or a job can be told (POST .../control)
JOB_STATES          what a job's worker reports (POST /jobs/{id}/state)
TERMINAL_STATES     the job states that end it
JOB_NAME_PATTERN    a job's name (a regular expression; JOB_NAME_RE compiled)
WORKER_ARGV         the job worker's command after the interpreter (a local child and a pod run it)
MAX_REASON_CHARS    the longest reason a control may carry
LIMIT_SETTINGS      the limits of each model's capability entry and the setting that raises each
DEFAULT_LIMITS      their values when those settings are unset
"""

from __future__ import annotations

import re

CONTROL_ACTIONS = ("pause", "resume", "stop")
JOB_STATES = ("running", "finished", "failed", "stopped")
TERMINAL_STATES = ("finished", "failed", "stopped")
JOB_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
JOB_NAME_RE = re.compile(JOB_NAME_PATTERN)
WORKER_ARGV = ("-m", "openrl_jupyter.jobs", "worker")
MAX_REASON_CHARS = 200
# The losses of a notebook-API train step (the service's RL losses: every built-in one but
# cross_entropy; tests/test_layout.py holds it equal to openrl_service.training.losses).
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")
# What get_server_capabilities lists under each model's "limits" (the service enforces them; the
# notebook checks options against them in the cell): max_tokens a sample's new tokens (also bounded
# by the model's context), max_rank a LoRA rank, max_num_samples the samples per prompt (an RL group),
# max_prompts a native sample call's prompts, max_datums a train step's datums, max_stop_sequences a
# sample's stop strings. DEFAULT_LIMITS are openrl_service.config.Limits' defaults (tests/test_layout.py
# holds them equal): what a client assumes of a service too old to list its limits.
LIMIT_SETTINGS = {
    "max_tokens": "OPENRL_MAX_TOKENS",
    "max_rank": "OPENRL_MAX_RANK",
    "max_num_samples": "OPENRL_MAX_NUM_SAMPLES",
    "max_prompts": "OPENRL_MAX_DATUMS",
    "max_datums": "OPENRL_MAX_DATUMS",
    "max_stop_sequences": "OPENRL_MAX_STOP_SEQUENCES",
}
DEFAULT_LIMITS = {
    "max_tokens": 4096,
    "max_rank": 128,
    "max_num_samples": 128,
    "max_prompts": 4096,
    "max_datums": 4096,
    "max_stop_sequences": 16,
}


def control_problem(body: dict) -> tuple[str, str] | None:
    """Why a control body (``{"action": ..., "reason": ...}``) is not one a run or a job takes, as
    (field, message); None when it is. The service answers 400 naming the field, the lab's server
    extension refuses it before it leaves the notebook server."""
    action = body.get("action")
    if action not in CONTROL_ACTIONS:
        return "action", f"action must be one of {', '.join(CONTROL_ACTIONS)}; got {repr(action)[:100]}"
    reason = body.get("reason")
    if reason is not None and (not isinstance(reason, str) or not 0 < len(reason) <= MAX_REASON_CHARS):
        return (
            "reason",
            f"reason must be a string of 1-{MAX_REASON_CHARS} characters; got {repr(reason)[:100]}",
        )
    return None
