"""Connections to openrl services: ``connect()``, named sessions, and the embedded local service.

Where the URL and key come from (first match wins): arguments > ``OPENRL_URL`` / ``OPENRL_TOKEN``
> configuration (``config`` mapping, e.g. IPython's ``c.OpenRLMagics.url``) > nothing, which is a
clear error saying how to connect. ``local=True`` starts an embedded ``openrl-service`` child on a
free loopback port with a fresh key passed through its environment (never its command line); it
exits when this process exits or dies, because it watches a pipe this process holds.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

from openrl_jupyter._exceptions import OpenRLError, ServiceUnavailable
from openrl_jupyter.client import AsyncClient, Client

if TYPE_CHECKING:
    from openrl_jupyter.feed import EventFeed
    from openrl_jupyter.run import Run

DEFAULT_NAME = "default"
READY_TIMEOUT_S = 300.0


class UsageError(OpenRLError):
    """The caller asked for something impossible (a bad flag, a missing extra, no URL)."""


@dataclass
class LocalService:
    """An embedded ``openrl-service`` child process."""

    process: subprocess.Popen
    url: str
    data_dir: str
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()  # the child's watcher stops it gracefully
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


@dataclass
class Session:
    """A named connection: a client plus, for ``local=True``, the service it started.

    ``train(...)`` starts a background RL run on it; ``runs`` holds this kernel's runs by name.
    """

    name: str
    url: str
    client: Client = field(repr=False)
    local: LocalService | None = field(default=None, repr=False)
    model: str | None = None
    defaults: dict = field(default_factory=dict, repr=False)
    runs: dict[str, Run] = field(default_factory=dict, repr=False)
    _token: str | None = field(default=None, repr=False)
    _aclient: AsyncClient | None = field(default=None, repr=False)
    _feed: EventFeed | None = field(default=None, repr=False)

    def __repr__(self) -> str:  # never the key
        kind = "embedded" if self.local else "remote"
        return f"<openrl Session {self.name!r} {kind} {self.url} model={self.model!r}>"

    def train(self, *, reward: Any, prompts: Any, **options: Any) -> Run:
        """Start a background RL run and return it at once (see ``openrl_jupyter.run``).

        Options: model, steps, group, batch, lr, rank, max_tokens, temperature, loss, name,
        normalize_std, seed, overlap (1: sample step k+1 while step k is scored); unset ones come
        from the model's capability entry.
        """
        from openrl_jupyter.config import make_config
        from openrl_jupyter.run import Run

        model = options.get("model")
        if model is not None and self.model is not None and model not in (self.model, "tiny"):
            raise UsageError(f"model {model!r} is not served by {self.url} (it serves {self.model!r})")
        config = make_config(self.defaults, reward=reward, prompts=prompts, **options)
        config.model = self.model
        name = config.name
        if name is not None:
            old = self.runs.get(name)
            if old is not None and not old.done:
                raise UsageError(f"a run named {name!r} is still {old.state}; stop it or pick another --name")
        run = Run(self, config).start()
        self.runs[run.name] = run
        return run

    def active_runs(self) -> list[Run]:
        return [r for r in self.runs.values() if not r.done]

    def get_run(self, name: str | None = None) -> Run:
        """This kernel's run by name, or the only (or latest) one."""
        if not self.runs:
            raise UsageError("no runs yet in this session: start one with %openrl train (or session.train)")
        if name is None:
            return list(self.runs.values())[-1]
        if name not in self.runs:
            raise UsageError(f"no run named {name!r}; runs: {', '.join(self.runs)}")
        return self.runs[name]

    def async_client(self) -> AsyncClient:
        """The session's AsyncClient, bound to the runner loop (use it only there)."""
        if self._aclient is None:
            self._aclient = AsyncClient(self.url, token=self._token, retries=self.client.retries)
        return self._aclient

    def feed(self) -> EventFeed:
        """The service's event stream (ticks and run events) shared by this session's dashboards."""
        if self._feed is None:
            from openrl_jupyter.feed import EventFeed

            self._feed = EventFeed(self.async_client)
        return self._feed

    def close(self) -> None:
        for run in self.runs.values():
            if not run.done:
                run.stop()
        for run in self.runs.values():
            with contextlib.suppress(TimeoutError):
                run.wait(timeout=30)
        if self._feed is not None:
            self._feed.close()
        if self._aclient is not None:
            from openrl_jupyter.runner import get_runner

            with contextlib.suppress(Exception):
                get_runner().submit(self._aclient.aclose()).result(5)
            self._aclient = None
        self.client.close()
        if self.local is not None:
            self.local.stop()


_sessions: dict[str, Session] = {}


