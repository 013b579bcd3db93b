"""The one way this project starts ``openrl-service serve`` as a child on loopback, and checks it is that child.

    service = start_service(api_key=key)          # waits for /readyz; stops when this process exits
    ... Client(service.url, token=key) ...
    service.stop()

Used by ``connect(local=True)``, the demos, the benchmarks and the tests. The child binds port 0
itself and writes the URL it got to a pipe only this process reads (``--report-fd``); this process makes
a start secret for it (in its environment) and sends it nothing of value until ``/readyz`` proves it
holds that secret for that port (``wait_ready``; openrl_common/datadirs.py), so another account on the
host cannot take its place on a port it guessed. The child runs with
``--exit-with-parent``: it watches a pipe on its stdin and stops when this process closes it, exits
or dies, so no service outlives its owner. It runs in a process session of its own, so the signals a
kernel's interrupt or shutdown sends to its process group never reach it: the pipe alone stops it, with
one clean drain. Its output goes to ``service.log`` in its data folder.
``start_service(detached=True)`` is the exception, for detached runs: no ``--exit-with-parent`` (a
kernel's death does not stop it), a persistent data folder,
and a discovery file marked ``"detached": true`` by which ``find_detached()`` finds it again from
the next kernel. No torch here (the notebook side imports this module).

The notebook's embedded service (``connect(local=True)``, ``start_local``) keeps its data in one
folder of the user's, ``local_data_dir()`` (the Jupyter data folder's ``openrl-local``, or
``$OPENRL_LOCAL_DATA_DIR``), with the key the service generated there (``api-key``, mode 0600): what
a run saved and the key that reads it are the same after a kernel restart. One service owns a data
folder (its lock, ``openrl-service.lock``, names its pid and URL), so a second kernel of the user
finds it by that lock and joins it (``running_on``, after the same proof, with the secret the folder
keeps in ``instance-secret``) instead of starting another; ``openrl-service stop --data-dir DIR`` (or
``openrl_common.datadirs.stop_on(DIR)``) stops whichever holds it.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from openrl_common.datadirs import (
    DISCOVERY_PREFIX,
    KEY_NAME,
    SECRET_ENV,
    SECRET_NAME,
    alive,
    discovery_dir,
    gone,
    local_data_dir,
    lock_holder,
    loopback_url,
    proves,
    read_private,
    read_private_json,
)
from openrl_common.files import write_atomic
from openrl_jupyter._exceptions import ServiceUnavailable

READY_TIMEOUT_S = 300.0
PROVE_TIMEOUT_S = 60.0  # a running service that lost a connection: how long it has to prove itself again
EXIT_DATA_DIR_IN_USE = 3  # serve's exit code when another process holds its data folder
LOG_KEEP_BYTES = 4 << 20  # a kept data folder's service.log: the older part is dropped past this
# At this process's exit: how long an embedded service may drain before it is killed. Above the default
# drain grace (25 s, OPENRL_DRAIN_GRACE_S) plus closing, so its shutdown snapshot is not cut; an idle
# one exits in well under a second.
EXIT_DRAIN_WAIT_S = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it), for tests that run a server of their own.
    Not for a service that will receive a key: another process may bind it first (start_service has
    the service bind port 0 itself)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Running:
    """A detached service found by its discovery file: the pid is all this process has of it."""

    def __init__(self, pid: int):
        self.pid = pid
        self.stdin = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and gone(self.pid):
            self.returncode = 0
        return self.returncode

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.1)
        return self.returncode or 0


@dataclass
class LocalService:
    """An ``openrl-service`` child process on loopback."""

    process: subprocess.Popen | _Running
    url: str
    data_dir: str
    key: str | None = field(default=None, repr=False)  # None with --no-auth
    # the start secret /readyz proves it holds (None: unknown, and then this process sends it no key)
    secret: str | None = field(default=None, repr=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)
    discovery_path: str | None = None  # set by advertise(): removed again on stop()
    log_file: str | None = None  # where its output goes (None: its data folder's service.log)
    detached: bool = False  # outlives this process (start_service(detached=True) or find_detached())
    owned: bool = True  # started by this process; False: joined (another kernel's, or found running)

    @property
    def log_path(self) -> str:
        return self.log_file or os.path.join(self.data_dir, "service.log")

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the service's output."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def check(self, suspect: bool) -> None:
        """Before a request carries the key here (a Client's ``guard``): the service's process must
        live (once it exits its port is anyone's), and after a connection failure (``suspect``) the URL
        must prove again that it is this service (:func:`wait_ready`). Raises ServiceUnavailable."""
        if self.process.poll() is not None:
            raise ServiceUnavailable(
                f"the embedded openrl service (pid {self.process.pid}) has exited, so nothing is sent to "
                f"{self.url} any more (its port is free for anyone to take); connect again "
                "(%openrl connect --local) to start it anew. Its log: " + self.log_path
            )
        if suspect:
            wait_ready(self, "", PROVE_TIMEOUT_S, ready=False)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop gracefully (close the pipe it watches), kill after ``timeout_s``; remove a temporary
        data folder."""
        if self.process.poll() is None:
            if self.process.stdin is not None:
                with contextlib.suppress(OSError):
                    self.process.stdin.close()  # the child's watcher stops it gracefully
            else:  # a detached service watches no pipe: SIGTERM stops it gracefully
                self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.discovery_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.discovery_path)
            self.discovery_path = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def advertise(service: LocalService) -> str | None:
    """Tell this user's Jupyter server (the OpenRL panel) where the embedded service is and its key:
    ``{"url", "token", "pid"}`` in ``<runtime dir>/openrl-local-<pid>.json``, created with mode 0600
    (the key must not be readable by other users); ``service.stop()`` removes it. Returns its path."""
    folder = discovery_dir()
    if folder is None:
        return None
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for stale in glob.glob(os.path.join(folder, f"{DISCOVERY_PREFIX}*.json")):  # killed kernels' files
        pid = os.path.basename(stale)[len(DISCOVERY_PREFIX) : -len(".json")]
        if pid.isdigit() and not alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(stale)
    path = os.path.join(folder, f"{DISCOVERY_PREFIX}{service.process.pid}.json")
    info = {"url": service.url, "token": service.key, "pid": service.process.pid}
    if service.detached:
        info.update(detached=True, data_dir=service.data_dir)
    body = json.dumps(info)
    write_atomic(path, body, mode=0o600)  # readers never see a half-written file
    service.discovery_path = path
    return path


def discovered(folder: str | None = None) -> dict | None:
    """The newest discovery file whose service process is alive: ``{"url", "token", "pid", "path"}``;
    None when there is none. Files of dead processes (a killed kernel) are skipped."""
    folder = folder or discovery_dir()
    if folder is None:
        return None
    found = []
    for path in glob.glob(os.path.join(folder, f"{DISCOVERY_PREFIX}*.json")):
        info = read_private_json(path)
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            continue
        if info is None or not isinstance(info.get("url"), str):
            continue
        if not isinstance(info.get("pid"), int) or not alive(info["pid"]):
            continue
        found.append((mtime, {**info, "path": path}))
    return max(found, key=lambda t: t[0])[1] if found else None


def find_detached(folder: str | None = None) -> LocalService | None:
    """A running detached embedded service (``start_service(detached=True)``) of this user, found by
    its discovery file; None when there is none."""
    folder = folder or discovery_dir()
    if folder is None:
        return None

    def mtime(path: str) -> float:
        try:
            return os.path.getmtime(path)
        except OSError:
            return 0.0

    # the newest first (by when it was written, not by its pid's digits)
    for path in sorted(glob.glob(os.path.join(folder, f"{DISCOVERY_PREFIX}*.json")), key=mtime, reverse=True):
        info = read_private_json(path)
        if info is None or info.get("detached") is not True:
            continue
        pid = info.get("pid")
        if isinstance(pid, int) and isinstance(info.get("url"), str) and alive(pid):
            data_dir = str(info.get("data_dir") or "")
            return LocalService(
                _Running(pid),
                info["url"],
                data_dir,
                info.get("token"),
                read_private(os.path.join(data_dir, SECRET_NAME)) if data_dir else None,
                discovery_path=path,
                detached=True,
            )
    return None


def running_on(data_dir: str | os.PathLike[str]) -> LocalService | None:
    """The service that holds ``data_dir`` (another kernel's embedded service, a detached one, or one
    started by hand with ``--data-dir``), to join: its URL from the lock, its key from the folder's
    ``api-key`` (None if it was started with other keys) and its start secret from ``instance-secret``
    (checked by :func:`wait_ready` before the key goes anywhere). ``detached``: it does not stop with
    the process that started it. None when nothing holds the folder."""
    holder = lock_holder(data_dir)
    url = loopback_url(holder.get("url") if holder is not None else None)
    if holder is None or url is None:
        return None  # the key goes to a loopback service only
    pid = holder["pid"]
    return LocalService(
        _Running(pid),
        url,
        os.fspath(data_dir),
        read_private(os.path.join(data_dir, KEY_NAME)),
        read_private(os.path.join(data_dir, SECRET_NAME)),
        detached=b"--exit-with-parent" not in _cmdline(pid),
        owned=False,
    )


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b"--exit-with-parent"  # no /proc (macOS): assume it stops with its parent


def start_service(
    *,
    model: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    api_key: str | None = None,
    auth: bool = True,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_level: str = "warning",
    timeout_s: float = READY_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
    detached: bool = False,
    python: str | None = None,
    log_path: str | None = None,
    inherit_env: bool = True,
) -> LocalService:
    """Start a service and return it once ``/readyz`` answers ready.

    ``api_key``: the key it accepts (tenant "default"), passed through the environment, never the
    command line; without one it generates its own into its data folder, or reuses the one there
    (``service.key`` is read from there; keys in this process's environment are not passed on, keys
    in ``env`` are);
    ``auth=False`` serves without keys. ``data_dir``: a temporary folder by default (removed
    on ``stop``). ``args``: more ``serve`` flags (``--device``, ``--fusion``...); ``env``: more
    environment. ``progress`` is told once if the start takes more than a second. ``detached``:
    outlive this process (see the module docstring); its data folder defaults to
    ``local_data_dir()``. ``python``: the interpreter that runs it (another environment's, e.g. one
    with vLLM; default this one). ``log_path``: where its output goes (default its data folder's
    ``service.log``). ``inherit_env=False``: the child's environment is ``env`` alone (plus the
    key and the start secret), not this process's.
    """
    tmp = None
    if data_dir is None and detached:
        data_dir = local_data_dir(model)
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="openrl-local-")
        data_dir = tmp.name
    data_dir = os.fspath(data_dir)
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    child_env = dict(os.environ) if inherit_env else {}
    if api_key is None and auth:  # the data folder's own key, not keys (or a hub) this process has
        for var in ("OPENRL_API_KEYS", "OPENRL_API_KEYS_FILE", "OPENRL_HUB_API_URL"):
            child_env.pop(var, None)
    child_env.update(env or {})  # what the caller passes on purpose is kept
    if api_key is not None:
        child_env["OPENRL_API_KEYS"] = f"default:{api_key}"
    secret = secrets.token_hex(32)  # /readyz proves the service holds it before any key is sent
    child_env[SECRET_ENV] = secret
    log_path = log_path or os.path.join(data_dir, "service.log")
    _trim_log(log_path)
    cmd = [python or sys.executable, "-m", "openrl_service.cli", "serve"]
    if not detached:
        cmd.append("--exit-with-parent")
    report, reported = os.pipe()  # serve binds port 0 itself and writes its URL here
    cmd += ["--host", "127.0.0.1", "--port", "0", "--report-fd", str(reported)]
    cmd += ["--data-dir", data_dir, "--log-level", log_level]
    if model not in (None, "tiny", "openrl/tiny"):
        cmd += ["--model", model]
    if not auth:
        cmd.append("--no-auth")
    cmd += list(args)
    log = open(log_path, "ab")  # noqa: SIM115 - owned by the child's lifetime
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL if detached else subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            # Its own session, outside the kernel's process group: a cell's interrupt (SIGINT to the group)
            # and ipykernel's shutdown (SIGTERM to the group's children, five times in 1.4 s, then
            # SIGKILL) do not reach it; an embedded one stops when the pipe on its stdin closes.
            start_new_session=True,
            pass_fds=(reported,),
        )
    finally:
        log.close()
        os.close(reported)  # the child holds its own copy: EOF here once it has written or died
    service = LocalService(proc, "", data_dir, api_key, secret, tmp, detached=detached, log_file=log_path)
    if not detached:
        atexit.register(service.stop, EXIT_DRAIN_WAIT_S)
    try:
        service.url = _reported_url(report, service, timeout_s)
        wait_ready(service, model or "openrl/tiny", timeout_s, progress)
    except BaseException:
        service.stop()
        raise
    finally:
        os.close(report)
    if service.key is None and auth:
        with contextlib.suppress(OSError), open(os.path.join(data_dir, "api-key"), encoding="utf-8") as f:
            service.key = f.read().strip()
    return service


