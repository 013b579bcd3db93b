"""Shared fixtures: a real openrl-service on loopback (uvicorn in a thread) and Tinker SDK clients.

Under OPENRL_CI_STRICT=1 (CI), a skipped test fails unless it is marked ``gpu``: a missing browser,
venv or package must not turn CI green.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from openrl_jupyter.local import free_port  # noqa: E402 - the one free-port helper (tests import it from here)

pytest_plugins = ["tests._support.strict_skips", "tests._support.env_guard", "pytester"]


ALICE_KEY = "tml-alice-0123456789abcdef"
BOB_KEY = "tml-bob-0123456789abcdef"
TINY = "openrl/tiny"


@pytest.fixture(autouse=True)
def own_local_data_dir(tmp_path_factory, monkeypatch):
    """Each test its own folder for the notebook's embedded service (``connect(local=True)`` keeps its
    data and key in the user's data dir and joins a service already running there): no test joins
    or reads what another left, and none touches the user's own."""
    monkeypatch.setenv("OPENRL_LOCAL_DATA_DIR", str(tmp_path_factory.mktemp("openrl-local")))


@dataclass
class LiveServer:
    url: str
    data_dir: Path
    service: object
    server: object
    thread: threading.Thread

    @property
    def parts(self):
        """The service's Container (openrl_service/container.py): its jobs, native runs, launcher."""
        return self.server.config.app.state.parts

    def client(self, key: str | None = ALICE_KEY, **kw) -> httpx.Client:
        headers = {"X-API-Key": key} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from openrl_service.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "openrl-tiny")


def start_server(data_dir: Path, tiny_dir: Path, *, expect: str = "ready", **overrides) -> LiveServer:
    """A service in this process on a loopback port, returned once ``/readyz`` reports ``expect``
    (``ready``, or ``failed`` for tests of a refused start)."""
    import uvicorn

    from openrl_service.app import create_app
    from openrl_service.config import Settings

    models = data_dir / "models" / "openrl-tiny"
    if not models.exists():
        shutil.copytree(tiny_dir, models)
    port = free_port()
    settings = Settings(
        data_dir=data_dir, port=port, api_keys={ALICE_KEY: "alice", BOB_KEY: "bob"}, **overrides
    )
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", data_dir, app.state.service, server, thread)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{live.url}/readyz", timeout=2).json().get("state") == expect:
                return live
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    live.stop()
    raise RuntimeError(f"openrl-service did not become {expect} in 120 s")


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_model_dir) -> LiveServer:
    """One shared service with two tenants (alice, bob)."""
    live = start_server(tmp_path_factory.mktemp("data"), tiny_model_dir)
    yield live
    live.stop()


@pytest.fixture
def make_server(tmp_path, tiny_model_dir):
    """A private service with custom settings (short timeouts, small limits)."""
    started = []

    def make(**overrides) -> LiveServer:
        live = start_server(tmp_path / f"data{len(started)}", tiny_model_dir, **overrides)
        started.append(live)
        return live

    yield make
    for live in started:
        live.stop()


@pytest.fixture
def raw(server):
    """A raw-HTTP Tinker client (tenant alice) on the shared service. The sessions it creates are
    finished afterwards, pass or fail: runs left live would count against the next test's quota."""
    from tests._support.raw import RawTinker

    with server.client() as http:
        client = RawTinker(http)
        yield client
        client.finish_sessions()


@pytest.fixture
def service_client(server):
    import tinker

    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    yield sc
    sc.close("success").result()


def pytest_sessionfinish(session, exitstatus):
    """Close the widgets tests created while ipywidgets still works (not in __del__ at exit)."""
    import sys

    widgets = sys.modules.get("ipywidgets")
    if widgets is not None:
        widgets.Widget.close_all()


def fake_pynvml(monkeypatch) -> None:
    """NVML faked at the library boundary (no GPU here): one "FakeGPU" at 73 % with 3 of 80 GiB used."""
    import sys
    import types

    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    fake.nvmlDeviceGetName = lambda h: "FakeGPU"
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=73, memory=10)
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=3 << 30, total=80 << 30, free=77 << 30
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
