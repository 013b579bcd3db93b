"""`serve --world-size 2`: one base model served by a torch.distributed group of two CPU ranks (gloo).

What a user of several devices relies on, checked through the unmodified Tinker SDK and the notebook
API against `serve` at world size 1 on the same seeds and data: LoRA runs (replicated, each batch's
datums split over the ranks) and full runs (sharded with FSDP2) train to the same losses; a batch of
one datum works; checkpoints written at one world size load at the other; a full run too big for one
device's share is admitted when sharded; a rank killed with kill -9 is restarted with the journal
replayed; a kill -9 of `serve` leaves no rank behind; and the same group spans two "nodes" on loopback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
import tinker
from tinker import types

from openrl_jupyter.client import Client
from openrl_jupyter.local import free_port
from tests._support.serve import Served, finish, start, wait_ready
from tests.conftest import ALICE_KEY

TEXT = [list(b"the cat sat on the mat. "), list(b"a dog ran in the sun! "), list(b"one two three four ")]
ENV = {
    "OPENRL_GROUP_LOG_COMMANDS": "on",
    "OPENRL_API_KEYS": f"alice:{ALICE_KEY}",
    "OPENRL_GROUP_TIMEOUT_S": "30",
    "OPENRL_FUSION": "on",
}


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def batch(k: int, n: int) -> list[types.Datum]:
    return [datum(TEXT[j % len(TEXT)]) for j in range(k, k + n)]


@contextlib.contextmanager
def serving(
    data_dir: Path, tiny_model_dir: Path, *args: str, env: dict | None = None, port: int | None = None
):
    data_dir.mkdir(parents=True, exist_ok=True)
    served = start(data_dir, tiny_model_dir, *args, env={**ENV, **(env or {})}, port=port)
    try:
        wait_ready(served)
        yield served
    finally:
        if served.proc.returncode is None:
            served.proc.terminate()
            finish(served, 90)


def ranks_of(served: Served) -> list[psutil.Process]:
    """The rank processes `serve` started (its children running `serve` with OPENRL_RANK)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(served.proc.pid).children()
    return []


def rank_pid(served: Served, rank: int) -> int:
    for child in ranks_of(served):
        with contextlib.suppress(psutil.Error):
            if child.environ().get("OPENRL_RANK") == str(rank):
                return child.pid
    raise AssertionError(f"no rank {rank} among {[c.pid for c in ranks_of(served)]}")


def train(url: str, rank: int, steps: int, *, save: str | None = None, load: str | None = None):
    """``steps`` steps of a run (a batch of three, then growing), then a batch of one: its losses."""
    sc = tinker.ServiceClient(base_url=url, api_key=ALICE_KEY)
    if load is None:
        tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=rank, seed=0)
    else:
        tc = sc.create_training_client_from_state_with_optimizer(load)
    losses = []
    for k in range(steps):
        fb = tc.forward_backward(batch(k, 3 + k % 2), "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses += [float(fb.result().metrics["loss:sum"]), float(step.metrics["grad_norm:mean"])]
    losses.append(float(tc.forward_backward(batch(0, 1), "cross_entropy").result().metrics["loss:sum"]))
    path = tc.save_state(save).result().path if save else None
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    prompt = types.ModelInput.from_ints(list(b"the ca"))
    sampled = tc.save_weights_and_get_sampling_client().sample(prompt, 1, greedy).result().sequences[0].tokens
    sc.close("success").result()
    return losses, path, sampled


def two_fused(url: str) -> list[float]:
    """Two LoRA runs' forward/backward calls in flight together (fused into one pass when ready)."""
    sc = tinker.ServiceClient(base_url=url, api_key=ALICE_KEY)
    a = sc.create_lora_training_client(base_model="openrl/tiny", rank=4, seed=1)
    b = sc.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=2)
    busy = sc.create_sampling_client(base_model="openrl/tiny")
    long = types.SamplingParams(max_tokens=256, temperature=1.0, seed=0)
    out = []
    for k in range(2):
        # the device kept busy while both calls queue: they run as one fused pass when it is free
        busy.sample(types.ModelInput.from_ints(list(b"abc")), 16, long)
        fa, fb = (
            a.forward_backward(batch(k, 2), "cross_entropy"),
            b.forward_backward(batch(k + 1, 3), "cross_entropy"),
        )
        a.optim_step(types.AdamParams(learning_rate=1e-2))
        b.optim_step(types.AdamParams(learning_rate=1e-2))
        out += [float(fa.result().metrics["loss:sum"]), float(fb.result().metrics["loss:sum"])]
    sc.close("success").result()
    return out


