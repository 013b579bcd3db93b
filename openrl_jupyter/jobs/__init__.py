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

The parts: ``common`` (formats, names, timings), ``payload`` (what travels by value), ``proof`` (the
clean-Python check at submit time), ``submit``, ``handle`` (``Job``, ``Attached``, ``attach``) and
``worker`` (what the job process runs; ``python -m openrl_jupyter.jobs worker``). This package imports
without torch, and nothing here imports the worker (it imports the session, which imports this).
"""

from __future__ import annotations

from openrl_jupyter.jobs.common import NAME_RE, PAYLOAD_FORMAT, TERMINAL, WHERE, jobs_dir
from openrl_jupyter.jobs.handle import Attached, Job, JobFailed, JobPaused, JobTimeout, attach
from openrl_jupyter.jobs.payload import decode, dumps, encode, reward_entry, user_modules
from openrl_jupyter.jobs.proof import prove
from openrl_jupyter.jobs.submit import submit

__all__ = [
    "NAME_RE",
    "PAYLOAD_FORMAT",
    "TERMINAL",
    "WHERE",
    "Attached",
    "Job",
    "JobFailed",
    "JobPaused",
    "JobTimeout",
    "attach",
    "decode",
    "dumps",
    "encode",
    "jobs_dir",
    "prove",
    "reward_entry",
    "submit",
    "user_modules",
]
