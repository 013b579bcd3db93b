"""The worker (``python -m openrl_jupyter.jobs worker``): runs a job's Run or Sweep to its end."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from openrl_jupyter._exceptions import NotFoundError, OpenRLError
from openrl_jupyter.jobs.common import EXIT_FAILED, EXIT_TERMINATED, WORKER_POLL_S
from openrl_jupyter.jobs.payload import decode
from openrl_jupyter.rewards import registry


# -- the worker ---------------------------------------------------------------------------------------
def _log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} openrl job: {text}", flush=True)


def step_line(row: dict, name: str | None, total: int | None) -> str:
    """One step of a run as the job's log shows it:
    ``letters-long step 3/20: reward 0.250 (min 0, max 1, 1 failed) loss 0.0123, by letters v2, 1.4 s``."""

    def num(key: str, fmt: str = ".3g") -> str | None:
        v = row.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    parts = [f"{name or 'run'} step {row.get('step', '?')}/{total or '?'}:"]
    if num("reward_mean") is not None:
        spread = ", ".join(
            f"{label} {num(key)}" for label, key in (("min", "reward_min"), ("max", "reward_max")) if num(key)
        )
        failed = row.get("failed")
        if failed:
            spread += f", {failed} failed"
        parts.append(f"reward {num('reward_mean', '.3f')}" + (f" ({spread})" if spread else ""))
    if num("loss") is not None:
        parts.append(f"loss {num('loss', '.4g')}")
    if not row.get("trained", True):
        parts.append("(nothing trained: no sample had an advantage)")
    tail = []
    if row.get("reward_name"):
        tail.append(f"by {row['reward_name']} v{row.get('reward_version') or '-'}")
    if num("elapsed_s") is not None:
        tail.append(f"{num('elapsed_s', '.1f')} s")
    return " ".join(parts) + (f", {', '.join(tail)}" if tail else "")


class _NoFeed:
    """The worker's stand-in for the session's event feed (no dashboard runs in a job)."""

    last_tick = None
    last_error = None

    def subscribe(self, fn: Callable[[dict], None]) -> Callable[[], None]:
        return lambda: None

    def close(self) -> None:
        pass


def paused_error_limit_s() -> float:
    """How long a job's run may stay paused on an error before the job fails
    (``OPENRL_JOB_PAUSED_ERROR_S``, default 600)."""
    try:
        return float(os.environ.get("OPENRL_JOB_PAUSED_ERROR_S", "600"))
    except ValueError:
        return 600.0


class _JobGone(Exception):
    """The job was deleted or its key revoked: nothing can be reported any more."""


class _Worker:
    def __init__(self, url: str, token: str, job_id: str):
        from openrl_jupyter.client import Client

        self.url, self.token, self.job_id = url, token, job_id
        self.client = Client(url, token=token)
        self.seen = 0
        self.target: Any = None
        self.terminated: str | None = None
        self.gone: str | None = None
        self._poke = threading.Event()  # set after each step (the runner thread does nothing more)
        self._paused_since: float | None = None
        self._paused_reported: str | None = None

    def _job_call(self, fn: Callable[[], Any]) -> Any:
        """A request about the job itself: 401/404 mean the job was deleted or its key revoked."""
        from openrl_jupyter._exceptions import AuthenticationError

        try:
            return fn()
        except (AuthenticationError, NotFoundError) as exc:
            self.gone = str(exc)
            raise _JobGone(str(exc)) from None

    def report(self, state: str, message: str | None = None, **fields: Any) -> None:
        if message is not None:
            fields["message"] = message[:2000]
        self._job_call(lambda: self.client.job_state(self.job_id, state, **fields))

    def poll(self) -> None:
        """Fetch and apply the payload versions sent since the last poll (the main loop's thread)."""
        try:
            versions = self._job_call(lambda: self.client.payloads(self.job_id, after=self.seen))
        except OpenRLError as exc:
            _log(f"could not fetch new payloads: {exc}")
            return
        self.apply(versions)

    def _on_event(self, event: dict, run: Any = None) -> None:
        # on the runner thread: a line in the job's log and a flag; the main loop polls the service
        # (a slow service stalls no run)
        kind = event.get("kind")
        name = getattr(run, "name", None)
        if kind == "step":
            _log(step_line(event.get("row") or {}, name, getattr(run, "total_steps", None)))
            self._poke.set()
        elif kind == "state":
            error = event.get("error")
            _log(f"{name}: {event.get('state')}" + (f": {error}" if error else ""))
        elif kind == "log":
            _log(f"{name}: {event.get('text')}")

    def apply(self, versions: list[dict], strict: bool = False) -> dict | None:
        """Register the rewards of new payload versions; the first job payload's body, if among them.
        A version that cannot be loaded is skipped (reported in the job's message) unless ``strict``."""
        first = None
        for entry in sorted(versions, key=lambda e: e["version"]):
            number = int(entry["version"])
            self.seen = max(self.seen, number)  # a version that fails is not tried again
            try:
                body = decode(entry)
            except Exception as exc:  # noqa: BLE001 - a bad new version must not end the run
                if strict:
                    raise
                text = f"payload v{number} could not be loaded: {type(exc).__name__}: {exc}"
                _log(text)
                with contextlib.suppress(OpenRLError):
                    self.report("running", text)
                continue
            if body.get("type") == "job":
                first = body
            for r in body.get("rewards") or []:
                if r.get("pinned"):
                    continue
                v = registry.register(r["name"], r["fn"], per_group=r["per_group"], version=r.get("version"))
                if body.get("type") == "reward":
                    _log(f"payload v{number}: reward {r['name']} v{v.version} applies from the next step")
        return first

    def control(self) -> str | None:
        """The job's recorded control action (stop, pause, resume), from its entry."""
        job = self._job_call(lambda: self.client.get_job(self.job_id))
        return (job.get("control") or {}).get("action")

    def _runs(self) -> list:
        if self.target is None:
            return []
        return [self.target] if not hasattr(self.target, "runs") else list(self.target.runs)

    def _check_paused_on_error(self) -> str | None:
        """Report a run paused on an error in the job's message; its failure message once it stayed
        paused ``OPENRL_JOB_PAUSED_ERROR_S``."""
        paused = [r for r in self._runs() if r._paused_on_error and not r.done]
        if not paused:
            self._paused_since = self._paused_reported = None
            return None
        run = paused[0]
        text = f"paused on error: {run.name}: {run.last_error}"
        now = time.monotonic()
        if self._paused_since is None:
            self._paused_since = now
        if self._paused_reported != text:
            self._paused_reported = text
            _log(text)
            with contextlib.suppress(OpenRLError):
                self.report("running", text)
        limit = paused_error_limit_s()
        if now - self._paused_since >= limit:  # the limit first: a long error is cut at 2000 chars
            return (
                f"paused on error for {limit:g} s (OPENRL_JOB_PAUSED_ERROR_S): {run.name}: {run.last_error}"
            )
        return None

    def run(self) -> int:
        from openrl_jupyter.run import RunState
        from openrl_jupyter.session import connect

        job = self._job_call(lambda: self.client.get_job(self.job_id))
        _log(f"job {job['name']} ({self.job_id}, {job.get('kind')}) on {self.url}, pid {os.getpid()}")
        meta = job.get("meta") or {}
        check_versions(meta)
        body = self.apply(self._job_call(lambda: self.client.payloads(self.job_id, after=0)), strict=True)
        if body is None:
            raise OpenRLError("the job has no job payload (version 1)")
        if (job.get("control") or {}).get("action") == "stop":  # stopped before it started
            message = "stopped before it started"
            _log(message)
            self.report("stopped", message)
            return 0
        session = connect(self.url, token=self.token, name=f"job-{self.job_id}")
        session.labels = {"openrl.job": self.job_id}
        session._feed = _NoFeed()  # a job key may not read the event stream; nobody watches here
        self.report("running", pid=os.getpid(), host=socket.gethostname())
        options = dict(body["options"])
        rewards = body["rewards"]
        if body["kind"] == "run" and options.get("env") is not None:  # an environment run
            self.target = session.train(prompts=body["prompts"], **options)
        elif body["kind"] == "run":
            keys = [r["fn"] if r["pinned"] else r["name"] for r in rewards]
            weights = body.get("reward_weights")  # reward={"name": weight, ...}
            reward = dict(zip(keys, weights, strict=True)) if weights else keys[0]
            self.target = session.train(reward=reward, prompts=body["prompts"], **options)
        else:
            grid = options.pop("grid")
            reward = body.get("reward")
            weights = body.get("reward_weights")
            if weights:  # one weighted reward for every run of the sweep
                reward = dict(
                    zip([r["fn"] if r["pinned"] else r["name"] for r in rewards], weights, strict=True)
                )
            elif reward is None and "reward" not in grid and rewards:
                reward = rewards[0]["fn"]
            self.target = session.sweep(reward=reward, prompts=body["prompts"], grid=grid, **options)
        runs = self._runs()
        _log(f"started {', '.join(f'{r.name} ({r.run_id})' for r in runs)}")
        for r in runs:
            r.subscribe(functools.partial(self._on_event, run=r))
        failure: str | None = None
        try:
            # a stop or pause recorded before the runs existed applies to them now
            action = self.control()
            if action == "stop":
                self.terminated = self.terminated or "the job was stopped before its runs existed"
                self.target.stop()
            elif action == "pause":
                for r in runs:
                    r.pause()
            handled_term = False
            while not self.target.done:
                if self.terminated and not handled_term:
                    handled_term = True
                    self._terminate()
                self._poke.wait(WORKER_POLL_S)
                self._poke.clear()
                self.poll()  # also while a step takes long, or the run is paused
                failure = failure or self._check_paused_on_error()
                if failure:
                    self.target.stop()
        except _JobGone:
            _log(f"the job is gone ({self.gone}): stopping its runs and exiting")
            self.target.stop()
            with contextlib.suppress(Exception):
                self.target.wait(30)
            _close(session)
            return EXIT_FAILED
        if self.terminated and self.terminated.startswith("the worker got") and not self._stop_wanted:
            _log(f"{self.terminated}, and the job was not stopped: reporting nothing (a retry takes over)")
            _close(session)
            return EXIT_TERMINATED
        for r in runs:  # the runs' final state reaches the service before the job's key is revoked
            with contextlib.suppress(Exception):
                r._runner.submit(r._report_state()).result(10)
        from openrl_jupyter.run import stopped_from_outside

        if failure:
            state, message = "failed", failure
        elif body["kind"] == "run":
            run = self.target
            if run.state == RunState.FINISHED:
                state, message = "finished", f"finished {run.step}/{run.total_steps} steps"
            elif run.state == RunState.STOPPED:
                state, message = "stopped", f"{run.stop_reason or 'stopped'} at step {run.step}"
            else:
                state, message = "failed", f"{run.state} at step {run.step}: {run.last_error}"
        else:
            sweep = self.target
            best = sweep.best
            failed = all(r.state == RunState.FAILED for r in sweep.runs)
            stopped = self.terminated or any(stopped_from_outside(r.stop_reason) for r in sweep.runs)
            state = "failed" if failed else "stopped" if stopped else "finished"
            message = f"best {best.name}" if best is not None else "no best run"
            if sweep.checkpoint:
                message += f", saved {sweep.checkpoint}"
        if self.terminated and state == "stopped":
            message = f"{message} ({self.terminated})"
        _log(f"{state}: {message}")
        try:
            self.report(state, message)
        except _JobGone:
            pass
        _close(session)
        return EXIT_FAILED if state == "failed" else 0

    _stop_wanted = False

    def _terminate(self) -> None:
        """After SIGTERM: stop the runs; the job ends "stopped" only when its control says stop
        (else it was preempted or drained, and a retry pod must still be able to use the key)."""
        with contextlib.suppress(OpenRLError):
            self._stop_wanted = self.control() == "stop"
        self.target.stop()


def _close(session: Any) -> None:
    """Close the worker's session; a run that ended paused on an error must not turn a reported end
    into a second (failed) report."""
    try:
        session.close()
    except Exception as exc:  # noqa: BLE001 - the job's end is already decided
        _log(f"closing the session: {type(exc).__name__}: {exc}")


def check_versions(meta: dict) -> None:
    """The payload was pickled by the python (major.minor) and cloudpickle of ``meta``: refuse to
    unpickle it with others, naming both."""
    import cloudpickle

    here_py = ".".join(map(str, sys.version_info[:2]))
    there_py = ".".join(str(meta.get("python") or "").split(".")[:2])
    problems = []
    if there_py and there_py != here_py:
        problems.append(f"python {there_py} (the notebook) vs {here_py} (this worker)")
    there_cp = meta.get("cloudpickle")
    if there_cp and str(there_cp) != cloudpickle.__version__:
        problems.append(f"cloudpickle {there_cp} (the notebook) vs {cloudpickle.__version__} (this worker)")
    if problems:
        raise OpenRLError(
            "the job's payload cannot be loaded here: it was pickled with "
            + "; ".join(problems)
            + ". Use a worker image with the notebook's versions (k8s image), or submit from a "
            "kernel with this worker's versions"
        )


def worker() -> int:
    """``python -m openrl_jupyter.jobs worker``: run the job named by the environment."""
    url, token = os.environ.get("OPENRL_URL"), os.environ.get("OPENRL_TOKEN")
    job_id = os.environ.get("OPENRL_JOB_ID")
    spec = os.environ.get("OPENRL_JOB_SPEC")
    if spec and os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            info = json.load(f)
        job_id = job_id or info.get("job_id")
        url = url or info.get("service_url")
    missing = [
        k for k, v in (("OPENRL_URL", url), ("OPENRL_TOKEN", token), ("OPENRL_JOB_ID", job_id)) if not v
    ]
    if missing:
        print(f"openrl job worker: {', '.join(missing)} not set", file=sys.stderr)
        return 2
    w = _Worker(url, token, job_id)

    def terminate(signum, _frame) -> None:
        # only flags: the main loop asks the job's control and stops the runs
        w.terminated = f"the worker got {signal.Signals(signum).name}"
        w._poke.set()

    signal.signal(signal.SIGTERM, terminate)
    try:
        return w.run()
    except _JobGone:
        _log(f"the job is gone ({w.gone}): exiting")
        return EXIT_FAILED
    except BaseException as exc:  # noqa: BLE001 - whatever ends the job is reported as its failure
        detail = f"{type(exc).__name__}: {exc}"
        _log(f"failed: {detail}\n{traceback.format_exc()}")
        try:
            w.client.job_state(job_id, "failed", message=detail[:2000])
        except Exception:  # noqa: BLE001 - not reported: a retry may
            return 1
        return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["worker"]:
        print("usage: python -m openrl_jupyter.jobs worker", file=sys.stderr)
        return 2
    return worker()
