"""The cpu overlay's container, run for real: its args and env (paths mapped into a temporary folder,
the port onto loopback) start the service with the keys file the Secret provides; the probe and
scrape paths answer as the manifests expect; SIGTERM drains and exits 0 well within
terminationGracePeriodSeconds. Catches a flag the CLI refuses, a wrong probe path, a bad env value."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from openrl_jupyter.local import free_port
from tests.k8s._k8s import ROOT, env_of, of_kind, overlay

KEY = "tml-k8s-pod-0123456789abcdef"


def test_cpu_container_serves_probes_and_drains(tmp_path):
    (dep,) = of_kind(overlay("cpu"), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in c["volumeMounts"]}
    for folder in mounts.values():
        folder.mkdir()
    (mounts["/etc/openrl/api-keys"] / "api-keys").write_text(f"# from the admin's Secret\nadmin {KEY}\n")

    def local(value: str) -> str:
        for mount, folder in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if value == mount or value.startswith(mount + "/"):
                return str(folder) + value[len(mount) :]
        return value

    port = free_port()
    args = [local(a) for a in c["args"]]
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    env = {k: local(v["value"]) for k, v in env_of(c).items() if "value" in v}
    env = {**os.environ, **env, "OPENRL_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # the image's ENTRYPOINT is the openrl-service script; the same entry point here
    proc = subprocess.Popen(
        [sys.executable, "-m", "openrl_service.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        readiness = c["readinessProbe"]["httpGet"]["path"]
        deadline = time.monotonic() + 120
        ready = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(base + readiness, timeout=5)
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
        assert ready is not None and ready.status_code == 200, ready and ready.text
        for probe in ("startupProbe", "livenessProbe"):
            assert httpx.get(base + c[probe]["httpGet"]["path"], timeout=5).status_code == 200
        assert httpx.get(base + "/metrics", timeout=5).status_code == 200  # the PodMonitoring scrape, no key
        # the Secret's key works, a made-up one does not
        assert httpx.get(base + "/openrl/v1/runs", headers={"X-API-Key": KEY}, timeout=5).status_code == 200
        assert (
            httpx.get(base + "/openrl/v1/runs", headers={"X-API-Key": "tml-nope"}, timeout=5).status_code
            == 401
        )
        # everything it wrote went to the volumes (the root filesystem is read-only in the pod)
        assert any(mounts["/data"].iterdir())
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        rc = proc.wait(timeout=pod["terminationGracePeriodSeconds"])
        assert rc == 0
        assert time.monotonic() - started < pod["terminationGracePeriodSeconds"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
