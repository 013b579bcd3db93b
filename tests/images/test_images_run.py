"""The CPU service and notebook images, run as the cluster runs them (`make image-check`).

The service container gets exactly the rendered `k8s/overlays/cpu` Deployment's container spec (args,
env, uid/gid and fsGroup, read-only root, all capabilities dropped, no privilege escalation, memory
limit, `/data` as a group-owned volume, `/tmp` as a tmpfs of the emptyDir's size, the key file where
the Secret mounts); the unmodified Tinker SDK trains and samples against it from outside, a checkpoint
survives `restart`, and SIGTERM drains and exits 0 within the overlay's grace. The notebook image runs
`jupyter lab` as the chart's singleuser pod would (jovyan, uid 1000, gid 100, the home volume), lists
our lab and server extensions enabled, and a kernel in it trains two RL steps with `%openrl` against
the service container over a container network. The tests run in file order: the last stops the service.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import httpx
import pytest

from openrl_jupyter.local import free_port
from tests.images._containers import (
    deployment,
    engine_or_skip,
    image_or_skip,
    images,
    network,
    pod_run_args,
    remove,
    sh,
    wait_http,
)
from tests.k8s._k8s import ROOT

pytestmark = pytest.mark.timeout(900)
MODEL = "openrl/tiny"


@pytest.fixture(scope="module")
def eng():
    return engine_or_skip()


@pytest.fixture(scope="module")
def net(eng):
    with network(eng) as name:
        yield name


@pytest.fixture(scope="module")
def service(eng, net, tmp_path_factory):
    tag = image_or_skip(eng, "service-cpu")
    host = tmp_path_factory.mktemp("service")
    key = "tml-" + secrets.token_hex(24)
    flags, spec = pod_run_args(deployment("cpu"), host, f"admin {key}\n", eng)
    port = free_port()
    name = f"openrl-service-{uuid.uuid4().hex[:8]}"
    run = [eng, "run", "-d", "--name", name, *images.limit_args(eng), *flags]
    # the ClusterIP Service's name on the container network, and a loopback port for the SDK here
    run += ["--network", net, "--network-alias", "openrl-service", "-p", f"127.0.0.1:{port}:{spec['port']}"]
    url = f"http://127.0.0.1:{port}"
    try:
        sh(*run, tag, *spec["args"])
        wait_http(f"{url}/readyz", 300, container=(eng, name))
        yield SimpleNamespace(name=name, url=url, key=key, grace=spec["grace"], memory=spec["memory"])
    finally:
        remove(eng, name)


def test_the_container_runs_with_the_overlays_security_context(eng, service):
    """What the pod spec asks for is what the process got: uid/gid/groups, no capabilities, no new
    privileges, the runtime's seccomp filter, a read-only root (/run and /var/tmp too), the memory limit
    without swap, the args (the key only as a file path, in neither the command line nor the env)."""
    script = "; ".join(
        [
            "id -u; id -g; id -G",
            "grep -E '^(Cap(Eff|Prm|Bnd)|NoNewPrivs|Seccomp):' /proc/1/status",
            "for d in /opt /run /var/tmp /etc; do touch $d/probe 2>/dev/null && echo writable:$d; done",
            "touch /data/probe && echo data-writable",
            "echo memory:$(cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes)",
            "echo swap:$(cat /sys/fs/cgroup/memory.swap.max 2>/dev/null"
            " || cat /sys/fs/cgroup/memory/memory.memsw.limit_in_bytes 2>/dev/null || echo none)",
            "cat /proc/1/cmdline /proc/1/environ | tr '\\0' ' '",
        ]
    )
    out = sh(eng, "exec", service.name, "sh", "-c", script).stdout
    uid, gid, groups = out.splitlines()[:3]
    assert (uid, gid) == ("10001", "10001") and "10001" in groups.split(), out  # runAsUser/Group, fsGroup
    for cap in ("CapEff", "CapPrm", "CapBnd"):
        assert f"{cap}:\t0000000000000000" in out, out
    assert "NoNewPrivs:\t1" in out and "Seccomp:\t2" in out, out  # 2: a seccomp filter is applied
    assert "writable:" not in out, out  # the root, /run and /var/tmp are read-only
    assert "data-writable" in out, out
    assert f"memory:{service.memory}" in out, out
    swap = re.search(r"swap:(\S+)", out).group(1)
    assert swap in ("0", str(service.memory), "none"), out  # cgroup v2 swap.max 0, v1 memsw = memory
    assert "--api-keys-file /etc/openrl/api-keys/api-keys" in out and service.key not in out, out


def test_the_tinker_sdk_trains_and_samples_against_the_container(service):
    """tests/_support/tinker_conformance.py, the unmodified SDK from this machine, end to end."""
    env = {**os.environ, "TINKER_API_KEY": service.key}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_support" / "tinker_conformance.py"), service.url, MODEL],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("PASS"), proc.stdout + proc.stderr


def test_only_the_mounted_key_is_accepted(service):
    url = f"{service.url}/api/v1/get_server_capabilities"
    assert httpx.get(url, headers={"X-API-Key": service.key}, timeout=10).status_code == 200
    wrong = httpx.get(url, headers={"X-API-Key": "tml-" + "0" * 48}, timeout=10)
    assert wrong.status_code == 401 and "does not know" in wrong.text, wrong.text


@pytest.fixture(scope="module")
def notebook(eng, net, service, tmp_path_factory):
    """The notebook image as z2jh's singleuser pod: uid 1000, gid 100 (the chart's fsGid), the home
    volume at /home/jovyan, OPENRL_URL as values.yaml sets it (the Service's name) and a key in the
    environment (on the hub, the server's own JUPYTERHUB_API_TOKEN)."""
    tag = image_or_skip(eng, "notebook")
    home = tmp_path_factory.mktemp("home")
    os.chown(home, 1000, 100)
    home.chmod(0o2775)
    token = secrets.token_hex(16)
    port = free_port()
    name = f"openrl-notebook-{uuid.uuid4().hex[:8]}"
    run = [eng, "run", "-d", "--name", name, *images.limit_args(eng), "--user", "1000:100"]
    run += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    run += ["--network", net, "-p", f"127.0.0.1:{port}:8888", "--volume", f"{home}:/home/jovyan"]
    run += ["--env", "OPENRL_URL=http://openrl-service:8000", "--env", f"OPENRL_TOKEN={service.key}"]
    cmd = [
        "jupyter",
        "lab",
        "--ip=0.0.0.0",
        "--port=8888",
        "--no-browser",
        f"--IdentityProvider.token={token}",
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        sh(*run, tag, *cmd)
        wait_http(f"{url}/api/status?token={token}", 120, container=(eng, name))
        yield SimpleNamespace(name=name, url=url, token=token, home=home)
    finally:
        remove(eng, name)


def test_jupyter_lab_in_the_notebook_image_serves_our_extensions(eng, notebook):
    labext = sh(eng, "exec", notebook.name, "jupyter", "labextension", "list")
    text = labext.stdout + labext.stderr
    assert any("openrl-jupyter-labextension" in line and "enabled" in line for line in text.splitlines()), (
        text
    )
    serverext = sh(eng, "exec", notebook.name, "jupyter", "server", "extension", "list")
    text = serverext.stdout + serverext.stderr
    assert any("openrl_jupyter" in line and "enabled" in line for line in text.splitlines()), text
    # the running server loaded both: the page lists the panel, the extension's route answers
    page = httpx.get(f"{notebook.url}/lab?token={notebook.token}", timeout=30, follow_redirects=True)
    assert page.status_code == 200 and "openrl-jupyter-labextension" in page.text, page.text[:500]
    who = sh(
        eng, "exec", notebook.name, "sh", "-c", "command -v jupyterhub-singleuser && id -un && echo $HOME"
    )
    assert who.stdout.split() == ["/opt/venv/bin/jupyterhub-singleuser", "jovyan", "/home/jovyan"], who.stdout


def _cell(source: str) -> dict:
    return {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": source}


def test_a_kernel_in_the_notebook_image_trains_against_the_service_container(eng, notebook):
    cells = [
        "%load_ext openrl_jupyter\n%openrl connect",
        "%%openrl reward letters\ndef reward(prompt, completion, **info):\n"
        "    return sum(c.isalpha() for c in completion) / max(1, len(completion))",
        'PROMPTS = ["Name a colour:", "Say hello:"]\n'
        "run = %openrl train --reward letters --prompts PROMPTS --steps 2 --group 4 --max-tokens 8 --name image-check\n"
        "run.wait(timeout=300)\n"
        "import json\n"
        'print("RESULT " + json.dumps({"state": str(run.state), "steps": [h["step"] for h in run.history],'
        ' "rewards": [h.get("reward_mean") for h in run.history]}))',
    ]
    nb = {"cells": [_cell(c) for c in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = notebook.home / "image-check.ipynb"
    path.write_text(json.dumps(nb))
    os.chown(path, 1000, 100)
    proc = sh(
        eng,
        "exec",
        "--workdir",
        "/home/jovyan",
        notebook.name,
        "jupyter",
        "execute",
        "--inplace",
        "--timeout=400",
        "image-check.ipynb",
        check=False,
        timeout=600,
    )
    out = json.loads(path.read_text())
    texts = [
        "".join(o["text"]) if isinstance(o["text"], list) else o["text"]
        for c in out["cells"]
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream"
    ]
    assert proc.returncode == 0, f"{proc.stderr[-4000:]}\n{texts}"
    (result,) = [json.loads(t.split("RESULT ", 1)[1]) for t in texts if "RESULT " in t]
    assert result["steps"] == [1, 2], result
    assert "finished" in result["state"].lower(), result
    assert all(r is not None and 0.0 <= r <= 1.0 for r in result["rewards"]), result
    connect = "".join(texts[:1])
    assert "openrl-service:8000" in connect, texts


def test_the_gpu_check_runs_inside_the_service_image(eng):
    """bench/gpu_check.sh, mounted read-only, runs in the image as its uid with a read-only root (the
    command k8s/README.md gives for the CUDA image on a GPU machine; here --smoke, on the CPU)."""
    tag = image_or_skip(eng, "service-cpu")
    run = [
        eng,
        "run",
        "--rm",
        *images.limit_args(eng),
        "--user",
        "10001:10001",
        "--read-only",
        "--cap-drop",
        "ALL",
    ]
    run += [
        "--tmpfs",
        "/tmp:rw,size=2g,mode=1777",
        "--volume",
        f"{ROOT}:/src:ro",
        "--env",
        "OUT=/tmp/gpu-check",
    ]
    run += ["--env", "PYTHON=python3", "--entrypoint", "bash", tag, "/src/bench/gpu_check.sh", "--smoke"]
    out = sh(*run, timeout=400).stdout
    assert "gpu_check.sh: exit 0" in out and " 0 failed" in out, out[-3000:]


def test_a_checkpoint_survives_a_restart(eng, service):
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=service.url, api_key=service.key)
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    seq = list(b"Checkpoints outlive the container.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    path = tc.save_state("before-restart").result().path
    loss = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    base = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    untrained = base.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert loss < untrained - 1e-3, (loss, untrained)

    t0 = time.monotonic()
    sh(eng, "restart", "-t", str(service.grace), service.name, timeout=service.grace + 120)
    wait_http(f"{service.url}/readyz", 300, container=(eng, service.name))
    restarted = time.monotonic() - t0

    sc2 = tinker.ServiceClient(base_url=service.url, api_key=service.key)
    tc2 = sc2.create_training_client_from_state(path).result()
    after = tc2.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert math.isclose(after, loss, rel_tol=0, abs_tol=1e-4), (
        after,
        loss,
        f"restart took {restarted:.0f} s",
    )


def test_sigterm_drains_and_exits_0_within_the_grace(eng, service):
    """`podman stop -t GRACE` sends SIGTERM, then SIGKILL after the overlay's terminationGracePeriodSeconds:
    the service drains (OPENRL_DRAIN_GRACE_S) and exits 0 before it, with a training call in flight."""
    import threading

    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=service.url, api_key=service.key)
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4).result()
    seq = list(b"draining " * 20)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    busy = threading.Event()

    def train():
        try:
            for _ in range(200):
                tc.forward_backward([datum] * 8, "cross_entropy").result()  # one call done: the service works
                busy.set()
                tc.forward_backward(
                    [datum] * 8, "cross_entropy"
                )  # and the next is in flight as SIGTERM comes
        except Exception:  # the service goes away under it: that is the point
            pass

    threading.Thread(target=train, daemon=True).start()
    assert busy.wait(60)
    t0 = time.monotonic()
    sh(eng, "stop", "-t", str(service.grace), service.name, timeout=service.grace + 60)
    took = time.monotonic() - t0
    code = sh(eng, "inspect", "--format", "{{.State.ExitCode}}", service.name).stdout.strip()
    logs = sh(eng, "logs", service.name, check=False)
    assert code == "0", f"exit {code} after {took:.1f} s:\n{logs.stderr[-3000:]}"
    assert took < service.grace, f"stopped in {took:.1f} s, the grace is {service.grace} s"
