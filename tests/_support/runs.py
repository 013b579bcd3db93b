"""Cleaning up after tests that start notebook runs on a shared server."""

from __future__ import annotations

import contextlib

from openrl_jupyter import OpenRLError


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