def fused_ops(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("openrl_fused_ops_total "):
            return float(line.split()[1])
    return 0.0


def native(url: str) -> list[float]:
    """The notebook API: sample with a seed, then a train step on the samples' advantages."""
    out = []
    with Client(url, token=ALICE_KEY) as c:
        run = c.create_run(name="n", rank=8, seed=3)
        for k in range(2):
            got = c.sample(
                run["run_id"], ["abc", "xyz"], num_samples=2, max_tokens=6, seed=k, temperature=1.0
            )
            samples = got["samples"]
            adv = [1.0, 0.5, -0.25, 0.75][: len(samples)]
            res = c.train_step(
                run["run_id"],
                [{"sample_id": s["sample_id"], "advantage": a} for s, a in zip(samples, adv, strict=True)],
            )
            out += [float(res["loss"]), float(res["grad_norm"])]
    return out


def close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert y == pytest.approx(x, rel=1e-4, abs=1e-6), (a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir) -> dict:
    """Everything trained at world size 1 (the reference), with its checkpoints' paths and data dir."""
    data = tmp_path_factory.mktemp("world1")
    with serving(data, tiny_model_dir) as s:
        out = {
            "lora": train(s.url, 8, 3, save="lora1"),
            "full": train(s.url, 0, 3, save="full1"),
            "fused": two_fused(s.url),
            "native": native(s.url),
            "data": data,
        }
        for kind, rank in (("lora", 8), ("full", 0)):  # each checkpoint loaded and trained on, here
            out[f"{kind} resumed"] = train(s.url, rank, 2, load=out[kind][1])[0]
        return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory, tiny_model_dir):
    with serving(tmp_path_factory.mktemp("world2"), tiny_model_dir, "--world-size", "2") as s:
        yield s


def test_lora_and_full_runs_train_to_the_losses_of_one_device(reference, world2):
    assert len(ranks_of(world2)) == 2
    for rank, kind in ((8, "lora"), (0, "full")):
        losses, _, sampled = train(world2.url, rank, 3)
        close(reference[kind][0], losses)  # the last one is a batch of a single datum
        assert sampled == reference[kind][2]  # greedy samples of the trained weights, on rank 0
    fused_before = fused_ops(world2.url)
    close(reference["fused"], two_fused(world2.url))
    assert fused_ops(world2.url) > fused_before  # the two runs' calls shared passes, split over the ranks
    close(reference["native"], native(world2.url))
    metrics = httpx.get(f"{world2.url}/metrics").text
    assert "openrl_world_size 2" in metrics
    for rank in (0, 1):  # each device's memory and busy time
        assert f'openrl_rank_memory_bytes{{rank="{rank}"}}' in metrics
        assert f'openrl_rank_busy_seconds_total{{rank="{rank}"}}' in metrics
    # the notebook's live telemetry: each device's busy share while a run trains
    with Client(world2.url, token=ALICE_KEY) as c:
        run = c.create_run(name="busy", rank=8, seed=4)
        for k in range(3):
            got = c.sample(run["run_id"], ["abc"], num_samples=4, max_tokens=8, seed=k, temperature=1.0)
            c.train_step(
                run["run_id"], [{"sample_id": x["sample_id"], "advantage": 1.0} for x in got["samples"]]
            )
        tick = next(e for e in c.events() if e.get("type") == "tick")
    assert [d["rank"] for d in tick["devices"]] == [0, 1]
    assert all(0.0 < d["busy"] <= 1.0 and d["memory_bytes"] > 0 for d in tick["devices"]), tick["devices"]


