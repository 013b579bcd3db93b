"""Packing: N concurrent RL runs keep one service's engine busy while each run scores its rewards.

Measured: for N = 1..4 concurrent runs against one service (openrl/tiny on this machine), the
engine's duty cycle, aggregate steps/s and tokens/s relative to N = 1, the bound min(N, 1/f)
(f: the solo duty), the per-run slowdown and Jain fairness; the same total work run strictly one
run after another (the classic sequential loop); and ``fused``, the fused cross-run training step's
speed over the same datums run per run in turn (3 runs × 8 sequences, in-process, ``bench/fused.py``).

Method.

1. One ``openrl-service serve`` child (tiny model, a temporary data dir, a free loopback port, no
   keys; ``--fusion on|off`` sets ``OPENRL_FUSION`` for it, unset leaves the service's default). It
   is stopped at the end, also on Ctrl-C or a failure, as are the clients.
2. Every RL run is its own client process (this script with ``--client``, the native
   ``openrl_jupyter.client.Client``): create a run, warm up, report ready, wait for a common start
   time, then ``--steps`` steps of sample (``--prompts`` prompts × ``--group`` completions of exactly
   ``--max-tokens`` tokens) → the reward stage (sleep ``reward_s``, then the fraction of letters
   per completion) → group-relative advantages → ``train_step`` (importance sampling + AdamW). It
   prints its per-step wall-clock times and token counts as JSON.
3. Calibration: one run with no reward stage; its device time per step is the time the engine
   spent executing its ops (the service's op record, per step). ``reward_s`` defaults to twice that,
   so the solo duty is f ≈ 1/3 and the bound for N = 3 is 3.0 (``--reward-s`` overrides).
4. For each N, N clients start together (in phase: all sample at once), so each run's first
   ``--ramp`` step (default 1) is not measured. A run's rate is its measured steps over the time
   they took; aggregate steps/s and tokens/s (sampled + trained) are the sums over the runs. The
   window is the interval in which every run was in its measured steps (the latest first measured
   step's start to the earliest last step's end). Duty: the fraction of the window the engine was
   executing an op: the union of the op intervals of the runs' sessions (Tinker's
   ``sessions/{id}/trace_export``, the service's op record), cross-checked against the
   ``openrl_engine_busy_seconds`` counter of ``/metrics`` over the whole phase. f is the duty at
   N = 1; speedup = aggregate steps/s ÷ that of N = 1; slowdown = mean per-run step time ÷ the solo
   step time; fairness = Jain's index of the runs' steps/s. A speedup above the bound is labelled a
   batching gain (more work per engine-second than one run alone gets): speedup = duty ratio ×
   engine efficiency (solo engine seconds per step ÷ these), and the ``/metrics`` fused-call
   counters give the share of the phase's ops that ran inside a fused call.
5. Sequential: ``--seq-runs`` runs (default: the headline N), one after another, each the same
   steps as above; its aggregate is the measured steps over the sum of the runs' measured times
   (expected ≈ 1× N = 1); duty over those times.
6. ``fused``: after the service stops, ``bench/fused.py``'s training comparison in this process.

Another model, a GPU (``bench/gpu_check.sh`` runs this on a lent GPU machine): ``--model PATH`` serves
a Hugging Face model folder instead of the tiny model (``openrl-service serve --model PATH``) and the
``fused`` measure loads the same folder; ``--device cuda|cpu`` is passed to the service and to
``fused``. When the service's device is a CUDA GPU and ``pynvml`` (nvidia-ml-py) can read it, a
thread in this process polls NVML's utilisation and memory at ~10 Hz during every phase: the table
gains a column "GPU util (NVML)" (mean / max over the phase) and each row of the JSON a
``gpu_util_nvml`` object. That is NVML's share of time a kernel ran, never the engine's busy
fraction (``duty``). Without a GPU the output is as before.

Not a test: it prints a table, writes ``bench/results/packing.json`` and ends with one line
``packing: runs=3 duty=… speedup=… bound=… slowdown=… fairness=… fused=…``; the targets (CPU, tiny
model, N = 3: duty ≥ 0.95, speedup ≥ 0.9 × bound, slowdown ≤ 1.2 × max(1, N·f), fairness ≥ 0.95,
fused ≥ 1.5) are reported, never asserted. Timings on a shared machine are noisy: the script
measures the CPU other processes used during each phase and says when it was not idle.

    python bench/packing.py [--short] [--runs 1 2 3 4] [--steps 40] [--reward-s S] [--fusion on|off]
                            [--torch-threads T] [--prompts 8] [--group 4] [--max-tokens 32]
                            [--seq-runs 3] [--model PATH] [--device cuda|cpu]
                            [--out bench/results/packing.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADLINE_N = 3
PROMPTS = (
    "Say hi:",
    "Name a colour:",
    "Count to three:",
    "A fruit:",
    "Spell cat:",
    "Hello,",
    "Write a word:",
    "A city you like:",
)
TARGETS = {"duty": 0.95, "speedup_of_bound": 0.9, "slowdown_factor": 1.2, "fairness": 0.95, "fused": 1.5}


# -- the client process ------------------------------------------------------------------------
def emit(msg: dict) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def letters(text: str) -> float:
    """The reward: the fraction of letters in a completion (trivial, but computed on the text)."""
    return sum(c.isalpha() for c in text) / max(1, len(text))


def client_main(cfg: dict) -> int:
    """One RL run: create, warm up, report ready, wait for the start time, run, report the timings."""
    from openrl_jupyter.client import Client

    prompts = list(PROMPTS[: cfg["prompts"]])
    with Client(cfg["url"], timeout_s=600.0) as c:
        run = c.create_run(name=cfg["name"], seed=cfg["seed"], rank=cfg["rank"])
        rid = run["run_id"]

        def step(i: int, reward_s: float) -> dict:
            t0 = time.time()
            out = c.sample(
                rid,
                prompts,
                num_samples=cfg["group"],
                max_tokens=cfg["max_tokens"],
                temperature=1.0,
                stop=[],  # no stop token: every completion has exactly max_tokens tokens (constant work)
                seed=10_000 * cfg["seed"] + 1_000 + i,  # warm-up steps have i < 0
                chat=False,
            )
            t1 = time.time()
            time.sleep(reward_s)  # the reward stage's wait (a judge, a test suite, an API)
            samples = out["samples"]
            rewards = [letters(s["text"]) for s in samples]
            groups: dict[int, list[float]] = {}
            for s, r in zip(samples, rewards, strict=True):
                groups.setdefault(s["prompt_index"], []).append(r)
            means = {k: sum(v) / len(v) for k, v in groups.items()}
            batch = [
                {"sample_id": s["sample_id"], "advantage": r - means[s["prompt_index"]]}
                for s, r in zip(samples, rewards, strict=True)
            ]
            t2 = time.time()
            tr = c.train_step(rid, batch, optimizer={"learning_rate": cfg["lr"]})
            t3 = time.time()
            return {
                "start": t0,
                "sampled": t1,
                "rewarded": t2,
                "end": t3,
                "sampled_tokens": sum(len(s["tokens"]) for s in samples),
                "trained_tokens": int(tr["tokens"]),
                "reward": sum(rewards) / len(rewards),
            }

        for w in range(cfg["warmup"]):
            step(-1 - w, 0.0)
        emit({"ready": rid})
        line = sys.stdin.readline()
        if not line:
            return 1  # the parent went away before the start
        time.sleep(max(0.0, json.loads(line)["start"] - time.time()))
        steps = [step(i, cfg["reward_s"]) for i in range(cfg["steps"])]
        emit({"run_id": rid, "name": cfg["name"], "steps": steps})
    return 0


# -- the parent: service, clients, measurements ------------------------------------------------
class BenchError(RuntimeError):
    pass


class Service:
    """``openrl-service serve`` as a child on a free loopback port (``openrl_jupyter.local``), no keys."""

    def __init__(
        self,
        data_dir: Path,
        fusion: str | None,
        torch_threads: int | None = None,
        model: str | None = None,
        device: str | None = None,
    ):
        import httpx

        from openrl_jupyter.local import start_service

        env = {}
        if fusion is not None:
            env["OPENRL_FUSION"] = fusion
        if torch_threads is not None:
            env["OPENRL_TORCH_THREADS"] = str(torch_threads)
        self.env_fusion = env.get("OPENRL_FUSION", os.environ.get("OPENRL_FUSION"))
        self.env_threads = env.get("OPENRL_TORCH_THREADS", os.environ.get("OPENRL_TORCH_THREADS"))
        extra = (["--model", model] if model else []) + (["--device", device] if device else [])
        try:
            self.local = start_service(data_dir=data_dir / "service", auth=False, args=extra, env=env)
        except Exception as exc:  # noqa: BLE001 - the bench reports it as its own error
            raise BenchError(str(exc)) from None
        self.process = self.local.process
        self.url = self.local.url
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def wait_ready(self) -> dict:
        """The service's /readyz (it is ready once constructed)."""
        return self.http.get("/readyz").json()

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.local.log_tail(20_000).splitlines()[-n:])

    def counters(self) -> dict[str, float | None]:
        """Cumulative /metrics counters: engine busy seconds, fused calls and the ops inside them
        (None where this service does not expose one)."""
        text = self.http.get("/metrics").text
        out: dict[str, float | None] = {}
        for key, name in (
            ("busy_s", "openrl_engine_busy_seconds"),
            ("fused_ops", "openrl_fused_ops"),
            ("fused_members", "openrl_fused_members"),
        ):
            m = re.search(rf"^{name}(?:_total)? ([0-9.eE+-]+)$", text, re.M)
            out[key] = float(m.group(1)) if m else None
        return out

    def op_intervals(self, run_ids: set[str]) -> dict[str, list[tuple[float, float, str]]]:
        """Each run's executed ops (start, end, kind) from its session's trace export."""
        sessions = self.http.get("/api/v1/sessions", params={"limit": 1000}).json()["sessions"]
        out: dict[str, list[tuple[float, float, str]]] = {r: [] for r in run_ids}
        for sid in sessions:
            info = self.http.get(f"/api/v1/sessions/{sid}").json()
            if not run_ids & set(info["training_run_ids"]):
                continue
            url = self.http.get(f"/api/v1/sessions/{sid}/trace_export").json()["url"]
            for ev in self.http.get(url).json()["traceEvents"]:
                if ev["tid"] in out:
                    start = ev["ts"] / 1e6
                    out[ev["tid"]].append((start, start + ev["dur"] / 1e6, ev["name"]))
        missing = [r for r, ops in out.items() if not ops]
        if missing:
            raise BenchError(f"no ops recorded for runs {missing} (trace export)")
        return out

    def delete_runs(self, run_ids) -> None:
        for rid in run_ids:
            self.http.delete(f"/openrl/v1/runs/{rid}")

    def stop(self) -> None:
        self.http.close()
        self.local.stop(15)


