"""Runs that outlive the notebook: detached runs and sweeps.

    job = session.train(reward="letters", prompts=PROMPTS, steps=200, detach="local")   # or "k8s"
    job = %openrl train --reward letters --prompts PROMPTS --steps 200 --detach local
    job.state; job.history; job.pause(); job.resume(); job.stop(); job.wait(); job.log_path
    view = session.attach("run-3f2a1c")      # from any later kernel: its whole history, a live dashboard

What travels: the reward (a registered reward's newest version, or a function given as
``reward=fn``), the train (or sweep) options and the prompts, serialised by value with cloudpickle.
Functions of the notebook (``__main__``) travel by value anyway; the user's own modules — those whose
file is under the working folder or a ``sys.path`` entry that is neither the standard library nor
site-packages nor an installed distribution — are registered with
``cloudpickle.register_pickle_by_value`` while the payload is built, so they travel by value too.
Data a reward needs (the SQL databases) is rebuilt in the job from its seed
(``openrl_jupyter.sql.database_path``), not shipped.

Proof at submit time: the payload is unpickled in a clean Python subprocess (working folder a fresh
temporary one, so nothing of the kernel's ``sys.path`` or folder leaks; ``-I`` for Kubernetes, the
local worker's environment for local) and each reward is called there on the first prompt with a
short dummy completion; the same call is made in the kernel.
When the kernel's call works and the clean one does not (a module only importable here, a name
defined nowhere that travels, a file that is not there...), or the payload cannot be pickled at all
(a lock, an open socket...), submitting raises a UsageError saying what could not travel and how to
fix it; nothing is submitted and nothing starts. A job never fails later for that reason.

Where: ``local`` — the service records the job and mints a job-scoped key, which comes back here
only for this case; this kernel spawns ``python -m openrl_jupyter.jobs worker`` in a new process
session (outside the kernel's process group; stdin/stdout/stderr not tied to the kernel; its output
in ``<jupyter data dir>/openrl-jobs/<name>-<job id>.log``, or ``$OPENRL_JOBS_DIR``). From a session
whose embedded service dies with the kernel (``connect(local=True)``) it is refused: connect with
``connect(local=True, detached=True)`` instead. ``k8s`` — the service submits a Kubernetes Job from
its fixed template; the key never leaves the service.

The worker (``python -m openrl_jupyter.jobs worker``, what both a local child and a Kubernetes pod
run): connects with ``OPENRL_URL`` / ``OPENRL_TOKEN`` (the job key) / ``OPENRL_JOB_ID``, fetches its
job and payloads, reports ``running`` (pid, host), runs the Run (or Sweep) to its end — runs labelled
``user_metadata {"openrl.job": job_id}`` (sweep runs also ``{"openrl.sweep": name}``) — and between
steps fetches new payload versions: a new version of a named reward (``%%openrl reward NAME`` again
in the notebook) applies from the next step (hot swap). Pause, resume and stop arrive as run control
(``POST /jobs/{id}/control`` sets it on every run of the job). It reports finished / stopped / failed
with a message and exits 0 / 0 / 3 (3: reported failed, a retry cannot help; Kubernetes fails the
Job on it). A stop or pause recorded on the job before its runs existed applies to them when they
start. A run paused on an error shows in the job's message ("paused on error: ...", still running;
``Job.wait`` raises JobPaused); after ``OPENRL_JOB_PAUSED_ERROR_S`` (default 600) the job fails. When
the job is deleted or its key revoked, the worker stops its runs and exits 3. On SIGTERM it stops its
runs and reports the job stopped only when the job's control is stop; otherwise (preemption, a node
drain) it reports nothing and exits 143, so a retried pod can go on with the same key. A payload
version that cannot be loaded is skipped and named in the job's message. The payload's python
(major.minor) and cloudpickle versions must be the worker's; otherwise it fails naming both.

The kernel that started a local worker polls it (``job.state``, ``job.wait``): a worker that exited
without reporting is reported failed, with its exit code or signal and its log.

This module imports without torch.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from openrl_jupyter._exceptions import NotFoundError, OpenRLError, RequestError
from openrl_jupyter.rewards import RewardVersion, pinned, registry
from openrl_jupyter.session import UsageError

if TYPE_CHECKING:
    from openrl_jupyter.session import Session

PAYLOAD_FORMAT = 1
WHERE = ("local", "k8s")
TERMINAL = ("finished", "failed", "stopped")
NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
DUMMY_COMPLETION = "ok"  # what the proof scores: a short completion any reward must take
PROOF_TIMEOUT_S = 120.0
WORKER_POLL_S = 1.0  # the worker asks for new payload versions this often
ATTACH_POLL_S = 1.0
DELETE_WAIT_S = 15.0  # Job.delete waits this long for its own local worker to end after SIGTERM  # an attached view asks the service for new rows this often
K8S_KEYS = ("image", "volumes", "cpu", "memory")
# never by value: these are installed wherever a job runs (and are the code that runs it)
ALWAYS_BY_REFERENCE = {"openrl_jupyter", "openrl_service", "cloudpickle", "tests"}
_pickle_lock = threading.Lock()


# -- what travels by value ----------------------------------------------------------------------------
def _system_dirs() -> list[str]:
    """The standard library and site-packages folders: modules there are installed, not the user's."""
    dirs = set()
    for scheme_key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(scheme_key)
        if path:
            dirs.add(os.path.realpath(path))
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        dirs.add(os.path.realpath(os.path.join(prefix, "lib")))
    with contextlib.suppress(Exception):
        import site

        dirs.update(os.path.realpath(p) for p in site.getsitepackages())
        dirs.add(os.path.realpath(site.getusersitepackages()))
    return sorted(dirs)


