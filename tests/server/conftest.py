"""A real ``jupyter server`` subprocess with this checkout's server extension, enabled the way
``pip install`` enables it (the repo's jupyter-config file in its config folder), on a free loopback
port with a token, driven over HTTP; the openrl service is the shared one from tests/conftest.py."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from openrl_jupyter.local import free_port
from tests.conftest import ALICE_KEY

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120  # a hang guard: the server starts in a few seconds


@dataclass
class Jupyter:
    """A running jupyter server. ``url`` ends with its base URL (``/user/alice/`` for example)."""

    url: str
    token: str
    proc: subprocess.Popen
    root: Path

    @property
    def runtime_dir(self) -> Path:
        return self.root / "runtime"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, *, auth: bool = True, **kw) -> httpx.Client:
        """An HTTP client; with ``auth`` it sends the server's token (as JupyterLab's does)."""
        headers = {"Authorization": f"token {self.token}"} if auth else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_jupyter(root: Path, *, base_url: str = "/", env: dict | None = None, args: tuple = ()) -> Jupyter:
    """``jupyter server`` with only its own folders (config, data, runtime under ``root``), the
    extension enabled by the repo's ``jupyter_server_config.d`` file, DEBUG logging to a file."""
    config = root / "config" / "jupyter_server_config.d"
    config.mkdir(parents=True)
    shutil.copy(REPO / "jupyter-config" / "server-config" / "openrl_jupyter.json", config)
    (root / "runtime").mkdir()
    (root / "work").mkdir()
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("OPENRL_", "JUPYTER", "TINKER_API_KEY"))
    }
    full_env = {
        **clean,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "JUPYTER_CONFIG_DIR": str(root / "config"),
        "JUPYTER_DATA_DIR": str(root / "data"),
        "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
        "JUPYTER_PLATFORM_DIRS": "0",
        **(env or {}),
    }
    port, token = free_port(), "jp-" + secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root", "--ip=127.0.0.1"]
    cmd += [f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.base_url={base_url}"]
    cmd += [f"--ServerApp.root_dir={root / 'work'}", "--ServerApp.allow_unauthenticated_access=False"]
    cmd += ["--log-level=DEBUG", *args]
    with open(root / "server.log", "ab") as log:
        proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    jupyter = Jupyter(f"http://127.0.0.1:{port}{base_url}", token, proc, root)
    deadline = time.monotonic() + START_TIMEOUT_S
    with jupyter.client() as http:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter server exited ({proc.returncode}):\n{jupyter.log()[-3000:]}")
            if time.monotonic() > deadline:
                jupyter.stop()
                raise RuntimeError(f"jupyter server not up in {START_TIMEOUT_S} s:\n{jupyter.log()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get("api/status").status_code == 200:
                    return jupyter
            time.sleep(0.2)


@pytest.fixture(scope="session")
def alice_jupyter(server, tmp_path_factory):
    """A server for tenant alice (OPENRL_URL + OPENRL_TOKEN), under a hub-like base URL."""
    jupyter = start_jupyter(
        tmp_path_factory.mktemp("jp-alice"),
        base_url="/user/alice/",
        env={"OPENRL_URL": server.url, "OPENRL_TOKEN": ALICE_KEY},
    )
    yield jupyter
    jupyter.stop()


@pytest.fixture(scope="session")
def bare_jupyter(tmp_path_factory):
    """A server with no service configured (the discovery file is its only way to one)."""
    jupyter = start_jupyter(tmp_path_factory.mktemp("jp-bare"))
    yield jupyter
    jupyter.stop()


@pytest.fixture(scope="session")
def dead_port() -> int:
    return free_port()  # nothing listens there


@pytest.fixture(scope="session")
def bad_jupyter(server, dead_port, tmp_path_factory):
    """c.OpenRLServer.url names a dead port; $OPENRL_URL names the live service (config must win)."""
    jupyter = start_jupyter(
        tmp_path_factory.mktemp("jp-bad"),
        env={"OPENRL_URL": server.url, "OPENRL_TOKEN": ALICE_KEY},
        args=(f"--OpenRLServer.url=http://127.0.0.1:{dead_port}",),
    )
    yield jupyter
    jupyter.stop()


@pytest.fixture
def service_pid():
    """A live process whose command line names openrl_service: what a discovery file's pid must be
    (the pid of a process that is not a service, e.g. a reused one, makes the file stale)."""
    proc = service_stand_in()
    yield proc.pid
    proc.kill()
    proc.wait()


def service_stand_in() -> subprocess.Popen:
    """A sleeping process whose command line names openrl_service, returned once it has exec'd (until
    then /proc/<pid>/cmdline is still pytest's, and it would not count as a service)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "openrl_service"])
    deadline = time.monotonic() + 30
    while b"openrl_service" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the stand-in service process did not start"
        time.sleep(0.01)
    return proc