class Clients:
    """Client processes with a reader thread each: their JSON lines arrive on one queue. Each is
    ``script --client CFG`` (this file by default; bench/load.py passes its own)."""

    def __init__(self, script: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.script = script or Path(__file__).resolve()
        self.env = {**os.environ, **env} if env else None
        self.procs: list[subprocess.Popen] = []
        self.lines: queue.Queue = queue.Queue()

    def spawn(self, cfg: dict) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, str(self.script), "--client", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=self.env,
        )
        self.procs.append(proc)

        def read() -> None:
            for line in proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue  # not a protocol line
                if isinstance(msg, dict):
                    self.lines.put((proc, msg))
            self.lines.put((proc, None))  # EOF

        threading.Thread(target=read, daemon=True).start()
        return proc

    def collect(self, procs: list[subprocess.Popen], key: str, timeout_s: float) -> list[dict]:
        """One message with ``key`` from each of ``procs``, in their order."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(procs):
            try:
                proc, msg = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"clients did not report {key!r} within {timeout_s:.0f} s") from None
            if proc not in procs:
                continue
            if msg is None:
                if id(proc) not in got:
                    raise BenchError(f"a client exited ({proc.wait()}) before reporting {key!r}")
                continue
            if key in msg:
                got[id(proc)] = msg
        return [got[id(p)] for p in procs]

    def start(self, procs: list[subprocess.Popen], delay_s: float = 0.3) -> float:
        start = time.time() + delay_s
        for p in procs:
            p.stdin.write(json.dumps({"start": start}) + "\n")
            p.stdin.close()
        return start

    def reap(self, procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
        for p in procs:
            rc = p.wait(timeout_s)
            if rc != 0:
                raise BenchError(f"a client exited with {rc}")

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


class NvmlSampler:
    """GPU utilisation and memory from NVML (``pynvml``, nvidia-ml-py), polled by a thread in this
    process every ``period_s`` during a phase. ``available`` is False without pynvml, a driver or
    that GPU; then ``start``/``stop`` do nothing and return None. The figure is NVML's utilisation
    (the share of its sample period in which a kernel ran on the GPU, as nvidia-smi shows), labelled
    "GPU util (NVML)"; it is never the engine's busy fraction (``duty``)."""

    LABEL = "GPU util (NVML)"

    def __init__(self, index: int = 0, period_s: float = 0.1):
        self.index = index
        self.period_s = period_s
        self.info: dict | None = None
        self._nvml = None
        self._handle = None
        self._samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
            mem = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
            self.info = {
                "index": index,
                "name": str(pynvml.nvmlDeviceGetName(self._handle)),
                "driver": str(pynvml.nvmlSystemGetDriverVersion()),
                "memory_total_bytes": int(mem.total),
            }
        except Exception:  # noqa: BLE001 - no library, no driver or no such GPU: NVML is absent
            self._handle = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _read(self) -> tuple[float, float, int] | None:
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception:  # noqa: BLE001 - a transient NVML error: skip this sample
            return None
        return time.time(), util.gpu / 100.0, int(mem.used)

    def _loop(self) -> None:
        while True:
            sample = self._read()
            if sample is not None:
                self._samples.append(sample)
            if self._stop.wait(self.period_s):
                return

    def start(self) -> None:
        if not self.available:
            return
        self._samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> list[tuple[float, float, int]]:
        """The phase's samples: (time, utilisation 0-1, memory used bytes)."""
        if self._thread is None:
            return []
        self._stop.set()
        self._thread.join(5)
        self._thread = None
        return list(self._samples)

    def summary(self, samples: list[tuple[float, float, int]], windows: list[tuple[float, float]]) -> dict:
        """Mean / max utilisation within the measured windows (what duty covers) and over the whole
        phase (client start-up and warm-up included), peak memory used."""

        def stats(sel: list[tuple[float, float, int]]) -> dict:
            utils = [u for _, u, _ in sel]
            return {
                "samples": len(sel),
                "util_mean": statistics.mean(utils) if utils else None,
                "util_max": max(utils) if utils else None,
                "memory_used_max_bytes": max((m for _, _, m in sel), default=None),
            }

        inside = [x for x in samples if any(a <= x[0] <= b for a, b in windows)]
        return {
            "label": self.LABEL,
            "device": self.info["name"] if self.info else None,
            "period_s": self.period_s,
            "memory_total_bytes": self.info["memory_total_bytes"] if self.info else None,
            "window": stats(inside),
            "phase": stats(samples),
        }

    def close(self) -> None:
        if self._thread is not None:
            self.stop()
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass


