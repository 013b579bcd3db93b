"""Following a job or a run from a kernel: the handle of a submitted job (``Job``: its state, history,
control, log and wait) and a run on the service followed from a later kernel (``Attached``, ``attach``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from openrl_common.protocol import WORKER_ARGV
from openrl_jupyter._exceptions import NotFoundError, OpenRLError, UsageError
from openrl_jupyter.jobs.common import (
    ATTACH_POLL_S,
    DELETE_WAIT_S,
    PAYLOAD_FORMAT,
    TERMINAL,
    jobs_dir,
)
from openrl_jupyter.jobs.payload import decode, dumps, encode, reward_entry
from openrl_jupyter.jobs.proof import prove
from openrl_jupyter.rewards import RewardVersion


# -- the handle -----------------------------------------------------------------------------------------
class JobTimeout(OpenRLError, TimeoutError):
    """``Job.wait`` gave up after its timeout; the job goes on."""


class JobFailed(OpenRLError):
    """``Job.wait`` on a job that failed (its message says why; ``job.logs()`` for a local one)."""


class JobPaused(OpenRLError):
    """``Job.wait`` on a job whose run paused on an error (the job's message is the error)."""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class Job:
    """A detached run or sweep: where it runs, its state and runs, control, and its history."""

    def __init__(self, session: Any, entry: dict, *, probe: dict | None = None, reward_names=()):
        self.session = session
        self.entry = dict(entry)
        self.job_id: str = entry["job_id"]
        self.name: str = entry["name"]
        self.kind: str = entry.get("kind", "run")
        self.where: str = entry.get("where", "local")
        self.probe = probe
        named = (entry.get("meta") or {}).get("named_rewards")
        self.reward_names = set(reward_names) or {n for n in str(named or "").split(",") if n}
        # a local worker's output, also for a job another kernel started (its name is fixed)
        log = os.path.join(jobs_dir(), f"{self.name}-{self.job_id}.log")
        self.log_path: str | None = log if self.where == "local" and os.path.exists(log) else None
        self.process: subprocess.Popen | None = None

    # -- reading ------------------------------------------------------------------------------------
    def refresh(self) -> dict:
        """The service's entry for the job now (also kept as ``entry``); a local worker of this
        kernel that exited without reporting is reported failed here (with this key)."""
        self.entry = self.session.client.get_job(self.job_id)
        self._reconcile()
        return self.entry

    def _reconcile(self) -> None:
        """Poll this kernel's own worker (reaping it); exited while the job is not over → failed."""
        p = self.process
        if p is None:
            return
        code = p.poll()
        if code is None or self.entry.get("state") in TERMINAL:
            return
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        message = f"its worker (pid {p.pid}) {how} without reporting the job's end"
        if self.log_path:
            message += f"; its log: {self.log_path}"
        try:
            self.entry = self.session.client.job_state(self.job_id, "failed", message=message)
        except OpenRLError:  # it reported meanwhile (or the job is gone): the service's word
            self.entry = self.session.client.get_job(self.job_id)
            return
        import warnings

        warnings.warn(f"job {self.name!r}: {message}; reported it failed", stacklevel=3)

    @property
    def state(self) -> str:
        """submitted, running, finished, failed or stopped (asks the service)."""
        return str(self.refresh().get("state"))

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def runs(self) -> list[str]:
        """The run ids of the job (labelled ``openrl.job`` on the service)."""
        return list(self.refresh().get("runs") or [])

    @property
    def history(self) -> list[dict]:
        """The metric rows the service stores, one per step; for a sweep each row names its ``run``."""
        client = self.session.client
        runs = self.runs
        try:
            if self.kind == "run":  # its newest run (a retried Kubernetes pod creates another)
                return list(client.metrics(runs[-1])) if runs else []
            names = {r["run_id"]: r["name"] for r in client.list_runs() if r.get("run_id") in runs}
            return [{"run": names.get(rid, rid), **row} for rid in runs for row in client.metrics(rid)]
        except NotFoundError as exc:
            raise UsageError(
                f"job {self.name!r} ({self.entry.get('state')}: {self.entry.get('message') or 'no message'}) "
                f"lists runs the service no longer has the history of ({exc})"
            ) from None

    def logs(self, n: int = 4000) -> str:
        """The last ``n`` characters of a local job's output."""
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    # -- control ------------------------------------------------------------------------------------
    def _control(self, action: str, reason: str | None) -> Job:
        self.entry = self.session.client.job_control(self.job_id, action, reason)
        return self

    def pause(self, reason: str | None = None) -> Job:
        """Pause every run of the job after its current step."""
        return self._control("pause", reason)

    def resume(self, reason: str | None = None) -> Job:
        return self._control("resume", reason)

    def stop(self, reason: str | None = None, *, wait: bool = False, timeout: float | None = None) -> Job:
        """Stop every run of the job after its current step; the job ends as ``stopped``."""
        self._control("stop", reason)
        if wait:
            self.wait(timeout)
        return self

    def wait(self, timeout: float | None = None, poll_s: float = 0.5) -> Job:
        """Block until the job is finished or stopped; JobFailed when it failed, JobTimeout after
        ``timeout`` s (the job goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.state not in TERMINAL:
            if deadline is not None and time.monotonic() > deadline:
                raise JobTimeout(f"job {self.name!r} is still {self.entry.get('state')} after {timeout} s")
            time.sleep(poll_s)
            if str(self.entry.get("message") or "").startswith("paused on error"):
                where = f" (log: {self.log_path})" if self.log_path else ""
                raise JobPaused(
                    f"job {self.name!r} is {self.entry['message']}{where}: fix it, then job.resume() "
                    "(or job.stop()); it fails by itself after OPENRL_JOB_PAUSED_ERROR_S"
                )
        if self.entry.get("state") == "failed":
            where = f" (log: {self.log_path})" if self.log_path else ""
            raise JobFailed(f"job {self.name!r} failed: {self.entry.get('message')}{where}")
        return self

    def delete(self) -> None:
        """Revoke the job's key and delete its Kubernetes Job; this kernel's own local worker is sent
        SIGTERM (another kernel's finds its key revoked at its next poll and exits). Its runs stay on
        the service."""
        self.session.client.delete_job(self.job_id)
        self.session.detached.pop(self.name, None)
        p = self.process
        if p is not None and p.poll() is None:  # this kernel's own worker: end it now
            with contextlib.suppress(OSError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(DELETE_WAIT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)

    def send_reward(self, version: RewardVersion) -> int:
        """Send a new version of a named reward to the job (proved first); its payload version."""
        body = {
            "format": PAYLOAD_FORMAT,
            "type": "reward",
            "rewards": [reward_entry(version)],
            "probe": self.probe,
        }
        what = f"reward {version.name} v{version.version}"
        if self.probe is None:  # a job this kernel attached to: the probe is in its first payload
            with contextlib.suppress(Exception):
                self.probe = decode(self.session.client.payloads(self.job_id, after=0)[0])["probe"]
        body["probe"] = self.probe
        data = dumps(body, what)
        if self.probe is not None:
            prove(data, body, what, self.where)
        reply = self.session.client.add_payload(self.job_id, **encode(data), reward=version.name)
        return int(reply["version"])

    def attach(self) -> Attached | Job:
        """The attached view of the job's run (a sweep's job: itself; see ``attached``)."""
        return attach(self.session, self.job_id)

    def attached(self) -> list[Attached]:
        """Every run of the job (a sweep's), attached: history and a live dashboard each."""
        return [Attached(self.session, self.session.client.get_run(rid), self) for rid in self.runs]

    def close(self) -> None:
        """Forget the local child (it goes on by itself)."""
        if self.process is not None:
            with contextlib.suppress(Exception):
                self.process.poll()

    # -- starting a local worker --------------------------------------------------------------------
    def _spawn(self, key: str | None) -> None:
        if not key:
            raise OpenRLError(f"the service returned no job key for the local job {self.name!r}")
        folder = jobs_dir()
        workdir = os.path.join(folder, self.job_id)
        os.makedirs(workdir, mode=0o700, exist_ok=True)
        self.log_path = os.path.join(folder, f"{self.name}-{self.job_id}.log")
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("JUPYTERHUB_", "JPY_", "OPENRL_")) and k not in ("TINKER_API_KEY",)
        }
        env.update(
            OPENRL_URL=self.session.url,
            OPENRL_TOKEN=key,
            OPENRL_JOB_ID=self.job_id,
            OPENRL_JOBS_DIR=folder,
            PYTHONUNBUFFERED="1",
        )
        if os.environ.get("OPENRL_JOB_PAUSED_ERROR_S"):
            env["OPENRL_JOB_PAUSED_ERROR_S"] = os.environ["OPENRL_JOB_PAUSED_ERROR_S"]
        try:
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, *WORKER_ARGV],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=workdir,
                    env=env,
                    start_new_session=True,  # outside the kernel's process group: it outlives it
                    close_fds=True,
                )
        except OSError as exc:
            with contextlib.suppress(OpenRLError):
                self.session.client.job_state(self.job_id, "failed", message=f"could not start: {exc}")
            raise OpenRLError(f"could not start the worker of job {self.name!r}: {exc}") from None

    # -- display --------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        e = self.entry
        where = self.where + (f" pid {e['pid']}" if e.get("pid") else "")
        return f"<openrl Job {self.name!r} {self.kind} {where}: {e.get('state')} ({len(e.get('runs') or [])} runs)>"

    def _repr_html_(self) -> str:
        import html

        e = self.entry
        log = f" · log <code>{html.escape(self.log_path)}</code>" if self.log_path else ""
        return (
            f"<div><b>{html.escape(self.name)}</b> · detached {html.escape(self.kind)} · "
            f"{html.escape(self.where)} · {html.escape(str(e.get('state')))}{log}</div>"
        )