def test_checkpoints_load_across_world_sizes(reference, world2, tmp_path, tiny_model_dir):
    # world 1's checkpoints, copied into world 2's data dir, continue there exactly as at world 1
    for kind, rank in (("lora", 8), ("full", 0)):
        path = reference[kind][1]
        copy_checkpoint(reference["data"], world2.data_dir, path)
        got, _, _ = train(world2.url, rank, 2, load=path)
        close(reference[f"{kind} resumed"], got)
    # and a world-2 checkpoint of a sharded full run (gathered whole) loads at world 1
    _, saved, _ = train(world2.url, 0, 2, save="full2")
    at2, _, _ = train(world2.url, 0, 1, load=saved)
    data1 = tmp_path / "w1"
    copy_checkpoint(world2.data_dir, data1, saved)
    with serving(data1, tiny_model_dir) as s:
        at1, _, _ = train(s.url, 0, 1, load=saved)
    close(at1, at2)


def copy_checkpoint(src: Path, dst: Path, tinker_path: str) -> None:
    run_id, _, _ = tinker_path.removeprefix("tinker://").partition("/")
    folder = next(src.glob(f"tenants/*/runs/{run_id.replace(':', '~')}"))
    target = dst / folder.relative_to(src)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(folder, target)


def test_a_full_run_that_fits_only_when_sharded(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    one = n * 4 * 5  # weights, gradients, the set-aside gradient, AdamW's two moments (float32)
    env = {"OPENRL_FULL_RUN_BUDGET_BYTES": str(int(one * 0.85))}
    with serving(tmp_path / "w1", tiny_model_dir, env=env) as s:
        sc = tinker.ServiceClient(base_url=s.url, api_key=ALICE_KEY)
        with pytest.raises(Exception) as refused:
            sc.create_lora_training_client(base_model="openrl/tiny", rank=0, seed=0).get_info()
        assert "OPENRL_FULL_RUN_BUDGET_BYTES" in str(refused.value)
    with serving(tmp_path / "w2", tiny_model_dir, "--world-size", "2", env=env) as s:
        sc = tinker.ServiceClient(base_url=s.url, api_key=ALICE_KEY)
        tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=0, seed=0)
        assert tc.forward_backward(batch(0, 2), "cross_entropy").result().metrics["loss:sum"] > 0
        # each device holds half the run: weights and gradients, 4 + 4 bytes a parameter, no AdamW yet
        held = {}
        for line in httpx.get(f"{s.url}/metrics").text.splitlines():
            if line.startswith("openrl_rank_run_state_bytes{"):
                held[line.split('rank="')[1][0]] = float(line.split()[-1])
        assert sum(held.values()) == pytest.approx(n * 8, rel=0.02), held
        assert held["0"] == pytest.approx(held["1"], rel=0.05), held
        with pytest.raises(Exception) as second:  # the first holds the share: the numbers say so
            sc.create_lora_training_client(base_model="openrl/tiny", rank=0, seed=1).get_info()
        message = str(second.value)
        assert "sharded over 2 devices" in message and "per device" in message
        assert "OPENRL_FULL_RUN_BUDGET_BYTES" in message and "all-gathers" in message


def test_kill_9_of_a_rank_restarts_the_group_and_loses_nothing(reference, tmp_path, tiny_model_dir):
    """A LoRA run and a full run train at world size 2; rank 1 is killed mid-way and the group comes back
    with the journal replayed; then the same data dir serves at world size 1 and both runs go on."""
    data = tmp_path / "d"
    with serving(data, tiny_model_dir, "--world-size", "2") as s:
        port = int(s.url.rsplit(":", 1)[1])
        sc = tinker.ServiceClient(base_url=s.url, api_key=ALICE_KEY)
        runs = {
            "lora": sc.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=0),
            "full": sc.create_lora_training_client(base_model="openrl/tiny", rank=0, seed=0),
        }
        got: dict[str, list[float]] = {"lora": [], "full": []}
        for k in range(3):
            if k == 2:
                old = rank_pid(s, 1)
                os.kill(old, signal.SIGKILL)
                _wait(lambda old=old: _restarted(s, old), 60, "the group to restart")
            for kind, tc in runs.items():
                fb = tc.forward_backward(batch(k, 3 + k % 2), "cross_entropy")
                step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                got[kind] += [float(fb.result().metrics["loss:sum"]), float(step.metrics["grad_norm:mean"])]
        for kind in runs:
            close(reference[kind][0][:6], got[kind])
        assert "restarting the group" in s.stderr
    with serving(data, tiny_model_dir, port=port):  # the same data dir at world size 1
        for kind, tc in runs.items():
            last = float(tc.forward_backward(batch(0, 1), "cross_entropy").result().metrics["loss:sum"])
            close(reference[kind][0][6:], [last])