class Secret(str):
    """A key: a str everywhere it is used, masked wherever it is shown (reprs, verbose tracebacks)."""

    def __repr__(self) -> str:
        return "'tml-…(hidden)'"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local(
    model: str = "openrl/tiny",
    *,
    data_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
    timeout_s: float = READY_TIMEOUT_S,
) -> tuple[LocalService, str]:
    """Start an embedded service; returns it and its fresh key once it answers /readyz."""
    if not all(_installed(m) for m in ("openrl_service", "torch", "fastapi", "transformers")):
        raise UsageError(
            "connect(local=True) needs the service installed in this environment: "
            "pip install 'openrl-jupyter[service]' (or connect to a running service by URL)"
        )
    key = Secret("tml-" + secrets.token_urlsafe(24))
    port = _free_port()
    tmp = None
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="openrl-local-")
        data_dir = tmp.name
    env = {**os.environ, "OPENRL_API_KEYS": Secret(f"default:{key}")}
    cmd = [
        sys.executable,
        "-m",
        "openrl_service.cli",
        "serve",
        "--exit-with-parent",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-dir",
        data_dir,
        "--log-level",
        "warning",
    ]
    if model not in ("tiny", "openrl/tiny"):
        cmd += ["--model", model]
    log = open(os.path.join(data_dir, "service.log"), "ab")  # noqa: SIM115 - owned by the child's lifetime
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    local = LocalService(proc, f"http://127.0.0.1:{port}", data_dir, tmp)
    atexit.register(local.stop)
    client = Client(local.url, token=key, retries=0)
    started = time.monotonic()
    deadline = started + timeout_s
    shown = False
    try:
        while True:
            if proc.poll() is not None:
                tail = _tail(os.path.join(data_dir, "service.log"))
                raise ServiceUnavailable(
                    f"the embedded openrl service exited with code {proc.returncode}:\n{tail}"
                )
            with contextlib.suppress(OpenRLError):
                if client.ready().get("status") == "ready":
                    break
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"the embedded openrl service was not ready after {timeout_s:.0f} s")
            if progress is not None and not shown and time.monotonic() - started > 1:
                shown = True
                progress(f"starting the embedded openrl service ({model}) on {local.url} ...")
            time.sleep(0.2)
    except BaseException:
        local.stop()
        raise
    finally:
        client.close()
    return local, key


def connect(
    url: str | None = None,
    *,
    token: str | None = None,
    name: str | None = None,
    local: bool = False,
    model: str = "openrl/tiny",
    config: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Session:
    """Connect to a service (or start an embedded one with ``local=True``) and remember it by name."""
    name = name or DEFAULT_NAME
    config = config or {}
    old = _sessions.get(name)
    if old is not None and old.active_runs():
        busy = ", ".join(r.name for r in old.active_runs())
        raise UsageError(
            f"session {name!r} has active runs ({busy}); stop them (run.stop()) or connect with another name"
        )
    local_service = None
    if local:
        if url:
            raise UsageError("give either a URL or local=True, not both")
        local_service, token = start_local(model, progress=progress)
        url = local_service.url
    else:
        url = url or os.environ.get("OPENRL_URL") or config.get("url")
        token = token or os.environ.get("OPENRL_TOKEN") or config.get("token")
        if url and not url.startswith(("http://", "https://")):
            raise UsageError(f"the service URL must start with http:// or https://; got {url!r}")
        if not url:
            raise UsageError(
                "no openrl service to connect to: pass a URL, set OPENRL_URL (and OPENRL_TOKEN), "
                "or use local=True to start one here"
            )
    token = Secret(token) if token else None
    client = Client(url, token=token)
    try:
        models = client.capabilities()
    except OpenRLError:
        client.close()
        if local_service is not None:
            local_service.stop()
        raise
    old = _sessions.pop(name, None)
    if old is not None:
        old.close()
    session = Session(
        name,
        url,
        client,
        local_service,
        models[0]["model_name"] if models else None,
        dict(models[0].get("defaults") or {}) if models else {},
        _token=token,
    )
    _sessions[name] = session
    return session


def get_session(name: str | None = None) -> Session:
    """The named session, or the only one; a UsageError says how to connect otherwise."""
    if name is not None:
        if name not in _sessions:
            raise UsageError(f"no session named {name!r}; connected: {', '.join(_sessions) or 'none'}")
        return _sessions[name]
    if len(_sessions) == 1:
        return next(iter(_sessions.values()))
    if DEFAULT_NAME in _sessions:
        return _sessions[DEFAULT_NAME]
    if not _sessions:
        raise UsageError("not connected: call openrl_jupyter.connect(URL) or connect(local=True) first")
    raise UsageError(f"several sessions are open ({', '.join(_sessions)}); name one")


def sessions() -> dict[str, Session]:
    return dict(_sessions)


def disconnect(name: str | None = None) -> list[str]:
    """Close a session: its active runs stop after their current step (returns their names) and an
    embedded service stops."""
    session = get_session(name)
    stopped = [r.name for r in session.active_runs()]
    _sessions.pop(session.name, None)
    session.close()
    return stopped


def _installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except (ValueError, ImportError):  # e.g. a module blocked with sys.modules[name] = None
        return False


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace")
    except OSError:
        return ""