def _under(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip(os.sep) + os.sep) for f in folders)


def _installed_top_levels() -> set[str]:
    try:
        from importlib.metadata import packages_distributions

        return set(packages_distributions())
    except Exception:  # noqa: BLE001 - a broken metadata entry must not stop a submit
        return set()


def user_modules() -> list[str]:
    """Top-level modules of the user's own (see the module docstring): they travel by value."""
    system = _system_dirs()
    roots = [os.path.realpath(os.getcwd())]
    for entry in sys.path:
        path = os.path.realpath(entry or os.getcwd())
        if os.path.isdir(path) and not _under(path, system):
            roots.append(path)
    skip = ALWAYS_BY_REFERENCE | _installed_top_levels() | set(sys.stdlib_module_names)
    found = []
    for name, module in list(sys.modules.items()):
        if "." in name or name.startswith("_") or name in skip or module is None:
            continue
        file = getattr(module, "__file__", None)
        if not isinstance(file, str):
            continue
        path = os.path.realpath(file)
        if _under(path, system) or not _under(path, roots):
            continue
        found.append(name)
    return sorted(found)


def dumps(obj: Any, what: str) -> bytes:
    """``obj`` pickled with cloudpickle, the user's modules by value; a UsageError naming ``what``
    when something in it cannot be pickled (a lock, an open file or socket, a client...)."""
    import cloudpickle

    with _pickle_lock:
        registered = {m for m in cloudpickle.list_registry_pickle_by_value()}
        added = []
        for name in user_modules():
            if name not in registered and name in sys.modules:
                with contextlib.suppress(ValueError):
                    cloudpickle.register_pickle_by_value(sys.modules[name])
                    added.append(name)
        try:
            return cloudpickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001 - pickling the user's objects can raise anything
            raise UsageError(
                f"{what} cannot be sent to a detached run: {type(exc).__name__}: {exc}. It refers to "
                "something that cannot be copied to another process (a lock, an open file or socket, "
                "a client, a thread...): create it inside the reward function (or at its first call) "
                "instead of in the notebook"
            ) from None
        finally:
            for name in added:
                with contextlib.suppress(Exception):
                    cloudpickle.unregister_pickle_by_value(sys.modules[name])


