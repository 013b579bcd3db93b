"""Which service holds a data folder, and how it proves it: the lock file's reader, the embedded services'
data folders, stopping the holder, and the start secret behind ``/readyz``'s proof.

``openrl-service serve`` binds its port first, then takes ``<data>/openrl-service.lock`` (naming its pid,
host and URL) and writes ``<data>/instance-secret`` (0600): the secret it was started with
(``OPENRL_INSTANCE_SECRET``, which the starting kernel made and passed in its environment) or a fresh one.
``GET /readyz?challenge=C`` answers ``proof = HMAC-SHA256(secret, "openrl-readyz|<port>|C")``, so a kernel
that holds the secret (it made it, or reads it from the folder like the key) checks that the URL answers
for the service it means before it sends a key there: another account squatting the port cannot answer,
and a relay to the real service answers for the wrong port.

Both halves use this module (the service's ``stop`` command and ``/readyz``, the notebook's
``connect(local=True)``), so it imports nothing of either. No torch, no Jupyter needed.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import hmac
import json
import os
import re
import signal
import socket
import stat
import subprocess
import time

LOCK_NAME = "openrl-service.lock"  # serve's exclusive lock on its data folder (storage/lock.py)
KEY_NAME = "api-key"  # the key serve generates in its data folder (openrl_service.api.auth)
SECRET_NAME = "instance-secret"  # the running service's start secret (0600)
SECRET_ENV = "OPENRL_INSTANCE_SECRET"  # how a starting kernel hands serve the secret it made
DISCOVERY_PREFIX = "openrl-local-"  # <jupyter runtime dir>/openrl-local-<pid>.json (openrl_jupyter.local)
CHALLENGE_RE = re.compile(r"[0-9a-f]{32,128}")


def readyz_proof(secret: str, port: int, challenge: str) -> str:
    """What ``/readyz?challenge=`` answers: an HMAC of the challenge and the port it was asked on."""
    return hmac.new(secret.encode(), f"openrl-readyz|{port}|{challenge}".encode(), hashlib.sha256).hexdigest()


def proves(body: object, secret: str, port: int, challenge: str) -> bool:
    """Whether a ``/readyz`` reply carries the proof that only the holder of ``secret`` on ``port`` gives."""
    proof = body.get("proof") if isinstance(body, dict) else None
    return isinstance(proof, str) and hmac.compare_digest(
        proof.encode("ascii", "replace"), readyz_proof(secret, port, challenge).encode()
    )


def own_private_file(path: str | os.PathLike[str]) -> bool:
    """A regular file (not a link) of this user that nobody else may write: a file anyone else could
    have written would point this kernel (or the panel) at their service."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    getuid = getattr(os, "getuid", None)
    mine = getuid is None or st.st_uid == getuid()  # no uids (Windows): the folder's ACLs hold
    return stat.S_ISREG(st.st_mode) and mine and not st.st_mode & 0o022