def test_a_hung_rank_is_caught_by_the_collective_timeout_and_the_group_restarts(tmp_path, tiny_model_dir):
    """Rank 1 stopped (SIGSTOP, as a hang): rank 0's next collective waits OPENRL_GROUP_TIMEOUT_S, gives
    up, and the whole group is started again; the acknowledged run goes on where it was."""
    env = {"OPENRL_GROUP_TIMEOUT_S": "15"}
    with serving(tmp_path / "d", tiny_model_dir, "--world-size", "2", env=env) as s:
        sc = tinker.ServiceClient(base_url=s.url, api_key=ALICE_KEY)
        tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=0)
        first = float(tc.forward_backward(batch(0, 3), "cross_entropy").result().metrics["loss:sum"])
        hung = rank_pid(s, 1)
        os.kill(hung, signal.SIGSTOP)
        t0 = time.monotonic()
        again = float(tc.forward_backward(batch(0, 3), "cross_entropy").result().metrics["loss:sum"])
        assert time.monotonic() - t0 >= 10  # it waited for the timeout, not less
        assert again == pytest.approx(first, rel=1e-6)  # no optim_step between: the same loss
        assert not psutil.pid_exists(hung) or psutil.Process(hung).status() == psutil.STATUS_ZOMBIE
        assert "restarting the group" in s.stderr


def _restarted(s: Served, old: int) -> bool:
    try:
        return rank_pid(s, 1) != old and httpx.get(f"{s.url}/readyz", timeout=2).status_code == 200
    except (AssertionError, httpx.HTTPError):
        return False


