"""A real JupyterHub spawns the notebook image as containers (DockerSpawner against podman's
Docker-compatible API), with the `openrl` hub service and the chart's roles and scopes
(tests/_support/jhub.py reads them from k8s/jupyterhub/values.yaml); the service image runs with the
cpu overlay's container spec and `--hub-api-url` at this hub. A user's server is
`jupyterhub-singleuser` in the image (the chart's command), as jovyan with the home volume; a kernel in
it connects with no arguments (`$OPENRL_URL` and the server's own hub token) and trains two RL steps.

Containers share the host's network here (the harness talks to the kernel over its ZMQ ports on
loopback); on the cluster they are pods behind the chart's network policies (tests/k8s checks those)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import uuid

import pytest

from openrl_jupyter.local import free_port
from tests._support.jhub import HubUnavailable, proxy_command, start_hub, wait_hub
from tests.images._containers import (
    deployment,
    engine_or_skip,
    image_or_skip,
    images,
    pod_run_args,
    remove,
    sh,
    wait_http,
)

pytestmark = pytest.mark.timeout(900)


def _podman_api(eng: str, root) -> tuple[subprocess.Popen, str]:
    """podman's Docker-compatible API on a socket of this test (docker: the daemon's own socket)."""
    if eng != "podman":
        return None, "unix:///var/run/docker.sock"
    sock = root / "podman.sock"
    proc = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{sock}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "podman system service did not start"
        time.sleep(0.2)
    return proc, f"unix://{sock}"


def _ulimits(eng: str) -> list[dict]:
    flags = images.limit_args(eng)
    out = []
    for flag in flags[1::2]:
        name, _, soft_hard = flag.partition("=")
        soft, hard = soft_hard.split(":")
        out.append({"name": name, "soft": int(soft), "hard": int(hard)})
    return out


def test_a_hub_user_trains_from_the_notebook_image_spawned_as_a_container(tmp_path):
    try:
        proxy = proxy_command()
    except HubUnavailable as e:
        pytest.fail(str(e)) if os.environ.get("OPENRL_IMAGE_CHECK") else pytest.skip(str(e))
    assert proxy
    eng = engine_or_skip()
    service_tag, notebook_tag = image_or_skip(eng, "service-cpu"), image_or_skip(eng, "notebook")
    api, base_url = _podman_api(eng, tmp_path)
    service_token = secrets.token_hex(32)  # the openrl hub service's apiToken, as the admin sets it
    hub_root = tmp_path / "hub"
    service_name = f"openrl-service-hub-{uuid.uuid4().hex[:8]}"
    service_port, server_port = free_port(), free_port()
    hub = None
    try:
        hub = start_hub(
            hub_root,
            users=("alice",),
            environment={"OPENRL_URL": f"http://127.0.0.1:{service_port}"},
            service_tokens={"openrl": service_token},
            docker={
                "client_kwargs": {"base_url": base_url},
                "image": notebook_tag,
                "pull_policy": "never",
                "network_name": "host",
                "use_internal_ip": True,  # no port bindings: the server listens on the host's loopback
                "host_ip": "127.0.0.1",
                "port": server_port,
                "remove": True,
                "name_template": "openrl-hub-{username}-" + uuid.uuid4().hex[:6],
                # z2jh: the user's volume at /home/jovyan, owned by the chart's fsGid (100)
                "volumes": {str(hub_root / "home" / "{username}"): "/home/jovyan"},
                "extra_host_config": {"ulimits": _ulimits(eng), "cap_drop": ["ALL"]},
            },
        )
        home = hub_root / "home" / "alice"
        os.chown(home, 1000, 100)
        home.chmod(0o2775)

        # the service container: the overlay's spec, its hub at this hub, on the host's network
        flags, spec = pod_run_args(deployment("cpu"), tmp_path / "service", "# hub users only\n", eng)
        args = list(spec["args"])
        args[args.index("--hub-api-url") + 1] = hub.api_url
        args[args.index("--port") + 1] = str(service_port)
        args[args.index("--host") + 1] = "127.0.0.1"
        run = [eng, "run", "-d", "--name", service_name, *images.limit_args(eng), *flags, "--network", "host"]
        sh(*run, "--env", f"JUPYTERHUB_API_TOKEN={service_token}", service_tag, *args)
        wait_hub(hub)
        hub.spawn("alice")
        wait_http(f"http://127.0.0.1:{service_port}/readyz", 300, container=(eng, service_name))

        containers = sh(eng, "ps", "--format", "{{.Names}} {{.Image}}").stdout
        assert any(
            line.startswith("openrl-hub-alice-") and notebook_tag in line for line in containers.splitlines()
        ), containers
        with hub.kernel("alice") as k:
            who = k.execute(
                "import os, shutil; print(os.getuid(), os.getgid(), os.environ['HOME'],"
                " os.path.exists('/run/.containerenv') or os.path.exists('/.dockerenv'),"
                " shutil.which('jupyterhub-singleuser'))"
            ).stdout.split()
            assert who[:4] == ["1000", "100", "/home/jovyan", "True"], who
            connect = k.execute("%load_ext openrl_jupyter\n%openrl connect", timeout=120).stdout
            # no arguments: $OPENRL_URL, and the server's own hub token as the credential
            assert f"127.0.0.1:{service_port}" in connect and "as your JupyterHub user" in connect, connect
            k.execute(
                "%%openrl reward letters\ndef reward(prompt, completion, **info):\n"
                "    return sum(c.isalpha() for c in completion) / max(1, len(completion))"
            )
            out = k.execute(
                'PROMPTS = ["Name a colour:", "Say hello:"]\n'
                "run = %openrl train --reward letters --prompts PROMPTS --steps 2 --group 4 --max-tokens 8 --name hub-image\n"
                "run.wait(timeout=300)\nimport json\n"
                'print("RESULT " + json.dumps({"state": str(run.state), "steps": [h["step"] for h in run.history]}))',
                timeout=400,
            ).stdout
            (result,) = [
                json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line
            ]
            assert result == {"state": "finished", "steps": [1, 2]}, out
            # the service lists the run to alice's hub identity
            runs = k.execute("%openrl runs")
            text = runs.stdout + "".join(str(o.get("text/plain", "")) for o in runs.outputs)
            assert "hub-image" in text, text
    finally:
        try:
            if hub is not None:
                hub.stop()
        finally:
            _cleanup(eng, service_name, api)


def _cleanup(eng: str, service_name: str, api: subprocess.Popen | None) -> None:
    try:
        remove(eng, service_name)
        for line in sh(eng, "ps", "-a", "--format", "{{.Names}}", check=False).stdout.split():
            if line.startswith("openrl-hub-alice-"):
                remove(eng, line)
    finally:
        if api is not None:
            api.terminate()
            api.wait(10)
