"""The one way this project starts ``openrl-service serve`` as a child on a free loopback port.

    service = start_service(api_key=key)          # waits for /readyz; stops when this process exits
    ... Client(service.url, token=key) ...
    service.stop()

Used by ``connect(local=True)``, the demos, the benchmarks and the tests. The child runs with
``--exit-with-parent``: it watches a pipe on its stdin and stops when this process closes it, exits
or dies, so no service outlives its owner. Its output goes to ``service.log`` in its data folder.
``start_service(detached=True)`` is the exception, for detached runs: no ``--exit-with-parent``, its
own process session (a kernel's death or interrupt does not reach it), a persistent data folder,
and a discovery file marked ``"detached": true`` by which ``find_detached()`` finds it again from
the next kernel. No torch here (the notebook side imports this module).

The notebook's embedded service (``connect(local=True)``, ``start_local``) keeps its data in one
folder of the user's, ``local_data_dir()`` (the Jupyter data folder's ``openrl-local``, or
``$OPENRL_LOCAL_DATA_DIR``), with the key the service generated there (``api-key``, mode 0600): what
a run saved and the key that reads it are the same after a kernel restart. One service owns a data
folder (its lock, ``openrl-service.lock``, names its pid and URL), so a second kernel of the user
finds it by that lock and joins it (``running_on``) instead of starting another; ``openrl-service
stop --data-dir DIR`` (or ``stop_on(DIR)``) stops whichever holds it.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import hashlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from openrl_common.files import write_atomic
from openrl_jupyter._exceptions import ServiceUnavailable

READY_TIMEOUT_S = 300.0
DISCOVERY_PREFIX = (
    "openrl-local-"  # <jupyter runtime dir>/openrl-local-<pid>.json: read by the server extension
)
LOCK_NAME = "openrl-service.lock"  # openrl_service.storage.lock.LOCK_NAME (not imported: no torch side)
KEY_NAME = "api-key"  # the key serve generates in its data folder (openrl_service.api.auth)
EXIT_DATA_DIR_IN_USE = 3  # serve's exit code when another process holds its data folder
LOG_KEEP_BYTES = 4 << 20  # a kept data folder's service.log: the older part is dropped past this


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it)."""
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
        if self.returncode is None and _gone(self.pid):
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
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)
    discovery_path: str | None = None  # set by advertise(): removed again on stop()
    detached: bool = False  # outlives this process (start_service(detached=True) or find_detached())
    owned: bool = True  # started by this process; False: joined (another kernel's, or found running)

    @property
    def log_path(self) -> str:
        return os.path.join(self.data_dir, "service.log")

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the service's output."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

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


def discovery_dir() -> str | None:
    """The per-user Jupyter runtime folder the discovery files live in (None without jupyter_core)."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:
        return None
    return jupyter_runtime_dir()


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
        if pid.isdigit() and not _alive(int(pid)):
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


def _own_private_file(path: str) -> bool:
    """A regular file (not a link) of this user that nobody else may write: a discovery file anyone
    else could have written would point this kernel (or the panel) at their service."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    getuid = getattr(os, "getuid", None)
    mine = getuid is None or st.st_uid == getuid()  # no uids (Windows): the folder's ACLs hold
    return stat.S_ISREG(st.st_mode) and mine and not st.st_mode & 0o022


