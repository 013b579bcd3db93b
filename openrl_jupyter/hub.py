"""The kernel inside a JupyterHub single-user server: its hub identity, and activity for the culler.

A single-user server has ``$JUPYTERHUB_API_TOKEN`` (its own token: ``users:activity!user``,
``access:servers!server`` and, with the chart's ``server_token_scopes``,
``access:services!service=openrl``). ``connect()`` with no key sends that token to the service the hub
configured (``$OPENRL_URL``); the service resolves it through the hub's REST API to ``hub:<user>``.

jupyterhub-idle-culler stops a server the hub has seen no activity from for a while. A background
run makes no web traffic, so while any run of this kernel is stepping the kernel reports activity to
the hub itself — the same ``POST {hub}/users/<name>/activity`` the single-user server extension
sends — every ``$OPENRL_HUB_ACTIVITY_INTERVAL_S`` seconds (default 60), and stops when no run is
stepping (a paused run does not keep a server alive). Failures are logged once and never touch a run.

Works without IPython or torch: ``httpx`` and the standard library only.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone

import httpx

log = logging.getLogger("openrl_jupyter")

DEFAULT_INTERVAL_S = 60.0
MIN_INTERVAL_S = 0.2
KEEPALIVE_NOTE = (
    "openrl: this JupyterHub server is kept alive (activity reported to the hub every {interval:g} s) "
    "while a run of this kernel is stepping, so the idle culler does not stop it; a paused or finished "
    "run no longer does"
)


@dataclass(frozen=True)
class HubEnv:
    """Where and as whom to report activity (from a single-user server's environment)."""

    activity_url: str
    user: str
    server_name: str
    token: str = field(repr=False)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> HubEnv | None:
        """The hub of this kernel, or None outside a hub single-user server.

        Needs ``$JUPYTERHUB_API_TOKEN`` and either ``$JUPYTERHUB_ACTIVITY_URL`` or
        ``$JUPYTERHUB_API_URL`` + ``$JUPYTERHUB_USER`` (``$JUPYTERHUB_SERVER_NAME``: a named server)."""
        env = os.environ if env is None else env
        token = env.get("JUPYTERHUB_API_TOKEN")
        if not token:
            return None
        user = env.get("JUPYTERHUB_USER", "")
        url = env.get("JUPYTERHUB_ACTIVITY_URL")
        if not url:
            api = env.get("JUPYTERHUB_API_URL")
            if not (api and user):
                return None
            url = f"{api.rstrip('/')}/users/{user}/activity"
        return cls(url, user, env.get("JUPYTERHUB_SERVER_NAME", ""), token)


def hub_token(env: Mapping[str, str] | None = None) -> str | None:
    """This single-user server's own hub API token, if the kernel runs in one."""
    env = os.environ if env is None else env
    return env.get("JUPYTERHUB_API_TOKEN") or None


def isoformat_utc(when: datetime | None = None) -> str:
    """An ISO 8601 UTC timestamp ending in Z, as jupyterhub writes them."""
    when = when or datetime.now(timezone.utc)
    return when.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def activity_body(server_name: str, when: datetime | None = None) -> dict:
    """The body jupyterhub's single-user extension posts: the user's and this server's activity."""
    stamp = isoformat_utc(when)
    return {"last_activity": stamp, "servers": {server_name: {"last_activity": stamp}}}


def interval_s(env: Mapping[str, str] | None = None) -> float:
    """``$OPENRL_HUB_ACTIVITY_INTERVAL_S`` (default 60 s); a bad value is a clear error."""
    env = os.environ if env is None else env
    raw = env.get("OPENRL_HUB_ACTIVITY_INTERVAL_S")
    if raw is None or raw == "":
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (MIN_INTERVAL_S <= value <= 86_400):
        raise ValueError(
            f"OPENRL_HUB_ACTIVITY_INTERVAL_S must be a number of seconds between {MIN_INTERVAL_S} and 86400; "
            f"got {raw!r}"
        )
    return value


class ActivityReporter:
    """A daemon thread that posts activity while ``is_active()`` is true, then ends.

    ``ensure()`` (re)starts it; it is cheap to call on every new run. ``reports`` counts the posts
    the hub accepted (for tests and ``%openrl status``)."""

    def __init__(
        self,
        hub: HubEnv,
        is_active: Callable[[], bool],
        *,
        interval: float = DEFAULT_INTERVAL_S,
        timeout_s: float = 10.0,
    ):
        self.hub = hub
        self.is_active = is_active
        self.interval = interval
        self.timeout_s = timeout_s
        self.reports = 0
        self.failures = 0
        self._warned = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def __repr__(self) -> str:  # never the token
        return f"<ActivityReporter {self.hub.activity_url} every {self.interval:g} s>"

    @property
    def running(self) -> bool:
        with self._lock:
            return self._thread is not None

    def ensure(self) -> bool:
        """Start reporting unless already; True when this call started the thread."""
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return False
            self._thread = threading.Thread(target=self._loop, name="openrl-hub-activity", daemon=True)
            self._thread.start()
            return True

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(self.timeout_s + 1)

    def report(self) -> bool:
        """One POST; True when the hub took it. Never raises."""
        try:
            r = httpx.post(
                self.hub.activity_url,
                json=activity_body(self.hub.server_name),
                headers={"Authorization": f"token {self.hub.token}"},
                timeout=self.timeout_s,
            )
            if r.status_code >= 400:
                raise RuntimeError(f"HTTP {r.status_code}: {' '.join(r.text.split())[:200]}")
        except Exception as exc:  # a report must never break a run
            self.failures += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "openrl: could not report activity to JupyterHub at %s (%s: %s); the idle culler "
                    "may stop this server during a run (logged once)",
                    self.hub.activity_url,
                    type(exc).__name__,
                    exc,
                )
            return False
        self.reports += 1
        return True

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    if not self._active():
                        self._thread = None
                        return
                self.report()
                self._stop.wait(self.interval)
        finally:
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _active(self) -> bool:
        try:
            return bool(self.is_active())
        except Exception:
            return False


_reporter: ActivityReporter | None = None
_noted = False
_guard = threading.Lock()


def keep_alive(is_active: Callable[[], bool], *, env: Mapping[str, str] | None = None) -> str | None:
    """In a hub single-user server, make sure activity is reported while ``is_active()``.

    Returns the one-time note for the user (the first time only), else None. Outside a hub, or with
    a bad ``$OPENRL_HUB_ACTIVITY_INTERVAL_S`` (logged), it does nothing."""
    global _reporter, _noted
    hub = HubEnv.from_environ(env)
    if hub is None:
        return None
    with _guard:
        if _reporter is None or _reporter.hub != hub:
            try:
                every = interval_s(env)
            except ValueError as e:
                log.warning("openrl: not reporting activity to JupyterHub: %s", e)
                return None
            if _reporter is not None:
                _reporter.close()
            _reporter = ActivityReporter(hub, is_active, interval=every)
        _reporter.is_active = is_active
        _reporter.ensure()
        if _noted:
            return None
        _noted = True
        return KEEPALIVE_NOTE.format(interval=_reporter.interval)


def reporter() -> ActivityReporter | None:
    """The kernel's activity reporter (None until a run started in a hub server)."""
    return _reporter