# -- attaching ------------------------------------------------------------------------------------------
class Attached:
    """A run on the service followed from this kernel: its whole history (the service's metric rows)
    and, while subscribed, new rows and state changes every ``ATTACH_POLL_S``. It has what
    ``RunDashboard`` reads of a Run, so ``view.dashboard()`` (or ending a cell with it) shows a live
    dashboard. pause/resume/stop go to the job (or the run's control)."""

    def __init__(self, session: Any, run: dict, job: Job | None = None):
        self.session = session
        self.job = job
        self.run_id: str = run["run_id"]
        self.name: str = run.get("name") or self.run_id
        self.model = run.get("base_model") or "?"
        meta = (job.entry.get("meta") or {}) if job is not None else {}
        self.total_steps = run.get("steps") or meta.get("steps")
        self.last_error: str | None = job.entry.get("message") if job else None
        self._run = run
        self._rows: list[dict] = []
        self._lock = threading.RLock()
        self._listeners: list[Callable[[dict], None]] = []
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._dashboard = None
        self._state = "?"
        self._gone: str | None = None  # the service no longer has the run (reaped or deleted): why
        self.refresh()

    # what a Run offers the dashboard
    @property
    def state(self) -> str:
        return self._state

    @property
    def step(self) -> int:
        with self._lock:
            return self._rows[-1]["step"] if self._rows else 0

    @property
    def history(self) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._rows]

    @property
    def reward_name(self) -> str | None:
        rows = self._rows
        return rows[-1].get("reward_name") if rows else None

    @property
    def reward_version(self) -> int | None:
        rows = self._rows
        return rows[-1].get("reward_version") if rows else None

    @property
    def done(self) -> bool:
        """The run is over and, for a job's run, the job has reported its end too."""
        if self.job is not None:
            return self.job.entry.get("state") in TERMINAL
        return self._state in TERMINAL or self._gone is not None

    def refresh(self) -> list[dict]:
        """Fetch the rows and state from the service; the new rows."""
        client = self.session.client
        try:
            rows = list(client.metrics(self.run_id) or [])
        except NotFoundError:  # the service forgot the run: keep what this view has, say so
            with self._lock:
                rows = list(self._rows)
            gone = f"the service no longer has run {self.run_id} (this view keeps its {len(rows)} steps)"
            if not self._gone:
                self._gone = gone
                self._emit({"kind": "log", "step": self.step, "text": f"attach: {gone}"})
        with contextlib.suppress(NotFoundError):
            self._run = client.get_run(self.run_id)
        state = str(self._run.get("state") or "?")
        if self._gone and state not in TERMINAL and self.job is None:
            state = "gone"
        if self.job is not None:
            with contextlib.suppress(OpenRLError):
                self.job.refresh()
            job_state = self.job.entry.get("state")
            if job_state in TERMINAL and state not in TERMINAL:
                state = job_state
            self.last_error = self.job.entry.get("message") or self.last_error
        if self._gone:
            job_says = (
                f"; the job: {self.job.entry.get('message')}"
                if self.job and self.job.entry.get("message")
                else ""
            )
            self.last_error = f"{self._gone}{job_says}"
        with self._lock:
            seen = {r["step"] for r in self._rows}
            new = [r for r in rows if r["step"] not in seen]
            self._rows = sorted(rows, key=lambda r: r["step"])
            changed, self._state = state != self._state, state
        for row in new:
            self._emit({"kind": "step", "row": dict(row)})
        if changed:
            self._emit({"kind": "state", "state": state, "error": None})
        return new

    def subscribe(self, fn: Callable[[dict], None]) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(fn)
            if self._thread is None and not self.done:
                self._thread = threading.Thread(
                    target=self._follow, name=f"openrl-attach-{self.name}", daemon=True
                )
                self._thread.start()

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)

        return unsubscribe

    def _follow(self) -> None:
        while not self._closed.wait(ATTACH_POLL_S):
            try:
                self.refresh()
            except OpenRLError as exc:
                self._emit({"kind": "log", "step": self.step, "text": f"attach: {exc}"})
            if self.done:
                break
        with self._lock:
            self._thread = None

    def _emit(self, event: dict) -> None:
        from openrl_jupyter.runner import notify

        with self._lock:
            listeners = list(self._listeners)
        notify(listeners, event)

    def wait(self, timeout: float | None = None) -> Attached:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.refresh()
            if self.done:
                return self
            if deadline is not None and time.monotonic() > deadline:
                raise JobTimeout(f"run {self.name!r} is still {self._state} after {timeout} s")
            time.sleep(0.5)

    def _control(self, action: str) -> Attached:
        if self.job is not None:
            self.job._control(action, None)
        else:
            self.session.client.control(self.run_id, action)
        return self

    def pause(self, **_: Any) -> Attached:
        return self._control("pause")

    def resume(self, **_: Any) -> Attached:
        return self._control("resume")

    def stop(self, **_: Any) -> Attached:
        return self._control("stop")

    def dashboard(self, **options: Any):
        from openrl_jupyter.dashboard import RunDashboard

        if self._dashboard is None or options:
            if self._dashboard is not None:
                self._dashboard.close()
            self._dashboard = RunDashboard(self, **options)
        return self._dashboard

    def close(self) -> None:
        self._closed.set()

    def __repr__(self) -> str:
        from openrl_jupyter.summary import summary_text

        where = f" (detached {self.job.where} job {self.job.name!r})" if self.job else ""
        return f"<attached {summary_text(self)}{where}>"

    def _repr_mimebundle_(self, include=None, exclude=None):
        from openrl_jupyter.summary import summary_html, widgets_frontend

        bundle = {"text/plain": repr(self), "text/html": summary_html(self)}
        if widgets_frontend():
            with contextlib.suppress(Exception):
                bundle = {**self.dashboard()._repr_mimebundle_(), **bundle}
        return bundle


