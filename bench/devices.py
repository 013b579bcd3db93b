"""Several devices per model: `serve` at world size 1 against `serve --world-size N`.

For each world size, one `openrl-service serve` (the Tinker SDK as the client) trains a LoRA run and a
full run with the same seeds and data, and reports:

- s/step of each (median of ``--steps``), and the ratio world N / world 1. On this machine (2 cores,
  CPU ranks on gloo) world 2 gives no speed-up: each rank gets half the cores and the ranks exchange
  gradients (LoRA) or shards (FSDP2) over loopback; the figure says what the group costs, not what
  GPUs gain;
- the memory a full run adds to each rank (the rank processes' RSS before the run is created and after
  its steps, from /proc; on GPUs `openrl_rank_memory_bytes`, CUDA's allocated bytes): about half at
  world size 2, plus FSDP's all-gather transient and the process's own overhead;
- the largest relative difference of the losses from world size 1 (the same arithmetic split over the
  ranks: float rounding only).

``--gpus N`` (a machine with N CUDA GPUs, NCCL): the same with ``--devices cuda:0..N-1``, and, where
vLLM is installed, a greedy-sampling comparison of the same LoRA adapter at vLLM TP 1 and TP N
(``--vllm-tp``), printing how many of the sampled tokens agree. ``bench/gpu_check.sh --gpus N`` runs
this. Not a test: prints tables (bench/RESULTS.md "Several devices").

    python bench/devices.py [--world 2] [--model scale-30m] [--steps 4] [--gpus N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(ROOT))

KEY = "tml-bench-0123456789abcdef"
TEXT = [bytes(f"step {i}: the quick brown fox jumps over the lazy dog. " * 3, "ascii") for i in range(8)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, data: Path, model: str, world: int, extra: list[str], env: dict):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = data
        argv = [sys.executable, "-m", "openrl_service.cli", "serve", "--port", str(self.port)]
        argv += ["--data-dir", str(data), "--model", model, *extra]
        if world > 1:
            argv += ["--world-size", str(world)]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("OPENRL_")}
        self.log = open(data / "serve.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv, env={**clean, "OPENRL_API_KEYS": f"bench:{KEY}", **env}, stdout=self.log, stderr=self.log
        )
        import httpx

        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited:\n{(data / 'serve.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("serve did not become ready in 10 minutes")
            time.sleep(0.5)

    def rank_rss(self) -> list[int]:
        """Resident bytes of each rank process (the server itself at world size 1)."""
        import psutil

        top = psutil.Process(self.proc.pid)
        procs = top.children() or [top]
        return [
            p.memory_info().rss for p in sorted(procs, key=lambda p: int(p.environ().get("OPENRL_RANK", 0)))
        ]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def datum(text: bytes, tokenizer):
    from tinker import types

    ids = list(text)[:96] if tokenizer is None else tokenizer.encode(text.decode())[:96]
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def run(served: Served, rank: int, steps: int) -> dict:
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    model = sc.get_server_capabilities().supported_models[0].model_name
    before = served.rank_rss()
    tc = sc.create_lora_training_client(base_model=model, rank=rank, seed=0)
    tokenizer = None if "openrl/" in model else tc.get_tokenizer()
    times, losses = [], []
    for k in range(steps):
        batch = [datum(TEXT[(k + j) % len(TEXT)], tokenizer) for j in range(4)]
        t0 = time.perf_counter()
        fb = tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        losses.append(float(fb.result().metrics["loss:sum"]))
        times.append(time.perf_counter() - t0)
    after = served.rank_rss()
    held = state_bytes(served.url)
    sc.close("success").result()
    return {
        "s_per_step": statistics.median(times[1:] or times),
        "losses": losses,
        "added_rss": [a - b for a, b in zip(after, before, strict=True)],
        "state_bytes": held,
    }


def state_bytes(url: str) -> list[int]:
    """Each rank's bytes of run state (weights, gradients, optimizer; a sharded run's shard), from
    /metrics openrl_rank_run_state_bytes (world size > 1 only)."""
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("openrl_rank_run_state_bytes{"):
            rank = int(line.split('rank="')[1].split('"')[0])
            out[rank] = int(float(line.split()[-1]))
    return [out[r] for r in sorted(out)]


def greedy_tp(model: str, tp: int, data: Path, devices: list[str]) -> list[list[int]]:
    """Greedy samples of a fixed LoRA adapter from vLLM at TP ``tp`` (a served copy, --vllm-tp)."""
    import tinker
    from tinker import types

    served = Served(data, model, 1, ["--sampler", "vllm", "--vllm-tp", str(tp)], {})
    try:
        sc = tinker.ServiceClient(base_url=served.url, api_key=KEY)
        name = sc.get_server_capabilities().supported_models[0].model_name
        tc = sc.create_lora_training_client(base_model=name, rank=8, seed=0)
        tok = tc.get_tokenizer()
        for k in range(3):
            tc.forward_backward([datum(TEXT[k], tok)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = tc.save_weights_and_get_sampling_client()
        greedy = types.SamplingParams(max_tokens=32, temperature=0.0)
        out = []
        for text in TEXT[:4]:
            prompt = types.ModelInput.from_ints(tok.encode(text.decode())[:32])
            out.append(list(sampler.sample(prompt, 1, greedy).result().sequences[0].tokens))
        return out
    finally:
        served.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", default="scale-30m")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--gpus", type=int, default=0, help="CUDA GPUs (NCCL): world size = this")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    world = a.gpus or a.world
    extra = ["--devices", ",".join(f"cuda:{i}" for i in range(world))] if a.gpus else []
    root = Path(tempfile.mkdtemp(prefix="openrl-bench-devices-"))
    results: dict = {}
    try:
        for w in (1, world):
            data = root / f"world{w}"
            data.mkdir()
            served = Served(data, a.model, w, extra if w > 1 else [], {"OPENRL_FUSION": "off"})
            try:
                results[w] = {"lora": run(served, 8, a.steps), "full": run(served, 0, a.steps)}
            finally:
                served.stop()
        print(f"\nSeveral devices: {a.model}, {a.steps} steps of 4 sequences, world 1 vs world {world}")
        print(f"{'run':<6} {'s/step w1':>10} {'s/step wN':>10} {'ratio':>6} {'max rel loss diff':>18}")
        for kind in ("lora", "full"):
            one, many = results[1][kind], results[world][kind]
            diff = max(
                abs(x - y) / max(abs(x), 1e-9) for x, y in zip(one["losses"], many["losses"], strict=True)
            )
            print(
                f"{kind:<6} {one['s_per_step']:>10.3f} {many['s_per_step']:>10.3f} "
                f"{many['s_per_step'] / one['s_per_step']:>6.2f} {diff:>18.2e}"
            )
        mib = 1 << 20
        held = results[world]["full"]["state_bytes"]
        whole = sum(held)
        print(
            f"\na full run's state (weights, gradients, AdamW) per rank at world {world}: "
            + ", ".join(f"{x / mib:.0f} MiB ({x / whole:.2f})" for x in held)
            + f" of {whole / mib:.0f} MiB, all of which one device holds at world 1"
        )
        one = results[1]["full"]["added_rss"][0]
        per = results[world]["full"]["added_rss"]
        print(
            f"resident memory a full run added (RSS, the allocator keeps what FSDP's all-gathers freed): "
            f"world 1 {one / mib:.0f} MiB; world {world} per rank "
            + ", ".join(f"{x / mib:.0f} MiB" for x in per)
        )
        if a.gpus > 1 and shutil.which("nvidia-smi"):
            try:
                import vllm  # noqa: F401

                tp1 = greedy_tp(a.model, 1, root / "tp1", [])
                tpn = greedy_tp(a.model, a.gpus, root / f"tp{a.gpus}", [])
                same = sum(
                    x == y for s1, sn in zip(tp1, tpn, strict=True) for x, y in zip(s1, sn, strict=False)
                )
                total = sum(len(s) for s in tp1)
                print(f"\nvLLM greedy, the same adapter: TP 1 vs TP {a.gpus}: {same}/{total} tokens agree")
                results["tp"] = {"agree": same, "total": total}
            except ImportError:
                print("\nvLLM not installed: the TP 1 vs TP N comparison is skipped")
        if a.json:
            a.json.write_text(json.dumps(results, indent=1, default=str))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