def encode(data: bytes) -> dict:
    """The payload fields of a request: base64 and the SHA-256 of the bytes."""
    return {
        "payload": base64.b64encode(data).decode("ascii"),
        "payload_sha256": hashlib.sha256(data).hexdigest(),
    }


def decode(entry: dict) -> Any:
    """A payload version from the service, checked against its SHA-256 and unpickled."""
    import cloudpickle

    data = base64.b64decode(entry["payload"])
    digest = hashlib.sha256(data).hexdigest()
    if entry.get("sha256") and entry["sha256"] != digest:
        raise OpenRLError(
            f"payload v{entry.get('version')}: SHA-256 {digest} is not the service's {entry['sha256']}"
        )
    return cloudpickle.loads(data)


def reward_entry(reward: Any) -> dict:
    """What a payload carries of a reward: a registered name's newest version, or a pinned function."""
    if isinstance(reward, RewardVersion):
        v, is_pinned = reward, False
    elif callable(reward):
        v, is_pinned = pinned(reward), True
    elif isinstance(reward, str):
        v, is_pinned = registry.latest(reward), False
    else:
        raise UsageError(f"reward must be a registered reward's name or a function; got {reward!r}")
    return {"name": v.name, "fn": v.fn, "per_group": v.per_group, "pinned": is_pinned, "version": v.version}


# -- the proof: unpickle and call in a clean Python ---------------------------------------------------
PROOF_CHILD = r"""
import asyncio, inspect, json, sys, traceback
out_path = sys.argv[1]

def done(**kw):
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(kw, f)

try:
    import cloudpickle
    body = cloudpickle.loads(sys.stdin.buffer.read())
except BaseException as exc:
    done(stage="unpickle", error=f"{type(exc).__name__}: {exc}", kind=type(exc).__name__,
         tb=traceback.format_exc(limit=8))
    raise SystemExit(0)
probe = body["probe"]
results = []
for entry in body["rewards"]:
    fn = entry["fn"]
    try:
        if entry["per_group"]:
            value = fn([probe["prompt"]], [probe["completion"]], [dict(probe["info"])])
        else:
            value = fn(probe["prompt"], probe["completion"], **dict(probe["info"]))
        if inspect.isawaitable(value):
            value = asyncio.run(value)
        results.append({"name": entry["name"], "ok": True, "value": repr(value)[:200]})
    except BaseException as exc:
        results.append({"name": entry["name"], "ok": False, "kind": type(exc).__name__,
                        "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc(limit=8)})
done(stage="call", results=results)
"""

TRAVEL_HINTS = {
    "ModuleNotFoundError": "a module it uses is importable only here (from the notebook's folder or "
    "this kernel's sys.path): import it at the top of a cell (not inside the function) so it "
    "travels by value, or install it where the job runs",
    "ImportError": "a module it uses is importable only here: import it at the top of a cell so it "
    "travels by value, or install it where the job runs",
    "NameError": "a name it uses is defined nowhere that travels: define it in the reward's cell (or "
    "pass the value through the prompts' info)",
    "FileNotFoundError": "a file it reads is not there in the job (which does not run in the notebook's "
    "folder): put the data in the prompts' info, rebuild it from a seed in the reward (as "
    "openrl_jupyter.sql.database_path does), or read it from an absolute path the job can see",
}


