"""Runs that outlive the notebook (``--detach``): a real service, real kernels, real worker processes.

The detached local run is started from a kernel, the kernel is killed with SIGKILL, the run goes on
in its worker and finishes; a new kernel attaches to it and sees its whole history. A payload that
cannot travel is refused at submit time with what could not travel, and nothing starts.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

import openrl_jupyter.session as sessions
from openrl_jupyter import jobs
from openrl_jupyter._exceptions import RequestError
from openrl_jupyter.client import Client
from openrl_jupyter.jobs import worker
from openrl_jupyter.session import UsageError
from tests._support.kernel import Kernel, of_type
from tests.conftest import ALICE_KEY

PROMPTS = ["Say hi:", "Name a colour:", "Count to three:"]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def local_job(session, prefix: str, fn=None, *, steps: int = 500, **options):
    """A detached local run of the small shape these tests use (batch 1, group 2, 4 tokens; overridable),
    scored by ``fn`` (default: completion length / 10)."""
    if fn is None:
        fn = dynamic("def reward(prompt, completion, **info):\n    return len(completion) / 10\n")["reward"]
    opts = {"batch": 1, "group": 2, "max_tokens": 4, **options}
    return session.train(reward=fn, prompts=PROMPTS, steps=steps, name=unique(prefix), detach="local", **opts)


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(poll)


def dynamic(source: str, **globals_) -> dict:
    """Functions defined as a notebook defines them: in a module nobody can import (so they travel
    by value, as ``__main__``'s do)."""
    ns = {"__name__": "openrl_test_notebook", **globals_}
    exec(textwrap.dedent(source), ns)  # noqa: S102 - the test's own code
    return ns


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


@pytest.fixture
def jobs_dir(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "jobs"
    folder.mkdir()
    monkeypatch.setenv("OPENRL_JOBS_DIR", str(folder))
    return folder


@pytest.fixture
def session(server, jobs_dir):
    s = sessions.connect(server.url, token=ALICE_KEY, name=unique("detach"))
    yield s
    for job in list(s.detached.values()):  # a failed test leaves no worker behind
        if job.process is not None and job.process.poll() is None:
            job.process.kill()
            job.process.wait(10)
    sessions.disconnect(s.name)


# -- payloads: what travels, and the proof -------------------------------------------------------------
def test_a_user_module_of_the_notebook_folder_travels_by_value(tmp_path, monkeypatch):
    folder = tmp_path / "notebook"
    folder.mkdir()
    (folder / "scoring_here.py").write_text("def score(c):\n    return len(c) / 10\n")
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    import scoring_here  # noqa: F401 - what a notebook cell does

    try:
        assert "scoring_here" in jobs.user_modules()
        assert "openrl_jupyter" not in jobs.user_modules() and "httpx" not in jobs.user_modules()
        ns = dynamic(
            """
            import scoring_here
            def reward(prompt, completion, **info):
                return scoring_here.score(completion)
            """
        )
        body = {
            "rewards": [jobs.reward_entry(ns["reward"])],
            "probe": {"prompt": "p", "info": {}, "completion": "ok"},
        }
        report = jobs.prove(jobs.dumps(body, "test"), body, "test")
        # the clean python (another folder, no sys.path of ours) ran the module's code: by value
        assert report[0]["there"] == {"name": "reward", "ok": True, "value": "0.2"}
        assert report[0]["here"]["value"] == "0.2"
    finally:
        sys.modules.pop("scoring_here", None)


def test_payloads_that_cannot_travel_are_refused_at_submit_and_nothing_starts(
    session, server, jobs_dir, tmp_path, monkeypatch
):
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "only_here.py").write_text("def score(c):\n    return 1.0\n")
    (folder / "data.txt").write_text("abc")
    (folder / "stats_here.py").write_text(
        "import threading\nlock = threading.Lock()\ndef mean(xs):\n    return sum(xs) / len(xs)\n"
    )
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    lock = threading.Lock()
    import stats_here as np  # the notebook's own module under a familiar name, holding a lock

    cases = {
        # a lock cannot be pickled at all: the message names the variable, what it is, and what to do
        "a lock": (
            dynamic(
                """
                def reward(prompt, completion, **info):
                    with lock:
                        return 1.0
                """,
                lock=lock,
            )["reward"],
            "reward() uses 'lock' from the notebook (a _thread.lock), which cannot be copied to another "
            "process (TypeError: cannot pickle '_thread.lock' object); create it inside the function",
        ),
        # a module of the notebook's folder travels by value, with the lock it holds
        "a module": (
            dynamic(
                """
                def reward(prompt, completion, **info):
                    return np.mean([1.0])
                """,
                np=np,
            )["reward"],
            "reward() uses 'np' from the notebook (your module stats_here, sent by value as it is not "
            "installed, whose 'lock' is what cannot travel)",
        ),
        # imported inside the function: importable from this folder only, not in the job
        "an import": (
            dynamic(
                """
                def reward(prompt, completion, **info):
                    import only_here
                    return only_here.score(completion)
                """
            )["reward"],
            "ModuleNotFoundError: No module named 'only_here'",
        ),
        # a relative path: the job does not run in the notebook's folder
        "a file": (
            dynamic(
                """
                def reward(prompt, completion, **info):
                    with open("data.txt") as f:
                        return len(f.read()) / 3
                """
            )["reward"],
            "FileNotFoundError",
        ),
    }
    for what, (fn, expected) in cases.items():
        name = unique("refused")
        with pytest.raises(UsageError) as err:
            session.train(reward=fn, prompts=PROMPTS, steps=2, name=name, detach="local")
        message = str(err.value)
        assert expected in message, (what, message)
        assert "Nothing was submitted" in message or message.startswith(
            f"cannot send the detached run {name!r} to the process that runs it: "
        ), message
        assert name not in session.detached
        names = {j["name"] for j in session.jobs()}
        assert name not in names, f"{what}: a job was submitted"
    assert list(jobs_dir.iterdir()) == [], "a worker was started"
    sys.modules.pop("only_here", None)
    sys.modules.pop("stats_here", None)


def test_detach_from_an_embedded_service_is_refused_unless_it_is_detached_too(
    tmp_path, monkeypatch, jobs_dir
):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("OPENRL_LOCAL_DATA_DIR", str(tmp_path / "local-data"))
    plain = sessions.connect(local=True, name=unique("plain"))
    try:
        with pytest.raises(
            UsageError, match=r"stops with this\s+kernel.*connect\(local=True, detached=True\)"
        ):
            plain.train(reward=lambda p, c, **i: 1.0, prompts=PROMPTS, steps=2, detach="local")
    finally:
        sessions.disconnect(plain.name)
    detached = sessions.connect(local=True, detached=True, name=unique("det"))
    pid = detached.local.process.pid
    try:
        assert os.getsid(pid) != os.getsid(0), "the detached service is in the kernel's session"
        sessions.disconnect(detached.name)
        assert alive(pid), "disconnecting stopped the detached service"
        again = sessions.connect(local=True, detached=True, name=unique("again"))
        assert again.url == detached.url and again.local.process.pid == pid  # found, not started twice
        assert again.local.detached and not again.local.owned
        sessions.disconnect(again.name)
        assert alive(pid), "a kernel that joined it stopped it"
    finally:
        from openrl_jupyter.local import find_detached

        found = find_detached()
        if found is not None:
            found.stop()
    assert not alive(pid)


def test_k8s_detach_on_a_service_without_jobs_configured_is_a_clear_409(session):
    fn = dynamic("def reward(prompt, completion, **info):\n    return 1.0\n")["reward"]
    with pytest.raises(RequestError) as err:
        session.train(reward=fn, prompts=PROMPTS, steps=2, detach="k8s")
    assert err.value.status == 409
    assert "k8s" in str(err.value) and "--jobs-namespace" in str(err.value)


# -- detached local runs ----------------------------------------------------------------------------------
def test_pause_resume_and_stop_a_detached_run_through_its_handle(session, jobs_dir):
    job = local_job(session, "ctl", batch=2, group=4)
    assert job.where == "local" and job.process is not None and os.getsid(job.process.pid) != os.getsid(0)
    client = session.client

    def done_steps() -> int:  # the rows the run stored: one per step (trained or not)
        return client.get_run(run_id)["metrics_count"]

    run_id = wait_for(lambda: job.runs and job.runs[0], 120, "the run")
    wait_for(lambda: done_steps() >= 1, 120, "the first step")
    assert client.get_run(run_id).get("user_metadata", {}).get("openrl.job") == job.job_id
    job.pause()
    wait_for(lambda: client.get_run(run_id).get("state") == "paused", 60, "the run to pause")
    held = done_steps()
    time.sleep(2)
    assert done_steps() == held, "a paused detached run went on stepping"
    job.resume()
    wait_for(lambda: done_steps() > held, 60, "a step after resume")
    job.stop(wait=True, timeout=120)
    assert job.state == "stopped"
    assert job.process.wait(30) == 0
    assert "stopped" in job.logs()
    assert done_steps() < 500


def test_another_kernel_reads_stops_and_reads_the_log_of_a_detached_run_by_name(server, session, jobs_dir):
    """A kernel that never saw the job (a second connection with the same key) gets %openrl status
    NAME, stops it with its own reason, and reads its log: a line per step, then the stop."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from openrl_jupyter.magics import OpenRLMagics

    job = local_job(session, "other", steps=500)
    run_id = wait_for(lambda: job.runs and job.runs[0], 120, "the run")
    wait_for(lambda: session.client.get_run(run_id)["metrics_count"] >= 2, 120, "two steps")
    openrl = OpenRLMagics(shell=InteractiveShell.instance()).openrl
    other = unique("kernel2")
    os.environ["OPENRL_TOKEN"] = ALICE_KEY
    try:
        openrl(f"connect {server.url} --name {other}")
        assert job.name not in sessions.get_session(other).detached
        status = repr(openrl(f"status {job.name} --session {other}"))
        assert f"{job.name} (detached, local pid {job.process.pid})" in status, status
        flat = " ".join(status.split())  # the table wraps a long log path in its column
        assert "running" in status and "/500" in status and f"(%openrl logs {job.name})" in flat, status
        with capture_output() as out:
            openrl(f"stop {job.name} --wait --session {other}")
        assert f"detached run {job.name!r} is stopped" in out.stdout, out.stdout
        assert job.process.wait(30) == 0
        with capture_output() as out:
            openrl(f"logs {job.name} --lines 0 --session {other}")
        log = out.stdout
        assert re.search(rf"{job.name} step 1/500: reward \d\.\d{{3}} \(min [0-9.]+, max [0-9.]+\)", log), log
        assert f"{job.name} step 2/500" in log and "stopped with %openrl stop" in log, log
        assert "from the panel" not in log
    finally:
        os.environ.pop("OPENRL_TOKEN", None)
        if other in sessions.sessions():
            sessions.disconnect(other)


def test_the_step_line_says_what_a_step_did():
    row = {
        "step": 3,
        "reward_mean": 0.25,
        "reward_min": 0.0,
        "reward_max": 1.0,
        "failed": 1,
        "loss": 0.0123,
        "trained": 4,
        "reward_name": "letters",
        "reward_version": 2,
        "elapsed_s": 1.42,
    }
    assert worker.step_line(row, "letters-long", 20) == (
        "letters-long step 3/20: reward 0.250 (min 0, max 1, 1 failed) loss 0.0123, by letters v2, 1.4 s"
    )
    idle = worker.step_line(
        {"step": 4, "reward_mean": 1.0, "reward_min": 1.0, "reward_max": 1.0, "trained": 0}, "r", None
    )
    assert idle == "r step 4/?: reward 1.000 (min 1, max 1) (nothing trained: no sample had an advantage)"


def test_a_stop_sent_right_after_submit_stops_the_job_before_it_trains(session, jobs_dir):
    job = local_job(session, "early", steps=6)
    paused = local_job(session, "held", steps=6)
    job.stop()  # before the worker has even fetched its payload: the service records it on the job
    paused.pause()  # the same for a pause: its run starts paused
    job.wait(120)
    assert job.state == "stopped", (job.entry, job.logs())
    assert job.process.wait(30) == 0
    assert all(session.client.get_run(rid)["metrics_count"] < 6 for rid in job.runs), job.logs()
    run_id = wait_for(lambda: paused.runs and paused.runs[0], 120, "the paused job's run")
    wait_for(lambda: session.client.get_run(run_id)["state"] == "paused", 60, "its run to be paused")
    held = session.client.get_run(run_id)["metrics_count"]
    time.sleep(1.5)
    # paused at once: at most the step already under way when the worker read the job's control
    # (none once the service applies a recorded pause to the run it creates)
    assert held <= 1 and session.client.get_run(run_id)["metrics_count"] == held, paused.logs()
    paused.stop(wait=True, timeout=120)
    assert paused.state == "stopped" and paused.process.wait(30) == 0


def test_a_job_whose_run_stays_paused_on_an_error_fails_and_its_worker_exits(session, jobs_dir, monkeypatch):
    monkeypatch.setenv("OPENRL_JOB_PAUSED_ERROR_S", "3")
    fn = dynamic(
        """
        import os
        def reward(prompt, completion, **info):
            if "OPENRL_JOB_ID" in os.environ:  # in the job only, not in the submit-time proof
                raise ValueError("broken in the job")
            return 1.0
        """
    )["reward"]
    job = local_job(session, "perr", fn, steps=4)
    with pytest.raises((jobs.JobPaused, jobs.JobFailed)) as err:  # never blocks forever
        job.wait(180)
    assert "paused on error" in str(err.value) and "broken in the job" in str(err.value), str(err.value)
    wait_for(lambda: job.state == "failed", 60, "the job to fail after OPENRL_JOB_PAUSED_ERROR_S")
    assert "paused on error" in job.entry["message"] and "OPENRL_JOB_PAUSED_ERROR_S" in job.entry["message"]
    assert job.process.wait(30) == worker.EXIT_FAILED, job.logs()


def test_deleting_a_running_local_job_ends_its_worker(session, jobs_dir):
    job = local_job(session, "del")
    wait_for(lambda: job.runs, 120, "the run")
    # DELETE from elsewhere (not this handle, which would also signal its child): the worker finds
    # its key revoked and exits by itself
    session.client.delete_job(job.job_id)
    assert job.process.wait(60) == worker.EXIT_FAILED, job.logs()
    assert "the job is gone" in job.logs()


def test_a_worker_that_dies_without_reporting_is_reported_failed_by_its_kernel(session, jobs_dir):
    fn = dynamic("def reward(prompt, completion, **info):\n    return 1.0\n")["reward"]
    job = session.train(reward=fn, prompts=PROMPTS, steps=500, name=unique("killed"), detach="local")
    job.process.kill()
    job.process.wait(30)
    with pytest.warns(UserWarning, match="killed by SIGKILL"):
        assert job.state == "failed"
    assert "killed by SIGKILL without reporting" in job.entry["message"]
    with pytest.raises(jobs.JobFailed, match="SIGKILL"):
        job.wait(5)
    with Client(session.url, token=ALICE_KEY) as c:
        assert c.get_job(job.name)["state"] == "failed"


def test_a_sigterm_without_a_stop_reports_nothing_so_a_retry_can_take_over(session, jobs_dir):
    """Kubernetes preemption or a node drain sends SIGTERM: the job must stay open (its key valid)
    for the retry pod; here the kernel that started the worker reports it failed once it sees it gone."""
    job = local_job(session, "term")
    wait_for(lambda: job.runs, 120, "the run")
    job.process.send_signal(signal.SIGTERM)
    assert job.process.wait(60) == worker.EXIT_TERMINATED, job.logs()
    with Client(session.url, token=ALICE_KEY) as c:
        assert c.get_job(job.job_id)["state"] == "running"  # not stopped: the key still works
    with pytest.warns(UserWarning, match="exited with code 143"):
        assert job.state == "failed"
    # the run's session ends (reaped, or deleted): a job's run keeps its history on the service until
    # the job is deleted, so the view and a new attach still show every step
    view = session.attach(job.name)
    steps = [row["step"] for row in view.history]
    assert steps, view
    (run_id,) = job.runs
    session.client.delete_run(run_id)
    view.refresh()
    assert view.done
    assert [row["step"] for row in view.history] == steps
    assert [row["step"] for row in session.attach(job.name).history] == steps


def test_the_worker_skips_a_payload_version_it_cannot_load_and_keeps_the_notebooks_numbering(monkeypatch):
    import base64

    from openrl_jupyter.rewards import registry

    w = worker._Worker("http://127.0.0.1:9", "tml-job-x", "job-x")
    reported = []
    monkeypatch.setattr(w, "report", lambda state, message=None, **f: reported.append((state, message)))
    name = f"r_{uuid.uuid4().hex[:6]}"
    fn = dynamic("def reward(prompt, completion, **info):\n    return 0.5\n")["reward"]
    good = jobs.dumps(
        {
            "type": "reward",
            "rewards": [{**jobs.reward_entry(fn), "name": name, "pinned": False, "version": 4}],
        },
        "t",
    )
    bad = base64.b64encode(b"not a pickle").decode()
    w.apply(
        [{"version": 2, "payload": bad, "sha256": None}, {"version": 3, **jobs.encode(good), "sha256": None}]
    )
    assert w.seen == 3
    assert reported and reported[0][0] == "running" and "payload v2 could not be loaded" in reported[0][1]
    assert registry.latest(name).version == 4  # the notebook's number, as dashboards show it
    w.apply([])
    assert w.seen == 3


def test_the_worker_refuses_a_payload_of_another_python_or_cloudpickle():
    import cloudpickle

    with pytest.raises(Exception, match=r"python 2\.7 \(the notebook\) vs 3\.\d+ \(this worker\)"):
        worker.check_versions({"python": "2.7.18", "cloudpickle": cloudpickle.__version__})
    with pytest.raises(Exception, match=r"cloudpickle 0\.1 \(the notebook\) vs"):
        worker.check_versions({"python": ".".join(map(str, sys.version_info[:3])), "cloudpickle": "0.1"})
    worker.check_versions(
        {"python": ".".join(map(str, sys.version_info[:3])), "cloudpickle": cloudpickle.__version__}
    )


def test_the_volume_flag_is_named_as_typed():
    from types import SimpleNamespace

    from openrl_jupyter.magic_args import detach_kwargs

    a = SimpleNamespace(image=None, volumes=["data"], cpu=None, memory=None, detach="local")
    with pytest.raises(UsageError, match=r"^--volume go with --detach k8s"):
        detach_kwargs(a)


def test_the_jobs_posts_that_must_not_be_resent_are_not_and_names_are_quoted():
    from openrl_jupyter import client

    assert client.get_job("a/b c").path.endswith("/jobs/a%2Fb%20c")
    assert not client.create_job(name="x").resend
    assert not client.job_state("j", "failed").resend
    assert not client.add_payload("j", "p", "s").resend
    assert client.job_control("j", "stop").resend and client.get_run("r").resend

    import httpx

    from openrl_jupyter._exceptions import ServiceUnavailable

    sent = []

    def lost(request):  # the request went out; its reply never came back
        sent.append(request.url.path)
        raise httpx.ReadError("connection reset", request=request)

    with Client("http://svc", token="t", transport=httpx.MockTransport(lost), backoff_s=0) as c:
        with pytest.raises(ServiceUnavailable):
            c.create_job(name="x")
        assert sent == ["/openrl/v1/jobs"]  # once: a re-send could submit it twice
        sent.clear()
        with pytest.raises(ServiceUnavailable):
            c.job_control("j", "stop")
        assert len(sent) == 1 + c.retries  # an idempotent control is re-sent as before


CELL_REWARD_V1 = """%%openrl reward gated
import os, time
def reward(prompt, completion, **info):
    # in the job (not in the submit-time proof), step 1 waits here until the test opens the gate
    while "OPENRL_JOB_ID" in os.environ and not os.path.exists(GATE):
        time.sleep(0.05)
    return scoring.score(completion)
"""
CELL_REWARD_V2 = """%%openrl reward gated
def reward(prompt, completion, **info):
    return 1.0 - scoring.score(completion)
"""


def test_a_detached_run_outlives_its_kernel_and_a_new_kernel_attaches_to_its_whole_history(
    server, tmp_path, jobs_dir
):
    notebook = tmp_path / "notebook"
    notebook.mkdir()
    (notebook / "scoring.py").write_text(
        "def score(c):\n    return sum(ch.isalpha() for ch in c) / max(1, len(c))\n"
    )
    gate = tmp_path / "gate"
    name = unique("outlive")
    env = {"OPENRL_URL": server.url, "OPENRL_TOKEN": ALICE_KEY, "OPENRL_JOBS_DIR": str(jobs_dir)}
    steps = 5
    with Kernel(env=env, cwd=notebook) as k:
        k.execute("%load_ext openrl_jupyter\n%openrl connect", timeout=60)
        k.execute(
            f"import scoring\nGATE = {str(gate)!r}\nP = {PROMPTS!r}"
        )  # a module of the notebook's folder
        assert "reward gated v1 registered" in k.execute(CELL_REWARD_V1).stdout
        k.execute(
            f"job = %openrl train --reward gated --prompts P --steps {steps} --batch 2 --group 4 "
            f"--max-tokens 6 --name {name} --detach local",
            timeout=120,
        )
        worker = int(k.execute("print(job.process.pid)").stdout)
        # the worker has its payloads and created its run: step 1 now waits at the gate
        k.execute("import time\nwhile not job.runs:\n    time.sleep(0.2)", timeout=120)
        # the reward is redefined while step 1 waits at the gate: the job gets v2 from step 2 on
        out = k.execute(CELL_REWARD_V2, timeout=120).stdout
        assert "reward gated v2 registered" in out and f"sent to detached {name} (its payload v2)" in out
        kernel_pid = k.km.provisioner.process.pid
        os.killpg(os.getpgid(kernel_pid), signal.SIGKILL)  # the kernel and its whole process group
        wait_for(lambda: not alive(kernel_pid), 10, "the kernel to die")
        assert alive(worker), "the worker died with the kernel"

    # a new kernel attaches while the job runs (its step 1 still waits at the gate)
    with Kernel(env=env) as k2:
        k2.execute("%load_ext openrl_jupyter\n%openrl connect", timeout=60)
        out = k2.execute(
            f"view = %openrl attach {name}\n"
            "import time\n"
            "deadline = time.monotonic() + 30\n"  # the worker reports "running" once its run exists
            "while view.state != 'running' and time.monotonic() < deadline:\n"
            "    time.sleep(0.1)\n"
            "    view.refresh()\n"
            "print(view.state, view.step)",
            timeout=60,
        ).stdout
        assert out.split() == ["running", "0"], out
        listing = k2.execute("table = %openrl runs\nprint(repr(table))", timeout=60).stdout
        row = next(line for line in listing.splitlines() if line.startswith(name))
        assert f"local pid {worker}" in row and "running" in row and f"0/{steps}" in row, listing
        shown = k2.execute("view", timeout=60)
        assert shown.comm_opens, "displaying the attached run opened no dashboard"
        # the magics control a detached run by name: pause after step 1, then resume
        out = k2.execute(f"%openrl pause {name}", timeout=60).stdout
        assert f"asked detached run {name!r} to pause" in out
        gate.write_text("open")
        out = k2.execute(
            "deadline = time.monotonic() + 60\n"
            "while view.state != 'paused' and time.monotonic() < deadline:\n"
            "    time.sleep(0.1)\n"
            "    view.refresh()\n"
            "time.sleep(1.5)\n"
            "view.refresh()\n"
            "print(view.state, view.step)",
            timeout=90,
        ).stdout
        assert out.split() == ["paused", "1"], out
        assert f"asked detached run {name!r} to resume" in k2.execute(f"%openrl resume {name}").stdout

        def finished(msgs) -> bool:
            return any(f"{steps}/{steps}" in json.dumps(m["content"]) for m in of_type(msgs, "comm_msg"))

        updates = k2.drain(240, until=finished)
        assert finished(updates), "the attached dashboard never showed the last step"
        assert len(of_type(updates, "comm_msg")) >= 3, "expected several live updates while no cell ran"

        out = k2.execute(
            "view.wait(120)\n"
            "print([r['step'] for r in view.history])\n"
            "print([r['reward_version'] for r in view.history])\n"
            "print(view.state, view.step, view.total_steps)",
            timeout=180,
        ).stdout.splitlines()
        assert out[0] == str(list(range(1, steps + 1))), out  # every step, from the service
        assert out[1] == str([1] + [2] * (steps - 1)), out  # hot swap from the next step on
        assert out[2] == f"finished {steps} {steps}"
        with Client(server.url, token=ALICE_KEY) as c:
            entry = c.get_job(name)
        assert entry["state"] == "finished" and entry["where"] == "local" and entry["pid"] == worker
        wait_for(lambda: not alive(worker), 30, "the worker to exit")

    # and any later kernel sees the whole history too
    with Kernel(env=env) as k3:
        k3.execute("%load_ext openrl_jupyter\n%openrl connect", timeout=60)
        out = k3.execute(
            f"view = %openrl attach {name}\nprint([r['step'] for r in view.history], view.state)", timeout=60
        ).stdout
        assert out.strip() == f"{list(range(1, steps + 1))} finished"
        shown = k3.execute("view", timeout=60)
        assert f"step {steps}/{steps}" in shown.outputs[-1]["text/plain"]
        listing = k3.execute("table = %openrl runs\nprint(repr(table))", timeout=60).stdout
        row = next(line for line in listing.splitlines() if line.startswith(name))
        assert f"local pid {worker}" in row and "finished" in row and f"{steps}/{steps}" in row


def test_a_detached_sweep_with_the_sql_reward_rebuilds_its_databases_and_labels_its_runs(session, jobs_dir):
    from openrl_jupyter import sql as sql_data
    from openrl_jupyter.sql.reward import sql_reward

    examples = sql_data.generate(0, per_template=1).train[:2]
    prompts = [{"prompt": sql_data.render_prompt(e), **e} for e in examples]
    assert all("db_path" not in p for p in prompts)  # the job rebuilds the databases from db_id + seed
    name = unique("dsweep")
    job = session.sweep(
        reward=sql_reward,  # a function of an installed package: it travels by reference
        prompts=prompts,
        grid={"lr": [1e-4, 3e-4]},
        steps=2,
        rungs=0,
        batch=2,
        group=2,
        max_tokens=8,
        name=name,
        detach="local",
    )
    assert job.kind == "sweep" and job.where == "local"
    job.wait(240)
    assert job.state == "finished", job.logs()
    client = session.client
    runs = [client.get_run(rid) for rid in job.runs]
    assert sorted(r["name"] for r in runs) == [f"{name}-lr1e-4", f"{name}-lr3e-4"]
    for r in runs:
        assert r["user_metadata"] == {"openrl.job": job.job_id, "openrl.sweep": name}
    rows = job.history
    assert sorted((r["run"], r["step"]) for r in rows) == sorted((r["name"], s) for r in runs for s in (1, 2))
    assert all(r["failed"] == 0 and r["reward_name"] == "sql_reward" for r in rows), rows
    from types import SimpleNamespace

    from IPython.core.interactiveshell import InteractiveShell

    from openrl_jupyter.magics import OpenRLMagics

    table = OpenRLMagics(shell=InteractiveShell.instance())._runs(
        SimpleNamespace(session=session.name, prune=False)
    )
    row = next(line for line in repr(table).splitlines() if line.startswith(name))
    assert "2/2 per run" in row and "halved" not in row, row  # per run, not 4/4 summed over runs
    message = job.entry["message"]
    assert message.startswith(f"best {name}-lr"), message
    assert "saved tinker://" in message and f"{name}-best" in message, message


def test_a_sweep_in_the_kernel_labels_its_runs_with_its_name_too(session):
    fn = dynamic("def reward(prompt, completion, **info):\n    return len(completion) / 10\n")["reward"]
    name = unique("lsweep")
    sweep = session.sweep(
        reward=fn,
        prompts=PROMPTS,
        grid={"seed": [1, 2]},
        steps=1,
        rungs=0,
        batch=1,
        group=2,
        max_tokens=4,
        name=name,
        save_best=False,
    )
    sweep.wait(120)
    for run in sweep.runs:
        assert session.client.get_run(run.run_id)["user_metadata"] == {"openrl.sweep": name}


def test_k8s_detach_creates_the_kubernetes_job_and_its_pod_command_runs_with_the_job_key(
    session, server, tmp_path, monkeypatch
):
    """--detach k8s through the service and the real KubeLauncher (against kmock, an in-process
    Kubernetes API); then the Job's container command is run here with the environment its pod
    would get (the key from the Secret, spec.json from the ConfigMap): the run finishes, labelled
    with its job, and the job's key stops working once the job has ended."""
    import subprocess

    from openrl_service.kube import KubeLauncher, KubeSettings
    from tests.k8s.kubeapi import KubeAPI, pod_command_and_env

    image = "ghcr.io/openrl-jupyter/openrl-notebook:0.1.0"
    api = KubeAPI()
    try:
        settings = KubeSettings(namespace="openrl", images=[image], service_url=server.url)
        monkeypatch.setattr(server.parts, "kube", KubeLauncher(settings, api_client=api.client))
        fn = dynamic("def reward(prompt, completion, **info):\n    return len(completion) / 10\n")["reward"]
        with pytest.raises(RequestError) as err:  # the service checks the request, not the notebook
            session.train(reward=fn, prompts=PROMPTS, steps=2, detach="k8s", k8s={"image": "evil/img:1"})
        assert err.value.status == 400 and "k8s.image" in str(err.value)
        assert not api.objects("jobs")
        job = session.train(
            reward=fn,
            prompts=PROMPTS,
            steps=2,
            batch=2,
            group=2,
            max_tokens=4,
            name=unique("pod"),
            detach="k8s",
            k8s={"image": image, "cpu": "1", "memory": "2Gi"},
        )
        assert job.where == "k8s" and job.process is None and job.log_path is None
        assert "key" not in job.entry
        command, env = pod_command_and_env(api, job.entry["k8s"]["job"], tmp_path / "pod")
    finally:
        api.close()
    assert command == ["python", "-m", "openrl_jupyter.jobs", "worker"]
    assert env["OPENRL_TOKEN"].startswith("tml-job-") and env["OPENRL_URL"] == server.url
    pod_env = {k: v for k, v in os.environ.items() if not k.startswith("OPENRL_")}  # PATH, PYTHONPATH
    home = tmp_path / "home"
    home.mkdir()
    pod_env.update(env, HOME=str(home))
    log = tmp_path / "pod.log"
    with open(log, "wb") as out:
        done = subprocess.run(
            [sys.executable, *command[1:]],
            env=pod_env,
            cwd=home,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    assert done.returncode == 0, log.read_text()
    job.wait(30)
    assert job.state == "finished" and job.entry["host"], job.entry
    (run_id,) = job.runs
    assert session.client.get_run(run_id)["user_metadata"] == {"openrl.job": job.job_id}
    assert [r["step"] for r in job.history] == [1, 2]
    with Client(server.url, token=env["OPENRL_TOKEN"], retries=0) as c:  # the job's end revoked its key
        with pytest.raises(Exception) as revoked:
            c.get_job(job.job_id)
        assert getattr(revoked.value, "status", None) == 401


def test_the_sql_reward_rebuilds_a_database_the_job_does_not_have_from_its_seed(tmp_path):
    from openrl_jupyter import sql as sql_data
    from openrl_jupyter.sql.reward import sql_reward

    example = sql_data.generate(0, per_template=1).train[0]
    kernel_only = tmp_path / "not-in-the-job" / "db.sqlite"  # a path of the notebook's machine
    assert sql_reward("q", example["sql"], **{**example, "db_path": str(kernel_only)}) == 1.0
    assert sql_reward("q", "SELECT 1", **{**example, "db_path": str(kernel_only)}) == 0.0


def test_a_detached_run_plays_a_registered_environment_by_value(session, jobs_dir):
    """An environment registered in this kernel travels to the detached run by value (as a pinned reward
    does) and its episodes train there: the run's stored rows count the turns."""
    from openrl_jupyter.env import envs

    ns = dynamic(
        """
        from openrl_jupyter.env import Env, ModelInput, StepResult

        class Echo(Env):
            def __init__(self, prompt, info):
                self.prompt = list(prompt.encode())
                self.turn = 0

            async def initial_observation(self):
                return ModelInput.from_ints(self.prompt), [10]

            async def step(self, action, *, extra=None):
                self.turn += 1
                done = self.turn == 2
                ob = ModelInput.from_ints([]) if done else ModelInput.from_ints(self.prompt + action + [10])
                return StepResult(len(action) / 10, done, ob, [10])
        """
    )
    name = unique("echo").replace("-", "_")
    envs.register(name, ns["Echo"])
    job = session.train(
        env=name,
        prompts=PROMPTS,
        steps=2,
        name=unique("envjob"),
        detach="local",
        batch=1,
        group=2,
        max_tokens=4,
    )
    job.wait(300)
    assert job.state == "finished", job.logs()
    rows = session.client.metrics(job.runs[0])
    assert [r["step"] for r in rows] == [1, 2] and all(r["turns"] == 2 for r in rows)
    assert rows[-1]["reward_name"] == "Echo"


def test_a_detached_run_takes_weighted_rewards_and_the_rl_knobs(session, jobs_dir):
    fns = dynamic(
        "def lettered(prompt, completion, **info):\n"
        "    return sum(c.isalpha() for c in completion) / max(1, len(completion))\n"
        "def short(prompt, completion, **info):\n"
        "    return 1.0 / (1 + len(completion))\n"
    )
    metric = f"metric_{time.monotonic_ns()}"
    from openrl_jupyter.rewards import registry

    registry.register(metric, fns["short"])
    job = session.train(
        reward={fns["lettered"]: 1.0, fns["short"]: 0.5},
        prompts=PROMPTS,
        steps=2,
        name=unique("knobs"),
        detach="local",
        batch=1,
        group=2,
        max_tokens=4,
        epochs=2,
        kl_coef=0.1,
        lr=1e-3,
        lr_schedule="cosine",
        loss_agg="sequence",
        top_k=20,
        save_every=2,
        skip_zero_variance=False,
        eval_every=2,
        eval_prompts=["Held out:"],
        eval_metric=metric,  # a registered name: it travels by value, as the rewards do
    )
    job.wait(240)
    assert job.state == "finished", job.logs()
    rows = session.client.metrics(job.runs[0])
    assert len(rows) == 2
    assert {"rewards/lettered", "rewards/short", "eval_reward", "skipped_groups"} <= set(rows[-1])
    trained = [r for r in rows if r.get("updates")]
    assert trained and all(r["updates"] == 2 and r["kl_ref"] >= 0 for r in trained)
    # cosine over 2 steps × 2 updates: the rate of each step's last update, as the service stepped
    expected = {1: 1e-3 * 0.5 * (1 + math.cos(math.pi / 4)), 2: 1e-3 * 0.5 * (1 + math.cos(3 * math.pi / 4))}
    assert {r["step"]: r["learning_rate"] for r in trained} == pytest.approx(
        {r["step"]: expected[r["step"]] for r in trained}
    )
    assert rows[-1]["reward_mean"] == pytest.approx(
        rows[-1]["rewards/lettered"] + 0.5 * rows[-1]["rewards/short"]
    )
