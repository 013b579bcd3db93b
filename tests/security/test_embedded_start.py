"""The embedded service (``connect(local=True)``) cannot be hijacked by another account on the host.

The attack: learn the port a kernel's service will use (from its command line, or its lock file written
before the port was bound), bind it first, answer ``/readyz`` as ready, and collect the key the kernel
sends. Now the service binds port 0 itself and reports the port through a pipe only its parent reads,
its lock names the port only once it is bound, and a kernel sends no key until ``/readyz`` proves the
service holds the start secret of that data folder, for the port asked (a relay to the real service
answers for the wrong port)."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from openrl_common.datadirs import KEY_NAME, LOCK_NAME, SECRET_NAME
from openrl_jupyter._exceptions import ServiceUnavailable
from openrl_jupyter.local import start_service
from openrl_jupyter.session import start_local

KEY = "tml-the-kernels-own-key-0123456789"


@pytest.fixture(scope="module")
def real(tmp_path_factory, tiny_model_dir):
    """A real embedded service, started as a kernel starts one."""
    data = tmp_path_factory.mktemp("embedded")
    shutil.copytree(tiny_model_dir, data / "models" / "openrl-tiny")
    service = start_service(data_dir=data, api_key=KEY)
    yield service
    service.stop()


class Squatter:
    """Another account's HTTP server on a port a kernel may be told about: answers /readyz as a ready
    service would (or relays to ``upstream``, the real service) and records what each request carried."""

    def __init__(self, upstream: str | None = None, port: int = 0):
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                self._answer()

            def do_POST(self):  # noqa: N802
                self._answer()

            def _answer(self):
                seen.append((self.command, self.path, dict(self.headers)))
                if upstream is not None:
                    body = httpx.get(upstream + self.path, timeout=10).content
                else:
                    body = json.dumps({"status": "ready", "state": "ready", "proof": "0" * 64}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def got_the_key(self) -> bool:
        return any(KEY in path or any(KEY in v for v in headers.values()) for _, path, headers in self.seen)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_service_pid():
    """A live process that looks like a service to the lock reader (its command line names it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; print(flush=True); time.sleep(600)", "openrl_service"],
        stdout=subprocess.PIPE,
    )
    proc.stdout.readline()
    yield proc.pid
    proc.kill()
    proc.wait()


def test_the_service_binds_its_own_port_and_no_command_line_names_it(real):
    cmdline = Path(f"/proc/{real.process.pid}/cmdline").read_bytes().split(b"\0")
    port = real.url.rsplit(":", 1)[1]
    assert cmdline[cmdline.index(b"--port") + 1] == b"0"
    assert port.encode() not in cmdline and KEY.encode() not in b" ".join(cmdline)
    lock = json.loads(Path(real.data_dir, LOCK_NAME).read_text())
    assert lock["url"] == real.url and lock["pid"] == real.process.pid  # named once bound, by its holder
    secret = os.path.join(real.data_dir, SECRET_NAME)
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert "proof" not in httpx.get(f"{real.url}/readyz").json()  # only asked for, never volunteered
    r = httpx.get(f"{real.url}/readyz", params={"challenge": "not hex"})
    assert r.status_code == 400 and r.json()["field"] == "challenge"


@pytest.mark.parametrize("relay", [False, True], ids=["squatter", "relay-to-the-real-service"])
def test_a_port_squatter_receives_no_key(real, tmp_path, fake_service_pid, relay):
    """The folder's lock names the squatter's port (as a lock written before its port was bound could):
    the kernel joining that folder's service asks /readyz for its proof, gets none it can accept, and
    sends its key nowhere."""
    squatter = Squatter(upstream=real.url if relay else None)
    try:
        lock = tmp_path / LOCK_NAME
        lock.write_text(
            json.dumps({"pid": fake_service_pid, "host": socket.gethostname(), "url": squatter.url})
        )
        lock.chmod(0o644)
        for name, text in (
            (KEY_NAME, KEY),
            (SECRET_NAME, Path(real.data_dir, SECRET_NAME).read_text()),
        ):
            (tmp_path / name).write_text(text)
            (tmp_path / name).chmod(0o600)
        with pytest.raises(ServiceUnavailable, match="no key was sent"):
            start_local(data_dir=str(tmp_path), timeout_s=30)
        assert squatter.seen, "the kernel never asked the squatter's /readyz"
        assert not squatter.got_the_key()
        # the real service still proves itself to the same check
        from openrl_jupyter.local import running_on, wait_ready

        joined = running_on(real.data_dir)
        wait_ready(joined, "openrl/tiny", 30)
    finally:
        squatter.close()


def test_a_port_the_service_let_go_gets_no_key_from_its_kernel(tmp_path, tiny_model_dir, fake_service_pid):
    """Attack: wait for a kernel's embedded service to die (out of memory, a stop from another kernel),
    take the port it let go, and answer the kernel's next request. The kernel sends nothing to a service
    whose process has exited, and after a connection failure nothing before the URL proves again that
    it is that service."""
    from openrl_jupyter.client import Client
    from openrl_jupyter.local import LocalService, _Running

    data = tmp_path / "local"
    shutil.copytree(tiny_model_dir, data / "models" / "openrl-tiny")
    started = start_service(data_dir=data, api_key=KEY)
    client = Client(started.url, token=KEY, guard=started.check)  # as connect(local=True) makes it
    assert client.capabilities()
    port = int(started.url.rsplit(":", 1)[1])
    started.process.kill()
    started.process.wait()
    squatter = Squatter(port=port)
    try:
        with pytest.raises(ServiceUnavailable, match="has exited"):
            client.capabilities()
        assert not squatter.got_the_key() and not squatter.seen  # nothing at all went there
    finally:
        client.close()
        squatter.close()
        started.stop()
    # a live process whose URL another process answers: after a failure, the proof is asked again
    squatter = Squatter()
    alive = LocalService(_Running(fake_service_pid), squatter.url, str(data), KEY, "a-start-secret")
    try:
        with Client(squatter.url, token=KEY, guard=alive.check) as client:
            client._suspect = True  # as after a connection failure
            with pytest.raises(ServiceUnavailable, match="no key was sent"):
                client.capabilities()
        assert squatter.seen and not squatter.got_the_key()  # asked for its proof, and nothing else
    finally:
        squatter.close()