def attach(session: Any, name: str) -> Attached | Job:
    """A detached run by job name or id (a sweep's job: its Job, whose ``attached()`` lists its
    runs); else any run of this key by run name."""
    if not isinstance(name, str) or not name:
        raise UsageError(f"attach needs a job or run name; got {name!r}")
    client = session.client
    try:
        entry = client.get_job(name)
    except NotFoundError:
        entry = None
    if entry is not None:
        job = session.detached.get(entry["name"])
        if job is None or job.job_id != entry["job_id"]:
            job = Job(session, entry)
            session.detached[job.name] = job  # a re-defined reward of its reward's name goes to it too
        job.entry = entry
        if job.kind == "sweep":
            return job
        if not entry.get("runs"):
            raise UsageError(f"job {name!r} is {entry.get('state')} and has no run yet; attach again shortly")
        run_id = entry["runs"][-1]  # the newest: a retried Kubernetes pod creates another run
        try:
            return Attached(session, client.get_run(run_id), job)
        except NotFoundError:
            raise UsageError(
                f"job {name!r} ({entry.get('state')}: {entry.get('message') or 'no message'}) lists run "
                f"{run_id}, but the service no longer has that run's history"
            ) from None
    runs = [r for r in client.list_runs() if r.get("name") == name]
    if not runs:
        raise UsageError(f"no detached job or run named {name!r} on {session.url} (see %openrl runs)")
    try:
        return Attached(session, runs[-1])
    except NotFoundError:
        raise UsageError(f"run {name!r} ended and the service no longer has its history") from None
