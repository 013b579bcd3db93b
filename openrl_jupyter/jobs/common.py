"""What the parts of :mod:`openrl_jupyter.jobs` share: formats, names, timings."""

from __future__ import annotations

import threading

from openrl_common.datadirs import user_data_folder
from openrl_common.protocol import JOB_NAME_RE, TERMINAL_STATES

PAYLOAD_FORMAT = 1
WHERE = ("local", "k8s")
TERMINAL = TERMINAL_STATES
NAME_RE = JOB_NAME_RE
DUMMY_COMPLETION = "ok"  # what the proof scores: a short completion any reward must take
PROOF_TIMEOUT_S = 120.0
WORKER_POLL_S = 1.0  # the worker asks for new payload versions this often
ATTACH_POLL_S = 1.0
DELETE_WAIT_S = 15.0  # Job.delete waits this long for its own local worker to end after SIGTERM  # an attached view asks the service for new rows this often
K8S_KEYS = ("image", "volumes", "cpu", "memory")
# never by value: these are installed wherever a job runs (and are the code that runs it)
ALWAYS_BY_REFERENCE = {"openrl_common", "openrl_jupyter", "openrl_service", "cloudpickle", "tests"}
_pickle_lock = threading.Lock()
EXIT_FAILED = 3  # reported failed: a retry cannot help (Kubernetes: podFailurePolicy FailJob)
EXIT_TERMINATED = 143  # SIGTERM without a stop (preemption, node drain): a retry pod takes over


def jobs_dir() -> str:
    """Where local jobs' logs and working folders go: ``$OPENRL_JOBS_DIR``, else the Jupyter data
    folder's ``openrl-jobs``."""
    return user_data_folder("OPENRL_JOBS_DIR", "jobs")