def _read_discovery(path: str) -> dict | None:
    if not _own_private_file(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def discovered(folder: str | None = None) -> dict | None:
    """The newest discovery file whose service process is alive: ``{"url", "token", "pid", "path"}``;
    None when there is none. Files of dead processes (a killed kernel) are skipped."""
    folder = folder or discovery_dir()
    if folder is None:
        return None
    found = []
    for path in glob.glob(os.path.join(folder, f"{DISCOVERY_PREFIX}*.json")):
        info = _read_discovery(path)
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            continue
        if info is None or not isinstance(info.get("url"), str):
            continue
        if not isinstance(info.get("pid"), int) or not _alive(info["pid"]):
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
        info = _read_discovery(path)
        if info is None or info.get("detached") is not True:
            continue
        pid = info.get("pid")
        if isinstance(pid, int) and isinstance(info.get("url"), str) and _alive(pid):
            return LocalService(
                _Running(pid),
                info["url"],
                str(info.get("data_dir") or ""),
                info.get("token"),
                discovery_path=path,
                detached=True,
            )
    return None


def user_data_folder(variable: str, name: str) -> str:
    """``$variable`` when set, else ``openrl-<name>`` in the Jupyter data folder (without
    jupyter_core: ``~/.local/share/openrl/<name>``): a folder of this user's that outlives kernels."""
    if os.environ.get(variable):
        return os.environ[variable]
    try:
        from jupyter_core.paths import jupyter_data_dir

        return os.path.join(jupyter_data_dir(), f"openrl-{name}")
    except ImportError:
        return os.path.join(os.path.expanduser("~"), ".local", "share", "openrl", name)


def local_data_dir(model: str | None = None) -> str:
    """Where the notebook's embedded service of ``model`` keeps its data, detached or not:
    ``$OPENRL_LOCAL_DATA_DIR``, else the Jupyter data folder's ``openrl-local``
    (``~/.local/share/jupyter/openrl-local`` on Linux; it follows ``$XDG_DATA_HOME`` /
    ``$JUPYTER_DATA_DIR``), for the tiny model; another model's is beside it,
    ``openrl-local-<model>-<hash>``, so kernels of different models do not contend for one folder. It
    outlives kernels: checkpoints and the key."""
    base = user_data_folder("OPENRL_LOCAL_DATA_DIR", "local")
    if model in (None, "tiny", "openrl/tiny"):
        return base
    slug = re.sub(r"[^A-Za-z0-9._]+", "-", os.path.basename(os.path.normpath(model)) or model).strip("-._")
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]  # two folders of one name stay apart
    return f"{base.rstrip(os.sep)}-{slug[-40:] or 'model'}-{digest}"


def local_data_dirs() -> list[str]:
    """Every embedded service's data folder of this user (the tiny model's and the others beside it)."""
    base = local_data_dir().rstrip(os.sep)
    return [base, *sorted(glob.glob(glob.escape(base) + "-*-" + "[0-9a-f]" * 8))]