def _wait(ok, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_kill_9_of_serve_leaves_no_rank_behind(tmp_path, tiny_model_dir):
    with serving(tmp_path / "d", tiny_model_dir, "--world-size", "2") as s:
        ranks = ranks_of(s)
        assert len(ranks) == 2
        s.proc.kill()
        s.proc.wait()
        _, alive = psutil.wait_procs(ranks, timeout=20)
        assert not alive, [p.pid for p in alive]


def test_two_nodes_on_loopback_form_one_group(reference, tmp_path, tiny_model_dir):
    port = free_port()
    nodes = ["--world-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    (tmp_path / "n0").mkdir()
    (tmp_path / "n1").mkdir()
    node0 = start(tmp_path / "n0", tiny_model_dir, *nodes, "--node-rank", "0", env=ENV)
    node1 = None
    try:
        # node 0 alone: its rank waits for the group, and /readyz says it is not ready
        _wait(lambda: _answers(node0), 60, "node 0's HTTP")
        time.sleep(2)
        assert httpx.get(f"{node0.url}/readyz", timeout=5).status_code == 503
        node1 = start(tmp_path / "n1", tiny_model_dir, *nodes, "--node-rank", "1", env=ENV)
        wait_ready(node0)
        losses, _, _ = train(node0.url, 8, 3)
        close(reference["lora"][0], losses)
        node0.proc.terminate()
        assert finish(node0, 90) == 0
        assert finish(node1, 60) == 0  # node 1's ranks stop when rank 0 stops them
    finally:
        for node in (node0, node1):
            if node is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait()


def _answers(s: Served) -> bool:
    try:
        httpx.get(f"{s.url}/readyz", timeout=2)
        return True
    except httpx.HTTPError:
        return False


def test_the_group_listens_on_loopback_only(world2):
    """On one node the ranks meet in a file of the data dir and talk over loopback: apart from the
    HTTP port (here bound to loopback too), nothing of the group is reachable from another host."""
    procs = [psutil.Process(world2.proc.pid), *ranks_of(world2)]
    listening = [
        c.laddr for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
    ]
    assert listening  # gloo's own sockets at least
    assert all(addr.ip in ("127.0.0.1", "::1") for addr in listening), listening
    assert (
        not list((world2.data_dir / "group").glob("store-*"))
        or oct((world2.data_dir / "group").stat().st_mode & 0o777) == "0o700"
    )


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--world-size", "0"], "--world-size (OPENRL_WORLD_SIZE) must be between 1 and 1024; got 0"),
        (["--world-size", "3", "--nnodes", "2"], "--nnodes (OPENRL_NNODES) must divide --world-size 3"),
        (["--world-size", "2", "--nnodes", "2"], "--master-addr and --master-port"),
        (["--world-size", "2", "--devices", "cpu"], "names 1 devices; this node runs 2 ranks"),
        (["--world-size", "2", "--devices", "tpu:0,tpu:1"], "'tpu:0' is not cpu or cuda:N"),
        (
            ["--vllm-tp", "2", "--sampler", "torch"],
            "--vllm-tp 2 shards vLLM's model over 2 GPUs, but the sampler is torch",
        ),
        (["--vllm-tp", "0"], "--vllm-tp (OPENRL_VLLM_TP) must be between 1 and 64; got 0"),
        (
            ["--world-size", "2", "env:OPENRL_GROUP_TIMEOUT_S=1"],
            "OPENRL_GROUP_TIMEOUT_S must be between 5 and 86400; got 1",
        ),
        (
            ["--sampler-devices", "cuda:1", "--sampler", "torch"],
            "--sampler-devices (OPENRL_SAMPLER_DEVICES) places vLLM's workers",
        ),
    ],
)
def test_a_bad_group_or_sampler_layout_is_refused_at_start_naming_the_flag(tmp_path, flags, says):
    from tests._support.serve import cli

    given = dict(f.removeprefix("env:").split("=", 1) for f in flags if f.startswith("env:"))
    flags = [f for f in flags if not f.startswith("env:")]
    argv, env = cli("serve", "--data-dir", str(tmp_path), "--port", "0", *flags, env=given)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
    assert not (tmp_path / "group").exists()  # refused before any rank started


def test_vllm_tensor_parallel_layouts():
    """What `--vllm-tp` and `--sampler-devices` give vLLM, and the layouts refused (vLLM itself needs
    GPUs: bench/gpu_check.sh runs TP 1 against TP N there)."""
    from openrl_service.config import from_env
    from openrl_service.sampling.parallel import check_parallel, vllm_parallel_args

    s = from_env({}, vllm_tp=2)
    assert vllm_parallel_args(s) == (
        {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
        {},
    )
    apart = from_env({}, vllm_tp=2, sampler_devices=["cuda:4", "cuda:5"])
    assert vllm_parallel_args(apart)[1] == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert vllm_parallel_args(from_env({})) == ({}, {})
    check_parallel(apart, sampler="vllm", training_devices=["cuda:0", "cuda:1"], cuda=True)
    check_parallel(s, sampler="vllm", training_devices=["cuda:0", "cuda:1"], cuda=True)  # colocated
    with pytest.raises(ValueError, match="needs CUDA GPUs; on the CPU vLLM runs one worker"):
        check_parallel(s, sampler="vllm", training_devices=["cpu"], cuda=False)
    with pytest.raises(ValueError, match=r"overlaps the training group's devices \(cuda:1\)"):
        overlap = from_env({}, vllm_tp=2, sampler_devices=["cuda:1", "cuda:2"])
        check_parallel(overlap, sampler="vllm", training_devices=["cuda:0", "cuda:1"], cuda=True)
    with pytest.raises(ValueError, match="names 1 GPUs; --vllm-tp is 2"):
        check_parallel(
            from_env({}, vllm_tp=2, sampler_devices=["cuda:3"]),
            sampler="vllm",
            training_devices=[],
            cuda=True,
        )