def nvml_for(device: str | None) -> NvmlSampler | None:
    """The sampler for the service's torch device ("cuda", "cuda:1"); None for any other device."""
    if not device or not device.startswith("cuda"):
        return None
    sampler = NvmlSampler(int(device.split(":")[1]) if ":" in device else 0)
    return sampler if sampler.available else None


class CpuMeter:
    """Cores busy during a phase: this benchmark's processes (this one, its children, the service)
    and everything else on the machine, from /proc (Linux; None elsewhere)."""

    def __init__(self, service_pid: int):
        self.service_pid = service_pid
        self.cores = os.cpu_count() or 1
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def snapshot(self) -> tuple[float, float, float] | None:
        import resource

        try:
            with open("/proc/stat") as f:
                cpu = [int(v) for v in f.readline().split()[1:]]
            with open(f"/proc/{self.service_pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            service = (int(fields[11]) + int(fields[12])) / self.tick
        except (OSError, ValueError, IndexError):
            return None
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped clients
        me = resource.getrusage(resource.RUSAGE_SELF)
        ours = service + kids.ru_utime + kids.ru_stime + me.ru_utime + me.ru_stime
        idle = cpu[3] + cpu[4]
        return sum(cpu) / self.tick, (sum(cpu) - idle) / self.tick, ours

    def cores_used(self, a, b) -> dict[str, float] | None:
        if a is None or b is None or b[0] <= a[0]:
            return None
        wall = (b[0] - a[0]) / self.cores
        ours = (b[2] - a[2]) / wall
        return {"ours": ours, "others": max(0.0, (b[1] - a[1]) / wall - ours)}


def union_within(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the union of the intervals."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else 1.0


class Bench:
    def __init__(
        self,
        args: argparse.Namespace,
        service: Service,
        clients: Clients,
        nvml: NvmlSampler | None = None,
    ):
        self.args = args
        self.service = service
        self.clients = clients
        self.meter = CpuMeter(service.process.pid)
        self.nvml = nvml  # None: no GPU (or no NVML); the rows then have no gpu_util_nvml
        self.serial = 0

    def cfg(self, i: int, steps: int, reward_s: float, warmup: int) -> dict:
        self.serial += 1
        a = self.args
        return {
            "url": self.service.url,
            "name": f"packing-{self.serial}",
            "seed": i,
            "rank": a.rank,
            "prompts": a.prompts,
            "group": a.group,
            "max_tokens": a.max_tokens,
            "lr": a.lr,
            "steps": steps,
            "warmup": warmup,
            "reward_s": reward_s,
        }

    def phase(self, n: int, steps: int, reward_s: float, sequential: bool = False, ramp: int = 0) -> dict:
        """N runs together (or one after another), their client reports and the engine's op record;
        each run's first ``ramp`` steps after the common start are not measured."""
        timeout = 120.0 + steps * n * (reward_s + 10.0)
        c0, cpu0, t0 = self.service.counters(), self.meter.snapshot(), time.time()
        if self.nvml is not None:
            self.nvml.start()
        reports, starts = [], []
        groups = [[i] for i in range(n)] if sequential else [list(range(n))]
        for group in groups:
            procs = [self.clients.spawn(self.cfg(i, steps, reward_s, self.args.warmup)) for i in group]
            self.clients.collect(procs, "ready", 300.0)
            start = self.clients.start(procs)
            reports += self.clients.collect(procs, "steps", timeout)
            starts += [start] * len(procs)
            self.clients.reap(procs)
        c1, cpu1, t1 = self.service.counters(), self.meter.snapshot(), time.time()
        gpu_samples = self.nvml.stop() if self.nvml is not None else []
        delta = {k: c1[k] - c0[k] if c0[k] is not None and c1[k] is not None else None for k in c0}
        run_ids = {r["run_id"] for r in reports}
        ops = self.service.op_intervals(run_ids)
        self.service.delete_runs(run_ids)
        all_ops = [(a, b) for v in ops.values() for a, b, _ in v]
        trace_busy = union_within(all_ops, t0, t1)
        metrics_busy = delta["busy_s"]

        runs = []
        for rep, start in zip(reports, starts, strict=True):
            st = rep["steps"]
            measured = st[ramp:]  # the first `ramp` steps after the start are the ramp-up
            begin, end = measured[0]["start"], measured[-1]["end"]
            mine = [(a, b) for a, b, _ in ops[rep["run_id"]]]
            device = [union_within(mine, s["start"], s["end"]) for s in measured]
            tokens = sum(s["sampled_tokens"] + s["trained_tokens"] for s in measured)
            runs.append(
                {
                    "run_id": rep["run_id"],
                    "start": start,
                    "begin": begin,
                    "end": end,
                    "elapsed_s": end - start,
                    "steps": len(st),
                    "measured_steps": len(measured),
                    "measured_s": end - begin,
                    "steps_per_s": len(measured) / (end - begin),
                    "step_s": (end - begin) / len(measured),
                    "tokens": tokens,
                    "tokens_per_s": tokens / (end - begin),
                    "device_s_per_step": sum(device) / len(device),
                    "device_s_per_step_median": statistics.median(device),
                    "sample_s_mean": statistics.mean(s["sampled"] - s["start"] for s in measured),
                    "train_s_mean": statistics.mean(s["end"] - s["rewarded"] for s in measured),
                    "reward_first": st[0]["reward"],
                    "reward_last": st[-1]["reward"],
                }
            )
        if sequential:
            windows = [(r["begin"], r["end"]) for r in runs]
            window_s = sum(b - a for a, b in windows)
            busy = sum(union_within(all_ops, a, b) for a, b in windows)
            steps_per_s = sum(r["measured_steps"] for r in runs) / window_s
            tokens_per_s = sum(r["tokens"] for r in runs) / window_s
        else:
            lo, hi = max(r["begin"] for r in runs), min(r["end"] for r in runs)
            if hi <= lo:
                raise BenchError(f"N={n}: no interval with all runs measured; use more --steps")
            window_s = hi - lo
            busy = union_within(all_ops, lo, hi)
            steps_per_s = sum(r["steps_per_s"] for r in runs)
            tokens_per_s = sum(r["tokens_per_s"] for r in runs)
            for r in runs:
                mine = [(a, b) for a, b, _ in ops[r["run_id"]]]
                r["engine_share"] = union_within(mine, lo, hi) / max(busy, 1e-9)
        row = {
            "n": n,
            "sequential": sequential,
            "reward_s": reward_s,
            "ramp_steps": ramp,
            "window_s": window_s,
            "busy_s": busy,
            "duty": busy / window_s,
            "steps_per_s": steps_per_s,
            "tokens_per_s": tokens_per_s,
            "step_s": statistics.mean(r["step_s"] for r in runs),
            "fairness": jain([r["steps_per_s"] for r in runs]),
            "device_s_per_step": statistics.mean(r["device_s_per_step"] for r in runs),
            "phase_s": t1 - t0,
            "busy_check": {
                "trace_union_s": trace_busy,
                "metrics_s": metrics_busy,
                "ratio": metrics_busy / trace_busy if metrics_busy is not None and trace_busy else None,
            },
            "fused_calls": delta["fused_ops"],  # over the whole phase (warm-up included)
            "fused_members": delta["fused_members"],
            "ops": len(all_ops),
            "fused_fraction": (delta["fused_members"] or 0) / max(1, len(all_ops)),
            "cores_busy": self.meter.cores_used(cpu0, cpu1),
            "runs": runs,
        }
        if self.nvml is not None:
            windows = (
                [(r["begin"], r["end"]) for r in runs]
                if sequential
                else [(max(r["begin"] for r in runs), min(r["end"] for r in runs))]
            )
            row["gpu_util_nvml"] = self.nvml.summary(gpu_samples, windows)
        return row


def gpu_note(row: dict) -> str:
    """The progress line's NVML part (", GPU util (NVML) x% / y% (mean / max)"); "" without NVML."""
    if "gpu_util_nvml" not in row:
        return ""
    return f", {NvmlSampler.LABEL} {gpu_cell(row)} (mean / max)"


def gpu_facts(nvml: NvmlSampler | None, device: str | None) -> dict | None:
    """The GPU the service ran on (NVML and torch's view); None when it ran on no CUDA device."""
    if not device or not device.startswith("cuda"):
        return None
    import torch

    facts: dict = dict(nvml.info) if nvml is not None and nvml.info else {}
    if torch.cuda.is_available():
        index = int(device.split(":")[1]) if ":" in device else 0
        props = torch.cuda.get_device_properties(index)
        facts |= {
            "torch_name": props.name,
            "torch_memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "cuda": torch.version.cuda,
        }
    return facts or None


def relative(row: dict, solo: dict, f: float) -> None:
    """Add the ratios to N = 1 (in place)."""
    n = 1 if row["sequential"] else row["n"]
    row["speedup"] = row["steps_per_s"] / solo["steps_per_s"]
    row["tokens_speedup"] = row["tokens_per_s"] / solo["tokens_per_s"]
    row["bound"] = min(n, 1.0 / f) if f > 0 else float(n)
    row["slowdown"] = row["step_s"] / solo["step_s"]
    row["batching_gain"] = row["speedup"] > row["bound"]
    # speedup = duty ratio x engine efficiency (solo engine seconds per step / these): the second
    # factor is above 1 when a step costs the engine less than alone (batching), below when more
    row["duty_ratio"] = row["duty"] / solo["duty"]
    row["engine_efficiency"] = solo["device_s_per_step"] / row["device_s_per_step"]


def gpu_cell(row: dict) -> str:
    """The "GPU util (NVML)" cell: mean / max within the measured window(s)."""
    w = row.get("gpu_util_nvml", {}).get("window", {})
    if w.get("util_mean") is None:
        return "-"
    return f"{w['util_mean']:.0%} / {w['util_max']:.0%}"


def print_table(
    rows: list[dict], args, calib: dict, reward_s: float, f: float, model: str = "openrl/tiny"
) -> None:
    src = "--reward-s" if args.reward_s is not None else f"2 x solo device {calib['device_s']:.3f} s/step"
    gpu = any("gpu_util_nvml" in r for r in rows)  # a column only when NVML read a GPU
    print(
        f"\nconcurrent RL runs on {model}, {args.prompts} prompts x {args.group} completions x {args.max_tokens} "
        f"tokens per step, reward stage {reward_s:.3f} s ({src}), {args.steps} steps per run, "
        f"solo duty f={f:.3f}"
    )
    head = (
        f"{'runs':>6} {'duty':>5} {'steps/s':>8} {'speedup':>8} {'tok/s':>8} {'tok x':>6} {'bound':>6} "
        f"{'slowdown':>9} {'fairness':>9} {'dev s/step':>10} {'dev eff':>8} {'fused':>6} {'window s':>9}"
        + (f" {NvmlSampler.LABEL:>16}" if gpu else "")
        + "  note"
    )
    print(head)
    for r in rows:
        name = f"seq {r['n']}" if r["sequential"] else str(r["n"])
        notes = ["sequential loop"] if r["sequential"] else (["batching gain"] if r["batching_gain"] else [])
        if r["batching_gain"] and not r["fused_calls"]:
            notes.append("(no op ran fused: noise?)")
        cores = r.get("cores_busy")
        if cores and cores["others"] > 0.2:
            notes.append(f"(other processes: {cores['others']:.2f} cores)")
        note = " ".join(notes)
        print(
            f"{name:>6} {r['duty']:>5.2f} {r['steps_per_s']:>8.3f} {r['speedup']:>7.2f}x "
            f"{r['tokens_per_s']:>8.0f} {r['tokens_speedup']:>5.2f}x {r['bound']:>6.2f} "
            f"{r['slowdown']:>8.2f}x {r['fairness']:>9.3f} {r['device_s_per_step']:>10.3f} "
            f"{r['engine_efficiency']:>7.2f}x {r['fused_fraction']:>6.0%} "
            f"{r['window_s']:>9.1f}" + (f" {gpu_cell(r):>16}" if gpu else "") + f"  {note}".rstrip()
        )
    print(
        "dev s/step: engine seconds per step of a run (a fused call's time is shared by tokens); dev eff: "
        "solo dev s/step / this; fused: share of the phase's ops that ran inside a fused call"
    )
    if gpu:
        print(
            f"{NvmlSampler.LABEL}: mean / max of NVML's utilisation (share of time a kernel ran on the GPU), "
            "polled at 10 Hz within the measured window; not the engine busy fraction (duty)"
        )
    seq = next((r for r in rows if r["sequential"]), None)
    same = next((r for r in rows if seq and not r["sequential"] and r["n"] == seq["n"]), None)
    if seq and same:
        together = max(r["elapsed_s"] for r in same["runs"])
        one_by_one = sum(r["elapsed_s"] for r in seq["runs"])
        print(
            f"the same work ({seq['n']} runs x {args.steps} steps): together {together:.1f} s, "
            f"one after another {one_by_one:.1f} s ({one_by_one / together:.2f}x)"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="CI mode: N = 1 and 3, few steps (~1 min)")
    p.add_argument("--runs", type=int, nargs="+", default=None, help="the N to measure (default 1 2 3 4)")
    p.add_argument(
        "--steps", type=int, default=None, help="steps per run after the start (default 40; short 8)"
    )
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per run before the start")
    p.add_argument(
        "--ramp", type=int, default=1, help="unmeasured steps per run after the start (runs start in phase)"
    )
    p.add_argument("--calib-steps", type=int, default=None, help="calibration steps (default 6; short 3)")
    p.add_argument(
        "--reward-s", type=float, default=None, help="reward stage seconds (default 2 x solo device)"
    )
    p.add_argument("--prompts", type=int, default=8, help=f"prompts per step (at most {len(PROMPTS)})")
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (exactly: no stop)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seq-runs", type=int, default=HEADLINE_N, help="runs in the sequential loop (0: none)")
    p.add_argument("--fusion", choices=("on", "off"), default=None, help="OPENRL_FUSION for the service")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="OPENRL_TORCH_THREADS for the service (default: torch's)",
    )
    p.add_argument(
        "--fused-repeats", type=int, default=None, help="fused comparison repeats (default 5; short 3)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model folder to serve and to measure fused on (default: the tiny model)",
    )
    p.add_argument("--device", default=None, help="the service's and fused's device (default: the best)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "packing.json"))
    p.add_argument("--client", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.runs is None:
        args.runs = [1, HEADLINE_N] if args.short else [1, 2, 3, 4]
    if args.steps is None:
        args.steps = 8 if args.short else 40
    if args.calib_steps is None:
        args.calib_steps = 3 if args.short else 6
    if args.fused_repeats is None:
        args.fused_repeats = 3 if args.short else 5
    if args.steps < args.ramp + 2:
        p.error("--steps must exceed --ramp by at least 2")
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be in [1, {len(PROMPTS)}]")
    args.runs = sorted(set(args.runs) | {1})  # N = 1 is the reference of every ratio
    if args.model and args.model != "tiny" and not args.model.endswith(".gguf"):
        args.model = str(Path(args.model).expanduser().resolve())  # the service runs in ROOT
    return args


def bench_main(name: str, args: argparse.Namespace, client, parent) -> int:
    """A client process (``--client CFG``: ``client(cfg)``) or the parent (``parent(args)``), which
    takes SIGTERM as Ctrl-C so that its ``finally`` blocks stop the service and the clients."""
    if args.client:
        try:
            return client(json.loads(args.client))
        except KeyboardInterrupt:
            return 130

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        return parent(args)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; the service and the clients were stopped", file=sys.stderr)
        return 130
    except BenchError as e:
        print(f"{name}: failed: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    return bench_main("packing", parse_args(argv), client_main, run)


def run(args: argparse.Namespace) -> int:
    t_begin = time.time()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    clients = Clients()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="openrl-packing-") as tmp:
        service = Service(Path(tmp), args.fusion, args.torch_threads, model=args.model, device=args.device)
        nvml = None
        try:
            ready = service.wait_ready()
            nvml = nvml_for(ready.get("device"))
            bench = Bench(args, service, clients, nvml)
            print(
                f"service ready on {service.url} ({ready.get('model')}, {ready.get('device')}; "
                f"fusion {'on' if ready.get('fusion') else 'off'}) after {time.time() - t_begin:.1f} s",
                flush=True,
            )
            cal = bench.phase(1, args.calib_steps, 0.0)
            calib = {
                "steps": args.calib_steps,
                "device_s": cal["runs"][0]["device_s_per_step_median"],
                "device_s_mean": cal["device_s_per_step"],
                "step_s": cal["step_s"],
                "duty": cal["duty"],
            }
            if "gpu_util_nvml" in cal:
                calib["gpu_util_nvml"] = cal["gpu_util_nvml"]
            reward_s = args.reward_s if args.reward_s is not None else 2.0 * calib["device_s"]
            print(
                f"calibration: solo device {calib['device_s']:.3f} s/step (step {calib['step_s']:.3f} s "
                f"with no reward stage) -> reward stage {reward_s:.3f} s",
                flush=True,
            )
            for n in args.runs:
                rows.append(bench.phase(n, args.steps, reward_s, ramp=args.ramp))
                print(
                    f"  N={n}: duty {rows[-1]['duty']:.2f}, {rows[-1]['steps_per_s']:.3f} steps/s "
                    f"({rows[-1]['phase_s']:.0f} s)" + gpu_note(rows[-1]),
                    flush=True,
                )
            if args.seq_runs > 0:
                rows.append(bench.phase(args.seq_runs, args.steps, reward_s, sequential=True, ramp=args.ramp))
                print(
                    f"  sequential {args.seq_runs}: duty {rows[-1]['duty']:.2f}, "
                    f"{rows[-1]['steps_per_s']:.3f} steps/s ({rows[-1]['phase_s']:.0f} s)"
                    + gpu_note(rows[-1]),
                    flush=True,
                )
        except Exception:
            tail = service.log_tail()
            if tail:
                print(f"service log (last lines):\n{tail}", file=sys.stderr)
            raise
        finally:
            clients.stop_all()
            service.stop()
            if nvml is not None:
                nvml.close()

    print(f"fused training step: 3 runs x 8 sequences, median of {args.fused_repeats} ...", flush=True)
    sys.path.insert(0, str(ROOT / "bench"))
    from fused import measure_train  # torch only here, after the service stopped

    fused = measure_train(
        runs=3, seqs=8, tokens=64, repeats=args.fused_repeats, model=args.model or "tiny", device=args.device
    )
    import torch

    solo = next(r for r in rows if r["n"] == 1 and not r["sequential"])
    f = solo["duty"]
    for r in rows:
        relative(r, solo, f)
    print_table(rows, args, calib, reward_s, f, model=ready.get("model") or "openrl/tiny")
    print(
        f"fused: {fused['runs']} runs x {fused['seqs']} seqs, one fused pass {fused['fused_s']:.3f} s vs "
        f"per run in turn {fused['per_run_s']:.3f} s -> {fused['speedup']:.2f}x"
    )
    checks = [r["busy_check"]["ratio"] for r in rows if r["busy_check"]["ratio"] is not None]
    if checks and max(abs(c - 1) for c in checks) > 0.05:
        print(
            "note: /metrics engine busy seconds differ from the op trace's union by up to "
            f"{max(abs(c - 1) for c in checks):.0%} (ops recorded under lanes no run session owns, or "
            "overlapping records of fused ops); duty uses the trace's union"
        )
    others = [r["cores_busy"]["others"] for r in rows if r.get("cores_busy")]
    if others and max(others) > 0.2:
        print(
            f"note: other processes used up to {max(others):.2f} cores during a phase; rerun on an idle machine"
        )

    concurrent = [r for r in rows if not r["sequential"]]
    head = next((r for r in concurrent if r["n"] == HEADLINE_N), concurrent[-1])
    nf = head["n"] * f
    targets = {
        "runs": head["n"],
        "duty": {"target": f">= {TARGETS['duty']}", "met": head["duty"] >= TARGETS["duty"]},
        "speedup": {
            "target": f">= {TARGETS['speedup_of_bound']} x bound",
            "met": head["speedup"] >= TARGETS["speedup_of_bound"] * head["bound"],
        },
        "slowdown": {
            "target": f"<= {TARGETS['slowdown_factor']} x max(1, N*f) = {TARGETS['slowdown_factor'] * max(1, nf):.2f}",
            "met": head["slowdown"] <= TARGETS["slowdown_factor"] * max(1.0, nf),
        },
        "fairness": {"target": f">= {TARGETS['fairness']}", "met": head["fairness"] >= TARGETS["fairness"]},
        "fused": {"target": f">= {TARGETS['fused']}", "met": fused["speedup"] >= TARGETS["fused"]},
    }
    values = {"duty": head["duty"], "speedup": head["speedup"], "slowdown": head["slowdown"]}
    values |= {"fairness": head["fairness"], "fused": fused["speedup"]}
    missed = [
        f"{k} ({values[k]:.3f}; {v['target']})"
        for k, v in targets.items()
        if isinstance(v, dict) and not v["met"]
    ]
    print(
        f"targets (N={head['n']}, reported, not asserted): "
        + (f"missed {', '.join(missed)}" if missed else "all met")
    )
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "mode": "short" if args.short else "full",
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "service_torch_threads": service.env_threads or "torch default",
            "platform": platform.platform(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "service": {
            "readyz": ready,
            "fusion": "on" if ready.get("fusion") else "off",  # as the service reports it (/readyz)
            "fused_calls": sum(r["fused_calls"] or 0 for r in rows),
            "fusion_flag": args.fusion,
        },
        "params": {k: v for k, v in vars(args).items() if k != "client"} | {"reward_s": reward_s},
        "reward_s_source": "given" if args.reward_s is not None else "2 x calibrated solo device s/step",
        "calibration": calib,
        "solo_duty_f": f,
        "by_n": {str(r["n"]): r for r in rows if not r["sequential"]},
        "sequential": next((r for r in rows if r["sequential"]), None),
        "fused": fused,
        "headline": {
            "runs": head["n"],
            "duty": head["duty"],
            "speedup": head["speedup"],
            "bound": head["bound"],
            "slowdown": head["slowdown"],
            "fairness": head["fairness"],
            "fused": fused["speedup"],
        },
        "targets": targets,
        "total_s": time.time() - t_begin,
    }
    gpu_info = gpu_facts(nvml, ready.get("device"))
    if gpu_info:
        result["machine"]["gpu"] = gpu_info
        result["model"] = ready.get("model")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['total_s']:.0f} s)")
    print(
        f"packing: runs={head['n']} duty={head['duty']:.2f} speedup={head['speedup']:.2f} "
        f"bound={head['bound']:.2f} slowdown={head['slowdown']:.2f} fairness={head['fairness']:.2f} "
        f"fused={fused['speedup']:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