def _call_here(entry: dict, probe: dict) -> dict:
    """The proof's call, in this process (a thread of its own, prints captured, a time limit)."""
    from openrl_jupyter.rewards import _capture

    def call() -> Any:
        with _capture():
            fn = entry["fn"]
            if entry["per_group"]:
                value = fn([probe["prompt"]], [probe["completion"]], [dict(probe["info"])])
            else:
                value = fn(probe["prompt"], probe["completion"], **dict(probe["info"]))
            if asyncio.iscoroutine(value):
                value = asyncio.run(value)
            return value

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="openrl-proof")
    try:
        return {"ok": True, "value": repr(pool.submit(call).result(PROOF_TIMEOUT_S))[:200]}
    except concurrent.futures.TimeoutError:
        return {"ok": False, "kind": "TimeoutError", "error": f"no answer in {PROOF_TIMEOUT_S:g} s"}
    except Exception as exc:  # noqa: BLE001 - the user's reward
        return {"ok": False, "kind": type(exc).__name__, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        pool.shutdown(wait=False)


def prove(data: bytes, body: dict, what: str, where: str = "k8s") -> list[dict]:
    """Unpickle ``data`` in a clean Python and call its rewards on the probe; compare with the same
    calls here. Raises a UsageError when something works here but could not travel.

    The clean Python runs in a fresh temporary folder with none of the kernel's ``sys.path``; for
    ``where="k8s"`` it is isolated (``-I``: no PYTHONPATH, no user site-packages — a pod has none of
    them); for ``"local"`` it gets the environment the local worker gets (which keeps both)."""
    flags = ["-I"] if where != "local" else []
    with tempfile.TemporaryDirectory(prefix="openrl-proof-") as tmp:
        out = os.path.join(tmp, "result.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENRL_", "JUPYTERHUB_", "JPY_"))}
        try:
            proc = subprocess.run(
                [sys.executable, *flags, "-c", PROOF_CHILD, out],
                input=data,
                cwd=tmp,
                env=env,
                capture_output=True,
                timeout=PROOF_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise UsageError(
                f"{what}: proving the payload in a clean Python took more than {PROOF_TIMEOUT_S:g} s "
                "(the reward hangs on the first prompt?); nothing was submitted"
            ) from None
        try:
            with open(out, encoding="utf-8") as f:
                result = json.load(f)
        except (OSError, ValueError):
            tail = proc.stderr.decode("utf-8", "replace")[-1500:]
            raise UsageError(
                f"{what}: the clean Python that proves the payload exited with code {proc.returncode} "
                f"before answering; nothing was submitted:\n{tail}"
            ) from None
    if result["stage"] == "unpickle":
        hint = TRAVEL_HINTS.get(result["kind"], "it refers to something only this kernel has")
        raise UsageError(
            f"{what} cannot travel to a detached run: loading it in a clean Python failed with "
            f"{result['error']} — {hint}. Nothing was submitted."
        )
    report = []
    for entry, there in zip(body["rewards"], result["results"], strict=True):
        here = _call_here(entry, body["probe"])
        report.append({"name": entry["name"], "here": here, "there": there})
        if there["ok"]:
            continue
        if here["ok"] or here.get("kind") != there.get("kind"):
            hint = TRAVEL_HINTS.get(there["kind"], "it works in this kernel, not in a clean Python")
            raise UsageError(
                f"reward {entry['name']!r} cannot travel to a detached run: in a clean Python (as the "
                f"job runs it) it raised {there['error']}"
                + ("" if here["ok"] else f" (here: {here['error']})")
                + f" — {hint}. Nothing was submitted."
            )
    return report


# -- submitting -----------------------------------------------------------------------------------------
def jobs_dir() -> str:
    """Where local jobs' logs and working folders go: ``$OPENRL_JOBS_DIR``, else the Jupyter data
    folder's ``openrl-jobs``."""
    if os.environ.get("OPENRL_JOBS_DIR"):
        return os.environ["OPENRL_JOBS_DIR"]
    try:
        from jupyter_core.paths import jupyter_data_dir

        return os.path.join(jupyter_data_dir(), "openrl-jobs")
    except ImportError:
        return os.path.join(os.path.expanduser("~"), ".local", "share", "openrl", "jobs")


def _flat_prompts(loaded: list[dict]) -> list[dict]:
    """Prompts as ``load_prompts`` takes them again (a dict per prompt, its info flattened)."""
    return [{"prompt": p["prompt"], **p["info"]} for p in loaded]


def submit(session: Session, kind: str, where: Any, *, reward: Any, prompts: Any, options: dict) -> Job:
    """Check, build, prove and submit a detached run (``kind="run"``) or sweep; start it when local."""
    from openrl_jupyter.config import load_prompts, make_config

    options = dict(options)
    if where not in WHERE:
        raise UsageError(f"detach must be one of {', '.join(WHERE)}; got {where!r}")
    k8s = options.pop("k8s", None) or {}
    if not isinstance(k8s, dict) or set(k8s) - set(K8S_KEYS):
        raise UsageError(f"k8s must be a dict with some of {', '.join(K8S_KEYS)}; got {k8s!r}")
    if k8s and where != "k8s":
        raise UsageError(f"k8s options ({', '.join(k8s)}) are for detach='k8s' only")
    k8s = {k: v for k, v in k8s.items() if v not in (None, [], "")}
    if where == "local" and session.local is not None and not session.local.detached:
        raise UsageError(
            "a detached local run cannot use this session's embedded service: it stops with this "
            "kernel (connect(local=True)), and the run with it. Connect with "
            "connect(local=True, detached=True) (%openrl connect --local --detached), a service that "
            "outlives the kernel, or to a running service by URL; then detach again"
        )
    name = options.pop("name", None) or f"{kind}-{uuid.uuid4().hex[:6]}"
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise UsageError(f"name must be 1 to 64 letters, digits, '.', '_' or '-'; got {name!r}")
    old = session.detached.get(name)
    if (
        old is not None
        and old.entry.get("state") not in TERMINAL
        and old.refresh().get("state") not in TERMINAL
    ):
        raise UsageError(
            f"a detached {old.kind} named {name!r} is still {old.state}; stop it or pick another name"
        )
    if session.model is not None and options.get("model") is None:
        options["model"] = session.model
    loaded = load_prompts(prompts)
    if kind == "run":
        config = make_config(session.defaults, reward=reward, prompts=_flat_prompts(loaded), **options)
        rewards = [reward_entry(reward)]
        steps = config.steps
        options["name"] = name  # the run is named after its job
    else:
        from openrl_jupyter.sweep import Sweep

        opts = dict(options)
        grid = opts.pop("grid")
        checked = Sweep(session, reward=reward, prompts=_flat_prompts(loaded), grid=grid, name=name, **opts)
        listed = [reward] if reward is not None else list(grid.get("reward") or [])
        for r in listed:
            if isinstance(r, str):
                registry.latest(r)  # unknown → a UsageError naming %%openrl reward
        rewards = [reward_entry(r) for r in listed]
        steps = checked.steps
        options["name"] = name
    probe = {"prompt": loaded[0]["prompt"], "info": loaded[0]["info"], "completion": DUMMY_COMPLETION}
    body = {
        "format": PAYLOAD_FORMAT,
        "type": "job",
        "kind": kind,
        "reward": reward if isinstance(reward, str) else None,
        "rewards": rewards,
        "options": options,
        "prompts": _flat_prompts(loaded),
        "probe": probe,
    }
    what = f"the detached {kind} {name!r}"
    data = dumps(body, what)
    prove(data, body, what, where)
    import cloudpickle

    named = sorted({e["name"] for e in rewards if not e["pinned"]})
    meta = {
        "reward": ", ".join(e["name"] for e in rewards)[:200],
        "named_rewards": ",".join(named)[:200],
        "steps": steps,
        "model": options.get("model"),
        "prompts": len(loaded),
        "python": ".".join(map(str, sys.version_info[:3])),
        "cloudpickle": cloudpickle.__version__,
        "submitted_from": socket.gethostname(),
    }
    fields: dict[str, Any] = {
        "name": name,
        "kind": kind,
        "where": where,
        **encode(data),
        "reward": named[0] if len(named) == 1 else None,
        "meta": {k: v for k, v in meta.items() if v is not None},
    }
    if where == "k8s":
        fields["k8s"] = k8s
    try:
        entry = session.client.create_job(**fields)
    except RequestError as exc:
        if exc.status != 409 or where == "k8s" and "--jobs-namespace" in str(exc):
            raise
        try:
            there = session.client.get_job(name)
        except OpenRLError:
            raise exc from None
        raise UsageError(
            f"a job named {name!r} is already on the service: {there.get('state')}, job id "
            f"{there.get('job_id')}, pid {there.get('pid') or 'none yet'}. If it is one you submitted "
            "(a reply lost on the way back included), attach to it (session.attach(name)), or end "
            "it with stop() or delete() (%openrl runs lists it); else pick another name"
        ) from None
    key = entry.pop("key", None)
    job = Job(session, entry, probe=probe, reward_names=named)
    session.detached[name] = job
    if where == "local":
        job._spawn(key)
    return job


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

    def __init__(self, session: Session, entry: dict, *, probe: dict | None = None, reward_names=()):
        self.session = session
        self.entry = dict(entry)
        self.job_id: str = entry["job_id"]
        self.name: str = entry["name"]
        self.kind: str = entry.get("kind", "run")
        self.where: str = entry.get("where", "local")
        self.probe = probe
        named = (entry.get("meta") or {}).get("named_rewards")
        self.reward_names = set(reward_names) or {n for n in str(named or "").split(",") if n}
        self.log_path: str | None = None
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
                    [sys.executable, "-m", "openrl_jupyter.jobs", "worker"],
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

    def __init__(self, session: Session, run: dict, job: Job | None = None):
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

    def resume(self) -> Attached:
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
        from openrl_jupyter.run import _widgets_frontend
        from openrl_jupyter.summary import summary_html

        bundle = {"text/plain": repr(self), "text/html": summary_html(self)}
        if _widgets_frontend():
            with contextlib.suppress(Exception):
                bundle = {**self.dashboard()._repr_mimebundle_(), **bundle}
        return bundle


def attach(session: Session, name: str) -> Attached | Job:
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


# -- the worker ---------------------------------------------------------------------------------------
def _log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} openrl job: {text}", flush=True)