def read_private(path: str | os.PathLike[str]) -> str | None:
    """The stripped text of one of this user's private files (:func:`own_private_file`), else None."""
    if not own_private_file(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def read_private_json(path: str | os.PathLike[str]) -> dict | None:
    """The JSON object in one of this user's private files (:func:`own_private_file`), else None."""
    if not own_private_file(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def gone(pid: int) -> bool:
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


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``pid`` to exit; whether it did."""
    deadline = time.monotonic() + timeout_s
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def alive(pid: int) -> bool:
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


def lock_holder(data_dir: str | os.PathLike[str]) -> dict | None:
    """What the service holding ``data_dir`` wrote in its lock file (pid, host, since, url), when that
    process runs on this host and is an openrl service; None when nothing holds the folder. Read, never
    locked: a probe must not keep a starting service out. A lock file of another account, or one
    others may write, names nothing (a planted one must not make a kernel send its key elsewhere)."""
    holder = read_private_json(os.path.join(data_dir, LOCK_NAME))
    if holder is None or not isinstance(holder.get("pid"), int):
        return None
    if holder.get("host") not in (None, socket.gethostname()):  # a folder shared between hosts
        return None
    return holder if alive(holder["pid"]) else None


def loopback_url(url: object) -> str | None:
    """``url`` as a loopback http URL a kernel may send its key to (all interfaces become 127.0.0.1),
    else None."""
    if not isinstance(url, str):
        return None
    url = re.sub(r"^http://(0\.0\.0\.0|\[::\])(:\d+)$", r"http://127.0.0.1\2", url)
    return url if re.fullmatch(r"http://(127\.0\.0\.1|localhost|\[::1\]):\d+", url) else None


TINY_SPECS = ("tiny", "openrl/tiny")


def data_home() -> str:
    """The one folder under which ``openrl-service serve``, ``connect(local=True)`` and the CLI keep
    their data, one subfolder per model: ``$OPENRL_DATA_HOME``, else ``$XDG_DATA_HOME/openrl``, else
    ``~/.local/share/openrl``."""
    if os.environ.get("OPENRL_DATA_HOME"):
        return os.environ["OPENRL_DATA_HOME"]
    xdg = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(xdg, "openrl")


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


def model_slug(models: str | list[str] | tuple[str, ...] | None) -> str:
    """The data subfolder's name for a service of ``models`` (``--model`` specs, in order): ``tiny`` for
    the tiny model, else the specs' last path parts and a digest of them, so ``serve --model X`` and
    ``connect(local=True, model="X")`` meet in one folder and two models never share one."""
    specs = [models] if isinstance(models, str) else list(models or [])
    specs = ["tiny" if m in TINY_SPECS else m for m in specs] or ["tiny"]
    if specs == ["tiny"]:
        return "tiny"
    names = [
        re.sub(r"[^A-Za-z0-9._]+", "-", os.path.basename(os.path.normpath(m)) or m).strip("-._")
        for m in specs
    ]
    digest = hashlib.sha256("\n".join(specs).encode()).hexdigest()[:8]  # two folders of one name stay apart
    return f"{'+'.join(n[-40:] or 'model' for n in names)[:80]}-{digest}"


def model_data_dir(models: str | list[str] | tuple[str, ...] | None = None) -> str:
    """The default data folder of a service of ``models``: ``<data_home()>/<model_slug(models)>``."""
    return os.path.join(data_home(), model_slug(models))


def local_data_dir(model: str | None = None) -> str:
    """Where the notebook's embedded service of ``model`` keeps its data, detached or not: the folder
    ``openrl-service serve --model MODEL`` uses too (``model_data_dir``), so a notebook joins a service
    started from a terminal and ``tinker checkpoint list`` against that service lists what the notebook
    saved. ``$OPENRL_LOCAL_DATA_DIR`` overrides it: that folder for the tiny model, and beside it
    ``<it>-<model_slug>`` for another. It outlives kernels: checkpoints and the key."""
    base = os.environ.get("OPENRL_LOCAL_DATA_DIR")
    if not base:
        return model_data_dir(model)
    slug = model_slug(model)
    return base if slug == "tiny" else f"{base.rstrip(os.sep)}-{slug}"


def local_data_dirs() -> list[str]:
    """Every embedded service's data folder of this user (one per model; those that hold a lock file or
    a key, i.e. that a service used)."""
    base = os.environ.get("OPENRL_LOCAL_DATA_DIR")
    if base:
        base = base.rstrip(os.sep)
        return [base, *sorted(glob.glob(glob.escape(base) + "-*-" + "[0-9a-f]" * 8))]
    home = data_home()
    found = [
        os.path.join(home, d)
        for d in sorted(os.listdir(home) if os.path.isdir(home) else [])
        if os.path.exists(os.path.join(home, d, LOCK_NAME)) or os.path.exists(os.path.join(home, d, KEY_NAME))
    ]
    return found or [model_data_dir()]


def discovery_dir() -> str | None:
    """The per-user Jupyter runtime folder the discovery files live in (None without jupyter_core)."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:
        return None
    return jupyter_runtime_dir()


def stop_on(data_dir: str | os.PathLike[str], timeout_s: float = 30.0) -> int | None:
    """Stop the service holding ``data_dir`` (SIGTERM: it drains and exits; SIGKILL after
    ``timeout_s``); its pid, or None when nothing held the folder."""
    holder = lock_holder(data_dir)
    if holder is None:
        return None
    pid = holder["pid"]
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if wait_gone(pid, wait_s):
            break
    else:
        raise subprocess.TimeoutExpired(f"pid {pid}", timeout_s)
    for path in glob.glob(os.path.join(discovery_dir() or "", f"{DISCOVERY_PREFIX}{pid}.json")):
        with contextlib.suppress(OSError):
            os.unlink(path)
    return pid