def _trim_log(path: str) -> None:
    """A kept data folder's log keeps its newest ``LOG_KEEP_BYTES`` (a kernel a day for a year adds up)."""
    with contextlib.suppress(OSError):
        if os.path.getsize(path) > LOG_KEEP_BYTES:
            with open(path, "rb") as f:
                f.seek(-LOG_KEEP_BYTES // 2, os.SEEK_END)
                tail = f.read()
            write_atomic(path, b"(older lines dropped)\n" + tail.split(b"\n", 1)[-1], mode=0o600)


def _reported_url(fd: int, service: LocalService, timeout_s: float) -> str:
    """The URL the child bound, as it writes it to its report pipe (one JSON line) once its port is
    bound and its data folder's lock taken."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServiceUnavailable(f"the openrl service did not bind a port within {timeout_s:.0f} s")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:  # it exited before binding (its data folder was in use, a bad flag...)
            service.process.wait(10)
            _exited(service)
        data += chunk
    try:
        url = loopback_url(json.loads(data.split(b"\n", 1)[0]).get("url"))
    except (ValueError, AttributeError):
        url = None
    if url is None:
        raise ServiceUnavailable(f"the openrl service reported no loopback URL: {data[:200]!r}")
    return url


def _exited(service: LocalService) -> None:
    err = ServiceUnavailable(
        f"the openrl service exited with code {service.process.returncode}:\n{service.log_tail(2000)}"
    )
    err.exit_code = service.process.returncode
    raise err


def wait_ready(
    service: LocalService,
    model: str,
    timeout_s: float,
    progress: Callable[[str], None] | None = None,
    *,
    ready: bool = True,
) -> None:
    """Wait until ``service`` answers ready, and check that it is the service meant (its ``/readyz``
    proves it holds ``service.secret``) before anything of this process's (a key) goes there.
    ``ready=False``: the proof alone, in whatever state it is (draining, recovering)."""
    started = time.monotonic()
    shown = False
    port = urllib.parse.urlsplit(service.url).port
    with httpx.Client(base_url=service.url, timeout=5.0) as http:
        while True:
            if service.process.poll() is not None:
                _exited(service)
            challenge = secrets.token_hex(16)
            with contextlib.suppress(httpx.TransportError, ValueError):
                r = http.get("/readyz", params={"challenge": challenge})
                body = r.json()
                answered = r.status_code == 200 and body.get("status") == "ready"
                if answered or (not ready and isinstance(body, dict) and "proof" in body):
                    if service.secret is None or not proves(body, service.secret, port, challenge):
                        raise ServiceUnavailable(
                            f"{service.url} answers, but not as the openrl service of {service.data_dir} "
                            "(it cannot prove it holds that service's start secret): another process may "
                            "hold the port; no key was sent there. Stop the service on that folder "
                            f"(openrl-service stop --data-dir {service.data_dir}) and connect again"
                        )
                    return
            if time.monotonic() - started > timeout_s:
                raise ServiceUnavailable(
                    f"the openrl service at {service.url} was not "
                    f"{'ready' if ready else 'answering'} after {timeout_s:.0f} s; no key was sent there"
                )
            if progress is not None and not shown and time.monotonic() - started > 1:
                shown = True
                progress(f"starting the embedded openrl service ({model}) on {service.url} ...")
            time.sleep(0.2)