class _NoFeed:
    """The worker's stand-in for the session's event feed (no dashboard runs in a job)."""

    last_tick = None
    last_error = None

    def subscribe(self, fn: Callable[[dict], None]) -> Callable[[], None]:
        return lambda: None

    def close(self) -> None:
        pass


EXIT_FAILED = 3  # reported failed: a retry cannot help (Kubernetes: podFailurePolicy FailJob)
EXIT_TERMINATED = 143  # SIGTERM without a stop (preemption, node drain): a retry pod takes over


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

    def _on_event(self, event: dict) -> None:
        # on the runner thread: only a flag, the main loop polls (a slow service stalls no run)
        if event.get("kind") == "step":
            self._poke.set()

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
        if body["kind"] == "run":
            r = rewards[0]
            reward = r["fn"] if r["pinned"] else r["name"]
            self.target = session.train(reward=reward, prompts=body["prompts"], **options)
        else:
            grid = options.pop("grid")
            reward = body.get("reward")
            if reward is None and "reward" not in grid and rewards:
                reward = rewards[0]["fn"]
            self.target = session.sweep(reward=reward, prompts=body["prompts"], grid=grid, **options)
        runs = self._runs()
        _log(f"started {', '.join(f'{r.name} ({r.run_id})' for r in runs)}")
        for r in runs:
            r.subscribe(self._on_event)
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
            stopped = self.terminated or any(
                (r.stop_reason or "").startswith("stopped from the panel") for r in sweep.runs
            )
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


if __name__ == "__main__":
    raise SystemExit(main())
