"""Small notebook runs on a shared server: prompts, sizes and a reward for them, and cleaning up."""

from __future__ import annotations

import contextlib

from openrl_jupyter import OpenRLError

PROMPTS = ["Name a colour:", "Say hello:", "Write a word:", "A city you like:"]
SMALL = {"batch": 2, "group": 4, "max_tokens": 8}  # a step of a few seconds on the tiny model


def letters(prompt, completion, **info):
    """The share of letters in the completion: a reward the tiny model can move."""
    return sum(c.isalpha() for c in completion) / max(1, len(completion))


def forget_runs(session) -> None:
    """Stop a session's runs and delete them on the service: the shared server's run quota is the
    same for every test, whatever ran before."""
    for run in session.runs.values():
        run.stop()
    for run in session.runs.values():
        with contextlib.suppress(OpenRLError):  # a run paused on an error or failed is done with too
            run.wait(120)
        if run.run_id is not None:
            with contextlib.suppress(OpenRLError):
                session.client.delete_run(run.run_id)