def lock_holder(data_dir: str | os.PathLike[str]) -> dict | None:
    """What the service holding ``data_dir`` wrote in its lock file (pid, host, since, url), when that
    process runs on this host and is an openrl service; None when nothing holds the folder. Read, never
    locked: a probe must not keep a starting service out. A lock file of another account, or one
    others may write, names nothing (a planted one must not make a kernel send its key elsewhere)."""
    path = os.path.join(data_dir, LOCK_NAME)
    if not _own_private_file(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        return None
    if holder.get("host") not in (None, socket.gethostname()):  # a folder shared between hosts
        return None
    return holder if _alive(holder["pid"]) else None


def running_on(data_dir: str | os.PathLike[str]) -> LocalService | None:
    """The service that holds ``data_dir`` (another kernel's embedded service, a detached one, or one
    started by hand with ``--data-dir``), to join: its URL from the lock, its key from the folder's
    ``api-key`` (None if it was started with other keys). ``detached``: it does not stop with the
    process that started it. None when nothing holds the folder."""
    holder = lock_holder(data_dir)
    url = holder.get("url") if holder is not None else None
    if not isinstance(url, str):
        return None
    url = re.sub(r"^http://(0\.0\.0\.0|\[::\])(:\d+)$", r"http://127.0.0.1\2", url)  # all interfaces
    if not re.fullmatch(r"http://(127\.0\.0\.1|localhost|\[::1\]):\d+", url):
        return None  # the key goes to a loopback service only
    pid = holder["pid"]
    key = None
    key_path = os.path.join(data_dir, KEY_NAME)
    if _own_private_file(key_path):
        with contextlib.suppress(OSError), open(key_path, encoding="utf-8") as f:
            key = f.read().strip() or None
    return LocalService(
        _Running(pid),
        url,
        os.fspath(data_dir),
        key,
        detached=b"--exit-with-parent" not in _cmdline(pid),
        owned=False,
    )


def stop_on(data_dir: str | os.PathLike[str], timeout_s: float = 30.0) -> int | None:
    """Stop the service holding ``data_dir`` (SIGTERM: it drains and exits; SIGKILL after
    ``timeout_s``); its pid, or None when nothing held the folder."""
    holder = lock_holder(data_dir)
    if holder is None:
        return None
    proc = _Running(holder["pid"])
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    for path in glob.glob(os.path.join(discovery_dir() or "", f"{DISCOVERY_PREFIX}{holder['pid']}.json")):
        with contextlib.suppress(OSError):
            os.unlink(path)
    return holder["pid"]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b"--exit-with-parent"  # no /proc (macOS): assume it stops with its parent


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts as exited; one still exiting does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc (macOS)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running openrl service (a killed kernel leaves its file behind, and its
    pid may be reused later by an unrelated process: where /proc exists, its command line says)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or reused by another user's process
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
            return b"openrl_service" in cmdline or b"openrl-service" in cmdline  # -m, or the script
    except OSError:
        return True  # no /proc (macOS): the pid check alone


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
    ``local_data_dir()``.
    """
    port = free_port()
    tmp = None
    if data_dir is None and detached:
        data_dir = local_data_dir(model)
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="openrl-local-")
        data_dir = tmp.name
    data_dir = os.fspath(data_dir)
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    child_env = dict(os.environ)
    if api_key is None and auth:  # the data folder's own key, not keys (or a hub) this process has
        for var in ("OPENRL_API_KEYS", "OPENRL_API_KEYS_FILE", "OPENRL_HUB_API_URL"):
            child_env.pop(var, None)
    child_env.update(env or {})  # what the caller passes on purpose is kept
    if api_key is not None:
        child_env["OPENRL_API_KEYS"] = f"default:{api_key}"
    _trim_log(os.path.join(data_dir, "service.log"))
    cmd = [sys.executable, "-m", "openrl_service.cli", "serve"]
    if not detached:
        cmd.append("--exit-with-parent")
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--data-dir", data_dir, "--log-level", log_level]
    if model not in (None, "tiny", "openrl/tiny"):
        cmd += ["--model", model]
    if not auth:
        cmd.append("--no-auth")
    cmd += list(args)
    log = open(os.path.join(data_dir, "service.log"), "ab")  # noqa: SIM115 - owned by the child's lifetime
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL if detached else subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=child_env,
        start_new_session=detached,  # a detached one is outside the kernel's process group
    )
    log.close()
    service = LocalService(proc, f"http://127.0.0.1:{port}", data_dir, api_key, tmp, detached=detached)
    if not detached:
        atexit.register(service.stop)
    try:
        _wait_ready(service, model or "openrl/tiny", timeout_s, progress)
    except BaseException:
        service.stop()
        raise
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


def _wait_ready(
    service: LocalService, model: str, timeout_s: float, progress: Callable[[str], None] | None
) -> None:
    started = time.monotonic()
    shown = False
    with httpx.Client(base_url=service.url, timeout=5.0) as http:
        while True:
            if service.process.poll() is not None:
                err = ServiceUnavailable(
                    f"the openrl service exited with code {service.process.returncode}:\n{service.log_tail(2000)}"
                )
                err.exit_code = service.process.returncode
                raise err
            with contextlib.suppress(httpx.TransportError, ValueError):
                r = http.get("/readyz")
                if r.status_code == 200 and r.json().get("status") == "ready":
                    return
            if time.monotonic() - started > timeout_s:
                raise ServiceUnavailable(f"the openrl service was not ready after {timeout_s:.0f} s")
            if progress is not None and not shown and time.monotonic() - started > 1:
                shown = True
                progress(f"starting the embedded openrl service ({model}) on {service.url} ...")
            time.sleep(0.2)
