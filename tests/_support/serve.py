"""`openrl-service serve` as a real subprocess: for tests of the command line, its signals and exit."""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from openrl_jupyter.local import free_port

READY_TIMEOUT_S = 120  # a hang guard: the tiny model loads in seconds


def cli(*args: str, env: dict | None = None) -> tuple[list[str], dict]:
    """argv and environment for `openrl-service ARGS`, free of the caller's OPENRL_* settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPENRL_", "TINKER_API_KEY"))}
    return [sys.executable, "-m", "openrl_service.cli", *args], {**clean, **(env or {})}


@dataclass
class Served:
    url: str
    proc: subprocess.Popen
    data_dir: Path
    stdout: str = ""  # filled in once the process has exited

    @property
    def stderr(self) -> str:
        return (self.data_dir / "stderr.log").read_text()


def start(
    data_dir: Path,
    tiny_model_dir: Path,
    *args: str,
    env: dict | None = None,
    port: int | None = None,
    max_file_bytes: int | None = None,
) -> Served:
    """Start `serve` on a loopback port (a free one unless given: a restart reuses its predecessor's);
    the caller waits for it (``wait_ready``) and stops it. ``max_file_bytes``: the kernel refuses to
    grow any file it writes past that size (RLIMIT_FSIZE), as a full volume would."""
    models = data_dir / "models" / "openrl-tiny"
    if not models.exists():
        shutil.copytree(tiny_model_dir, models)  # skip building the tiny model on first start
    port = port or free_port()
    argv, full_env = cli("serve", "--port", str(port), "--data-dir", str(data_dir), *args, env=env)
    with open(data_dir / "stderr.log", "ab") as err:
        limit = None if max_file_bytes is None else functools.partial(_limit_files, max_file_bytes)
        proc = subprocess.Popen(
            argv, env=full_env, stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=limit
        )
    return Served(f"http://127.0.0.1:{port}", proc, data_dir)


def _limit_files(max_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def wait_ready(served: Served) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        assert served.proc.poll() is None, served.stderr
        assert time.monotonic() < deadline, f"openrl-service did not become ready in {READY_TIMEOUT_S} s"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{served.url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.1)


def finish(served: Served, timeout_s: float = 60) -> int:
    """Wait for the process to exit (killing it after ``timeout_s``); keep its stdout; its exit code."""
    try:
        served.stdout = served.proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        served.proc.kill()
        served.stdout = served.proc.communicate()[0]
    return served.proc.returncode


@contextlib.contextmanager
def serving(data_dir: Path, tiny_model_dir: Path, *args: str, **options):
    """`openrl-service serve` as a subprocess on a loopback port (free unless given), ready;
    SIGTERM'd on exit. ``options``: those of :func:`start`."""
    data_dir.mkdir(parents=True, exist_ok=True)
    served = start(data_dir, tiny_model_dir, *args, **options)
    try:
        wait_ready(served)
        yield served
    finally:
        if served.proc.returncode is None:  # not already waited for by the test
            served.proc.terminate()
            # the drain's grace (25 s) and then the shutdown; a slow machine needs its margin
            finish(served, 60)
