"""GPU check: the project's own torch code paths on a random-init Qwen2.5-0.5B-shaped model, in < 5 min.

One prepared script for a lent GPU machine (``bench/gpu_check.sh`` wraps it in a hard ``timeout``);
``--smoke`` runs every section on this CPU with tiny sizes (its figures say nothing about speed).
Sections, each with its own time budget; one failing section prints its error and the rest run:

  env        what is importable (the GPU image has torch, transformers, peft and nvidia-ml-py but
             not fastapi/uvicorn unless wheels were carried), torch and CUDA facts
  model      a random-init Qwen2 folder built from a config, no download: hidden 896, 24 layers,
             14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings (Qwen2.5-0.5B's
             shape), saved in bf16, with the tiny model's byte-level tokenizer (ids 0-255 are bytes)
  load       ``load_base_model`` of that folder (bf16 on CUDA) with LoRA injected, the Trainer, the
             torch sampler and 3 rank-8 runs (``bench/fused.py``'s ``FusedBench``)
  fused      one fused cross-run training step vs each run's step in turn (``bench/fused.py``)
  sampler    torch sampler tokens/s: 8 prompts x 8 samples x 64 tokens (no stop token), one batched
             ``TorchSampler.sample_many`` with run 0's adapter snapshot
  agreement  the torch sampler's logprobs of those sampled tokens vs the Trainer's forward logprobs of
             the same tokens (same adapter, the model's dtype: bf16 on CUDA): mean and max |delta|
  snapshot   the adapter saved as a PEFT folder and loaded back as the service loads a sampler
             snapshot (CheckpointStore + ``adapter_from_peft``; safetensors directly where the store
             cannot be imported), then PEFT's own ``PeftModel.from_pretrained`` of that folder
  packing    ``bench/packing.py`` against a served copy of the model: N = 1..3 concurrent RL runs,
             engine duty, speedup vs the bound min(N, 1/f); needs the service's packages (fastapi,
             uvicorn, ...), skipped with a line saying which are missing

NVML ticks: a thread reads the project's ``telemetry.NvmlReader`` every 0.1 s during all sections;
each section reports its tick count, utilisation mean / max and peak memory. Without NVML (``--smoke``
on a CPU) a stand-in reader of this process's CPU share feeds the same path, labelled as such.
Every sampling figure is the torch sampler's (the service's ``TorchSampler``).

Output: a table on stdout, ``gpu_check.json`` (written after every section) and ``gpu_check-packing.json``
in ``--out`` (default ``$OUT``, else ``bench/results/``). Exit 0 when no section failed (skipped ones
are fine), 1 otherwise.

    python bench/gpu_check.py [--smoke] [--device cuda|cpu] [--deadline-s 250] [--vocab 151936]
                              [--out DIR] [--only SECTION ...] [--packing-args "..."]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SAMPLER_LABEL = "torch sampler"

# (name, budget seconds on the GPU, in --smoke). The total is also capped by --deadline-s.
SECTIONS = (
    ("env", 45, 30),
    ("model", 60, 30),
    ("load", 60, 30),
    ("fused", 30, 20),
    ("sampler", 40, 20),
    ("agreement", 20, 15),
    ("snapshot", 40, 20),
    ("packing", 150, 150),
)
NEEDS_MODEL = {"load", "fused", "sampler", "agreement", "snapshot", "packing"}
NEEDS_BENCH = {"fused", "sampler", "agreement", "snapshot"}

SHAPES = {
    # Qwen2.5-0.5B's shape (vocab may be lowered with --vocab; it is stated in the output)
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ),
    "smoke": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=4096,
    ),
}
SIZES = {  # workload sizes per mode
    "gpu": dict(
        fused_seqs=8,
        fused_tokens=128,
        fused_repeats=3,
        prompts=8,
        samples=8,
        max_tokens=64,
        packing_args="--runs 1 2 3 --steps 5 --ramp 1 --warmup 1 --calib-steps 2 --seq-runs 0 "
        "--prompts 8 --group 4 --max-tokens 16 --fused-repeats 1",
    ),
    "smoke": dict(
        fused_seqs=2,
        fused_tokens=16,
        fused_repeats=1,
        prompts=2,
        samples=2,
        max_tokens=8,
        packing_args="--runs 1 2 --steps 2 --ramp 0 --warmup 0 --calib-steps 1 --seq-runs 0 "
        "--prompts 1 --group 2 --max-tokens 4 --fused-repeats 1 --torch-threads 1",
    ),
}
# Imports listed by the env section: (module, distribution). The first group is what the torch
# sections need; the second what the packing section's service and clients need.
CORE_MODULES = [
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("peft", "peft"),
    ("safetensors", "safetensors"),
    ("tokenizers", "tokenizers"),
    ("numpy", "numpy"),
    ("pynvml", "nvidia-ml-py"),
]
SERVICE_MODULES = [
    ("fastapi", "fastapi"),
    ("starlette", "starlette"),
    ("pydantic", "pydantic"),
    ("pydantic_settings", "pydantic-settings"),
    ("uvicorn", "uvicorn"),
    ("anyio", "anyio"),
    ("orjson", "orjson"),
    ("zstandard", "zstandard"),
    ("platformdirs", "platformdirs"),
    ("httpx", "httpx"),
    ("httpx_sse", "httpx-sse"),
    ("tenacity", "tenacity"),
    ("prometheus_client", "prometheus-client"),
    ("google.protobuf", "protobuf"),
]
PROJECT_MODULES = [
    "openrl_service.training.trainer",
    "openrl_service.training.lora",
    "openrl_service.sampling.torch_sampler",
    "openrl_service.telemetry",
    "openrl_service.storage.checkpoints",
    "openrl_service.engine.service",
    "openrl_service.app",
    "openrl_jupyter.client",
]
CORE_PROJECT = PROJECT_MODULES[:4]  # the torch sections cannot run without these
PACKING_NEEDS = ["openrl_service.app", "openrl_jupyter.client", "uvicorn", "httpx"]


class SectionTimeout(BaseException):  # noqa: N818 - not an Exception: a broad `except Exception` must not swallow it
    pass


class Terminated(BaseException):  # noqa: N818 - SIGTERM (the outer timeout); likewise
    pass


class Skip(Exception):
    """A section that cannot run here (a missing package, an earlier section's failure)."""


class NoTime(Exception):
    """Too little of the deadline left to start a section (counted as a failure, unlike Skip)."""


# -- NVML ticks --------------------------------------------------------------------------------
class CpuStandIn:
    """A stand-in for ``NvmlReader`` where no GPU is (``--smoke``): this process's CPU share and RSS,
    in the reader's format, so the tick path runs. Its figures are labelled and are not NVML's."""

    LABEL = "CPU stand-in (this process's CPU share; not NVML)"

    def __init__(self) -> None:
        self.available = True
        self.name = f"cpu ({os.cpu_count()} cores)"
        self._last = (time.monotonic(), time.process_time())

    def read(self) -> dict | None:
        now = (time.monotonic(), time.process_time())
        wall, cpu = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            rss = 0
        return {
            "label": self.LABEL,
            "value": min(1.0, cpu / max(wall, 1e-6) / (os.cpu_count() or 1)),
            "memory_used_bytes": rss,
            "memory_total_bytes": None,
            "device": self.name,
        }


class Ticker:
    """Reads ``reader`` every ``period_s`` on a thread; summarises the ticks inside time windows."""

    def __init__(self, reader, source: str, period_s: float = 0.1):
        self.reader = reader
        self.source = source  # "nvml" | "cpu stand-in" | "none"
        self.period_s = period_s
        self.ticks: list[tuple[float, float, int]] = []
        self.label = None
        self.device = None
        self._stop = threading.Event()
        self._thread = None
        if reader is not None:
            self._thread = threading.Thread(target=self._loop, name="gpu-check-ticks", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            r = self.reader.read()
            if r is not None:
                self.label, self.device = r["label"], r.get("device")
                self.ticks.append((time.time(), float(r["value"]), int(r.get("memory_used_bytes") or 0)))
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)

    def summary(self, t0: float, t1: float) -> dict:
        sel = [t for t in self.ticks if t0 <= t[0] <= t1]
        utils = [u for _, u, _ in sel]
        return {
            "ticks": len(sel),
            "util_mean": statistics.mean(utils) if utils else None,
            "util_max": max(utils) if utils else None,
            "memory_used_max_bytes": max((m for _, _, m in sel), default=None),
        }


def make_ticker(device: str, smoke: bool) -> Ticker:
    try:
        from openrl_service.telemetry import NvmlReader

        reader = NvmlReader.for_device(device)
    except Exception:  # noqa: BLE001 - the project not importable: reported by the env section
        reader = None
    if reader is not None and reader.available:
        return Ticker(reader, "nvml")
    if smoke:
        return Ticker(CpuStandIn(), "cpu stand-in")
    return Ticker(None, "none")


# -- the sections ------------------------------------------------------------------------------
class Check:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.smoke = args.smoke
        self.sizes = SIZES["smoke" if args.smoke else "gpu"]
        self.device = args.device
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.out = Path(args.out)
        self.results: dict[str, dict] = {}
        self.importable: dict[str, str | None] = {}  # module -> None (ok) or why not
        self.folder: Path | None = None
        self.bench = None  # FusedBench: base model, trainer, torch sampler, 3 runs
        self.sampled = None  # (jobs, outputs) of the sampler section
        self.t_begin = time.time()
        self.deadline = time.monotonic() + args.deadline_s
        self.ticker: Ticker | None = None

    # -- plumbing --------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def write(self) -> None:
        doc = {
            "what": "GPU check (bench/gpu_check.py): the project's torch code paths on a random-init "
            "Qwen2-shaped model; every sampling figure is the torch sampler's",
            "mode": "smoke" if self.smoke else "gpu",
            "meaningful_as_performance": not self.smoke,
            "device": self.device,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": platform.node(),
            "deadline_s": self.args.deadline_s,
            "elapsed_s": round(time.time() - self.t_begin, 2),
            "sampler": SAMPLER_LABEL,
            "nvml": {
                "source": self.ticker.source if self.ticker else None,
                "label": self.ticker.label if self.ticker else None,
                "device": self.ticker.device if self.ticker else None,
                "period_s": self.ticker.period_s if self.ticker else None,
                "ticks": len(self.ticker.ticks) if self.ticker else 0,
            },
            "sections": self.results,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / ".gpu_check.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, self.out / "gpu_check.json")

    def run(self) -> int:
        only = set(self.args.only or [name for name, _, _ in SECTIONS])
        try:
            for name, gpu_budget, smoke_budget in SECTIONS:
                if name not in only:
                    continue
                left = self.deadline - time.monotonic()
                budget = min(smoke_budget if self.smoke else gpu_budget, left - 3)
                self.section(name, budget)
                if name == "env":  # the ticks start once the import listing is done
                    self.ticker = make_ticker(self.device, self.smoke)
        except Terminated as e:
            for name, _, _ in SECTIONS:
                if name in only and name not in self.results:
                    self.results[name] = {"status": "not run", "error": f"stopped: {e}"}
        finally:
            if self.ticker is not None:
                self.ticker.stop()
            self.write()
        self.print_table()
        failed = [n for n, r in self.results.items() if r["status"] not in ("ok", "skipped")]
        return 1 if failed else 0

    def section(self, name: str, budget: float) -> None:
        print(f"== [{time.time() - self.t_begin:5.1f} s] {name} (budget {max(budget, 0):.0f} s)", flush=True)
        rec: dict = {"status": "ok", "budget_s": round(max(budget, 0), 1)}
        t0 = time.time()
        fn = getattr(self, f"s_{name}")
        try:
            if budget < 5:
                raise NoTime(f"not started: only {max(budget, 0):.0f} s left before the deadline")
            if name in NEEDS_MODEL and self.folder is None:
                raise Skip("no model folder (the model section did not finish)")
            if name in NEEDS_BENCH and self.bench is None:
                raise Skip("no loaded model (the load section did not finish)")
            if name != "packing":  # packing times its child process itself
                signal.setitimer(signal.ITIMER_REAL, budget)
            try:
                rec["result"] = fn(budget)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if rec["result"].pop("_status", None) == "timeout":  # a part ran out; the rest is kept
                rec.update(status="timeout", error=f"a part ran past the budget of {budget:.0f} s")
        except Skip as e:
            rec.update(status="skipped", reason=str(e))
            print(f"   {name}: SKIPPED: {e}", flush=True)
        except NoTime as e:
            rec.update(status="not run", error=str(e))
            print(f"   {name}: NOT RUN: {e}", flush=True)
        except SectionTimeout:
            rec.update(status="timeout", error=f"ran past its budget of {budget:.0f} s")
            print(f"   {name}: TIMEOUT after {budget:.0f} s (the other sections still run)", flush=True)
        except Terminated:
            rec.update(status="terminated", error="stopped by SIGTERM (the outer timeout)")
            self.results[name] = rec | {"seconds": round(time.time() - t0, 2)}
            raise
        except Exception as e:  # noqa: BLE001 - a failing section reports and the rest still run
            rec.update(status="error", error=f"{type(e).__name__}: {e}")
            print(f"   {name}: FAILED: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=6, file=sys.stdout)
        t1 = time.time()
        rec["seconds"] = round(t1 - t0, 2)
        if self.ticker is not None and self.ticker.source != "none":
            rec["ticks"] = self.ticker.summary(t0, t1)
        self.results[name] = rec
        if "result" in rec:
            print(
                f"   {name}: {rec['status']} in {rec['seconds']:.1f} s: {self.brief(name, rec['result'])}",
                flush=True,
            )
        self.write()

    # -- env ---------------------------------------------------------------------------------------
    def s_env(self, budget: float) -> dict:
        import importlib.metadata as md

        out: dict = {"python": f"{platform.python_version()} ({sys.executable})", "modules": {}}
        for mod, dist in CORE_MODULES + SERVICE_MODULES:
            try:
                importlib.import_module(mod)
            except Exception as e:  # noqa: BLE001 - reported; the sections that need it skip
                self.importable[mod] = f"{type(e).__name__}: {e}"
                out["modules"][mod] = None
                print(f"   {mod:<20} MISSING ({type(e).__name__}: {e})")
                continue
            try:
                version = md.version(dist)
            except md.PackageNotFoundError:
                version = "?"
            self.importable[mod] = None
            out["modules"][mod] = version
            print(f"   {mod:<20} {version}")
        for mod in PROJECT_MODULES:
            try:
                importlib.import_module(mod)
                self.importable[mod] = None
                print(f"   {mod:<38} importable")
            except Exception as e:  # noqa: BLE001 - reported; the sections that need it skip
                self.importable[mod] = f"{type(e).__name__}: {e}"
                print(f"   {mod:<38} NOT importable ({type(e).__name__}: {e})")
        out["project"] = {m: self.importable[m] or "ok" for m in PROJECT_MODULES}
        import torch

        out["torch"] = torch.__version__
        out["cuda_available"] = torch.cuda.is_available()
        out["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out["gpu"] = {
                "name": p.name,
                "memory_bytes": int(p.total_memory),
                "capability": f"{p.major}.{p.minor}",
                "multiprocessors": p.multi_processor_count,
                "bf16": torch.cuda.is_bf16_supported(),
            }
        print(
            f"   torch {torch.__version__}, CUDA {torch.version.cuda}, available={torch.cuda.is_available()}"
            + (f" ({out['gpu']['name']})" if "gpu" in out else "")
        )
        broken = [m for m in CORE_PROJECT if self.importable.get(m)]
        if broken:
            raise RuntimeError(f"the project's torch modules do not import: {broken} (PYTHONPATH=. ?)")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"--device {self.device} but torch sees no CUDA device")
        return out

    # -- model -------------------------------------------------------------------------------------
    def s_model(self, budget: float) -> dict:
        import torch
        import transformers
        from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

        from openrl_service.models.tiny import SPECIAL_TOKENS, build_tiny_model

        transformers.utils.logging.disable_progress_bar()
        size = "smoke" if self.smoke else "0.5b"
        shape = dict(SHAPES[size])
        if self.args.vocab:
            shape["vocab_size"] = self.args.vocab
        if shape["vocab_size"] < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"--vocab must be at least {256 + len(SPECIAL_TOKENS)} (the byte tokenizer)")
        folder = self.work / f"qwen2-{size}-random"
        t0 = time.perf_counter()
        # The tiny model's folder gives the byte-level tokenizer (ids 0-255 = bytes, then 4
        # specials); its config and weights are replaced.
        build_tiny_model(folder)
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            (folder / name).unlink(missing_ok=True)
        endoftext, _im_start, im_end, pad = range(256, 256 + len(SPECIAL_TOKENS))
        config = Qwen2Config(
            **shape,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            bos_token_id=None,
            eos_token_id=im_end,
            pad_token_id=pad,
        )
        config.architectures = ["Qwen2ForCausalLM"]
        dtype = torch.float32 if self.smoke else torch.bfloat16
        torch.manual_seed(0)
        with torch.device(self.device):  # initialised where it lives: seconds on a GPU
            model = Qwen2ForCausalLM(config).to(dtype)
        model.generation_config = GenerationConfig(eos_token_id=[im_end, endoftext], pad_token_id=pad)
        self.sync()
        t1 = time.perf_counter()
        model.save_pretrained(folder, safe_serialization=True)
        t2 = time.perf_counter()
        params = sum(p.numel() for p in model.parameters())
        del model
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        self.folder = folder
        files = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        return {
            "size": size,
            "shape": shape,
            "params": params,
            "saved_dtype": str(dtype).replace("torch.", ""),
            "init_s": t1 - t0,
            "save_s": t2 - t1,
            "folder_bytes": files,
            "tokenizer": "the tiny model's byte-level tokenizer (ids 0-255 bytes, 4 specials)",
        }

    # -- load --------------------------------------------------------------------------------------
    def s_load(self, budget: float) -> dict:
        if str(BENCH) not in sys.path:
            sys.path.insert(0, str(BENCH))
        from fused import FusedBench

        s = self.sizes
        t0 = time.perf_counter()
        self.bench = FusedBench(
            runs=3, seqs=s["fused_seqs"], tokens=s["fused_tokens"], model=str(self.folder), device=self.device
        )
        self.sync()
        base = self.bench.base
        return {
            "load_s": time.perf_counter() - t0,
            "how": "openrl_service.models.loading.load_base_model + Trainer + TorchSampler + 3 LoRA r8 runs",
            "model": base.name,
            "device": str(base.device),
            "dtype": str(base.dtype).replace("torch.", ""),
            "vocab_size": base.vocab_size,
            "lora_targets": len(base.targets),
            "microbatch_tokens": self.bench.trainer.microbatch_tokens,
        }

    # -- fused -------------------------------------------------------------------------------------
    def s_fused(self, budget: float) -> dict:
        from fused import compare

        b = self.bench
        repeats = self.sizes["fused_repeats"]
        per_run, fused = compare(b.train, repeats)
        tokens = b.train_tokens
        return {
            "runs": len(b.states),
            "seqs_per_run": self.sizes["fused_seqs"],
            "max_seq_tokens": self.sizes["fused_tokens"],
            "tokens": tokens,
            "repeats": repeats,
            "per_run_s": per_run,
            "fused_s": fused,
            "speedup": per_run / fused,
            "per_run_tokens_per_s": tokens / per_run,
            "fused_tokens_per_s": tokens / fused,
            "optim_steps_per_run": b.states[0].steps,
        }

    # -- sampler -----------------------------------------------------------------------------------
    def s_sampler(self, budget: float) -> dict:
        from openrl_service.sampling.base import SampleJob, SamplingParams

        if str(BENCH) not in sys.path:
            sys.path.insert(0, str(BENCH))
        from packing import PROMPTS

        b = self.bench
        s = self.sizes
        tok = b.base.tokenizer
        adapter = b.states[0].adapter.snapshot()  # what the service samples: a frozen copy

        def jobs(max_tokens: int) -> list:
            return [
                SampleJob(
                    prompt=tok.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False),
                    num_samples=s["samples"],
                    params=SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=100 + i),
                    adapter=adapter,
                )
                for i in range(s["prompts"])
            ]

        b.sampler.sample_many(jobs(2))  # warm-up (kernels, allocator)
        work = jobs(s["max_tokens"])
        self.sync()
        t0 = time.perf_counter()
        outs = b.sampler.sample_many(work)
        self.sync()
        dt = time.perf_counter() - t0
        generated = sum(len(q.tokens) for o in outs for q in o.sequences)
        self.sampled = (work, outs)
        return {
            "sampler": SAMPLER_LABEL,
            "call": "TorchSampler.sample_many (one batched generate, KV cache)",
            "prompts": s["prompts"],
            "samples_per_prompt": s["samples"],
            "max_tokens": s["max_tokens"],
            "generated_tokens": generated,
            "prompt_tokens": sum(len(j.prompt) for j in work),
            "seconds": dt,
            "tokens_per_s": generated / dt,
            "adapter": f"run 0's snapshot after {b.states[0].steps} optimizer steps",
        }

    # -- agreement ---------------------------------------------------------------------------------
    def s_agreement(self, budget: float) -> dict:
        import numpy as np

        from openrl_service.training.trainer import DatumArrays

        if self.sampled is None:
            raise Skip("no sampled tokens (the sampler section did not finish)")
        b = self.bench
        work, outs = self.sampled
        data, spans, sampler_lp = [], [], []
        for job, out in zip(work, outs, strict=True):
            for q in out.sequences:
                full = np.asarray(job.prompt + q.tokens, dtype=np.int64)
                n = len(full) - 1
                data.append(
                    DatumArrays(full[:-1], {"target_tokens": full[1:], "weights": np.ones(n, np.float32)})
                )
                spans.append((len(job.prompt) - 1, len(q.tokens)))
                sampler_lp.append(np.asarray(q.logprobs, dtype=np.float64))
        t0 = time.perf_counter()
        res = b.trainer.forward_backward(b.states[0], data, "cross_entropy", {}, forward_only=True)
        self.sync()
        dt = time.perf_counter() - t0
        deltas = np.concatenate(
            [
                np.abs(lp[start : start + n].astype(np.float64) - q)
                for lp, (start, n), q in zip(res.logprobs, spans, sampler_lp, strict=True)
            ]
        )
        mean_lp = float(np.mean(np.concatenate(sampler_lp)))
        return {
            "what": f"{SAMPLER_LABEL} logprobs of its sampled tokens vs Trainer.forward_backward "
            "(forward_only) logprobs of the same tokens, same adapter",
            "dtype": str(b.base.dtype).replace("torch.", ""),
            "tokens": int(deltas.size),
            "mean_abs_delta": float(deltas.mean()),
            "max_abs_delta": float(deltas.max()),
            "p99_abs_delta": float(np.percentile(deltas, 99)),
            "mean_sampler_logprob": mean_lp,
            "trainer_forward_s": dt,
        }

    # -- snapshot ----------------------------------------------------------------------------------
    def s_snapshot(self, budget: float) -> dict:
        from safetensors.torch import load_file, save_file

        from openrl_service.training.lora import adapter_from_peft, peft_adapter_config

        b = self.bench
        base = b.base
        st = b.states[0]
        live = st.adapter
        config = peft_adapter_config(st.spec, base.targets, str(self.folder))
        out: dict = {}
        t0 = time.perf_counter()
        if self.importable.get("openrl_service.storage.checkpoints") is None:
            from openrl_service.storage.checkpoints import CheckpointRef, CheckpointStore

            store = CheckpointStore(self.work / "data")
            ref = CheckpointRef("gpu-check-run", "sampler_weights", "step-1")
            folder = store.save(
                "default",
                ref,
                adapter=live.peft_state_dict(),
                adapter_config=config,
                optimizer=None,
                manifest={"lora": st.spec.to_json()},
                overwrite=True,
            )
            t1 = time.perf_counter()
            _, tensors, _ = store.load("default", ref)
            out["how"] = "CheckpointStore.save / .load (digest-checked) + adapter_from_peft, as the service"
        else:
            folder = self.work / "adapter"
            folder.mkdir(exist_ok=True)
            save_file(live.peft_state_dict(), str(folder / "adapter_model.safetensors"))
            (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
            t1 = time.perf_counter()
            tensors = load_file(str(folder / "adapter_model.safetensors"))
            why = self.importable["openrl_service.storage.checkpoints"]
            out["how"] = f"safetensors save/load + adapter_from_peft (CheckpointStore not importable: {why})"
        loaded = adapter_from_peft(st.spec, tensors, device=base.device, trainable=False)
        self.sync()
        t2 = time.perf_counter()
        diff = max(
            float((loaded.weights[n][i] - live.weights[n][i].detach()).abs().max())
            for n in live.weights
            for i in (0, 1)
        )
        files = {p.name: p.stat().st_size for p in Path(folder).iterdir()}
        out |= {
            "save_s": t1 - t0,
            "load_s": t2 - t1,
            "tensors": len(tensors),
            "files": files,
            "adapter_bytes": files.get("adapter_model.safetensors"),
            "roundtrip_max_abs_delta": diff,
        }
        # PEFT's own loader on the same folder, on a fresh copy of the base model.
        if self.importable.get("peft") is not None:
            out["peft"] = {"error": f"skipped: peft is not importable ({self.importable['peft']})"}
            return out
        try:
            out["peft"] = self._peft_check(Path(folder), live)
        except SectionTimeout:
            out["peft"] = {"error": "the section's budget ran out during PEFT's load"}
            out["_status"] = "timeout"
            print("   snapshot: PEFT cross-check ran past the section's budget", flush=True)
        except Exception as e:  # noqa: BLE001 - reported inside the section's result
            out["peft"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"   snapshot: PEFT cross-check failed: {type(e).__name__}: {e}", flush=True)
        return out

    def _peft_check(self, folder: Path, adapter) -> dict:
        import peft
        import torch
        from transformers import AutoModelForCausalLM

        base = self.bench.base
        t0 = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(self.folder, dtype=base.dtype).to(base.device)
        self.sync()
        t1 = time.perf_counter()
        with (
            warnings.catch_warnings()
        ):  # PEFT's note on a LoRA of the tied lm_head; transformers' deprecations
            warnings.simplefilter("ignore")
            model = peft.PeftModel.from_pretrained(hf, str(folder))
        model.eval()
        self.sync()
        t2 = time.perf_counter()
        ids = torch.tensor([list(range(65, 65 + 24))], device=base.device)
        with torch.no_grad():
            theirs = model(input_ids=ids).logits.float()
            with base.router.use(adapter):
                ours = base.model(input_ids=ids, use_cache=False).logits.float()
        delta = float((theirs - ours).abs().max())
        scale = float(ours.abs().max())
        del model, hf
        if base.device.type == "cuda":
            torch.cuda.empty_cache()
        return {
            "peft": peft.__version__,
            "base_load_s": t1 - t0,
            "adapter_load_s": t2 - t1,
            "max_abs_logit_delta_vs_service": delta,
            "max_abs_logit": scale,
        }

    # -- packing -----------------------------------------------------------------------------------
    def s_packing(self, budget: float) -> dict:
        missing = [m for m in PACKING_NEEDS if self.importable.get(m, "not checked")]
        if missing:
            why = "; ".join(f"{m}: {self.importable.get(m, 'not checked')}" for m in missing)
            raise Skip(
                f"the service's packages are missing ({why}); carry them as wheels (bench/gpu_wheels.sh, "
                "carry ['.whl']) to measure packing"
            )
        out_json = self.out / "gpu_check-packing.json"
        out_json.unlink(missing_ok=True)
        extra = shlex.split(self.args.packing_args or self.sizes["packing_args"])
        cmd = [
            sys.executable,
            str(BENCH / "packing.py"),
            "--model",
            str(self.folder),
            "--device",
            self.device,
        ]
        cmd += extra + ["--out", str(out_json)]
        print(f"   $ {' '.join(shlex.quote(c) for c in cmd[1:])}  (limit {budget:.0f} s)", flush=True)
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=False,
        )
        tail: list[str] = []

        def pump() -> None:
            for line in proc.stdout:
                tail.append(line.rstrip())
                del tail[:-40]
                print(f"   | {line.rstrip()}", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(budget)
        except subprocess.TimeoutExpired:
            proc.terminate()  # packing.py stops its service and clients on SIGTERM
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            reader.join(5)
            raise SectionTimeout() from None
        except Terminated:
            proc.terminate()
            proc.wait(20)
            raise
        reader.join(5)
        if rc != 0 or not out_json.exists():
            raise RuntimeError(f"bench/packing.py exited {rc}: " + " / ".join(tail[-3:]))
        r = json.loads(out_json.read_text())
        rows = {}
        for n, row in sorted(r["by_n"].items(), key=lambda kv: int(kv[0])):
            g = (row.get("gpu_util_nvml") or {}).get("window") or {}
            rows[n] = {
                k: row[k]
                for k in ("duty", "speedup", "bound", "slowdown", "fairness", "steps_per_s", "tokens_per_s")
            } | {"fused_fraction": row.get("fused_fraction"), "gpu_util_nvml_mean": g.get("util_mean")}
        return {
            "how": "bench/packing.py: openrl-service serve --model <the folder> + N client processes "
            "(sample with the torch sampler, reward wait, train_step)",
            "args": extra,
            "json": out_json.name,
            "solo_duty_f": r["solo_duty_f"],
            "reward_s": r["params"]["reward_s"],
            "calibration_device_s": r["calibration"]["device_s"],
            "by_n": rows,
            "fused_speedup": r["fused"]["speedup"],
            "service_fusion": r["service"]["fusion"],
            "total_s": r["total_s"],
        }

    # -- output ------------------------------------------------------------------------------------
    @staticmethod
    def brief(name: str, r: dict) -> str:
        """One line per section result."""
        if name == "env":
            gpu = r.get("gpu", {}).get("name")
            return f"torch {r['torch']}, CUDA {r['torch_cuda']}" + (f", {gpu}" if gpu else ", no GPU")
        if name == "model":
            return (
                f"Qwen2 {r['size']} random-init: {r['params'] / 1e6:.1f} M params, vocab "
                f"{r['shape']['vocab_size']}, {r['saved_dtype']}; init {r['init_s']:.1f} s, save "
                f"{r['save_s']:.1f} s ({r['folder_bytes'] / 2**20:.0f} MiB)"
            )
        if name == "load":
            return (
                f"load_base_model {r['load_s']:.1f} s ({r['dtype']} on {r['device']}, "
                f"{r['lora_targets']} LoRA targets)"
            )
        if name == "fused":
            return (
                f"{r['runs']} runs x {r['seqs_per_run']} seqs ({r['tokens']} tokens): per run in turn "
                f"{r['per_run_s'] * 1e3:.1f} ms, fused {r['fused_s'] * 1e3:.1f} ms -> {r['speedup']:.2f}x"
            )
        if name == "sampler":
            return (
                f"{SAMPLER_LABEL}: {r['prompts']} prompts x {r['samples_per_prompt']} samples x "
                f"{r['max_tokens']} tokens = {r['generated_tokens']} tokens in {r['seconds']:.2f} s -> "
                f"{r['tokens_per_s']:.0f} tokens/s"
            )
        if name == "agreement":
            return (
                f"{SAMPLER_LABEL} vs trainer logprobs ({r['dtype']}): mean |d| {r['mean_abs_delta']:.2e}, "
                f"max |d| {r['max_abs_delta']:.2e} over {r['tokens']} tokens"
            )
        if name == "snapshot":
            p = r.get("peft", {})
            peft_part = (
                f"; PEFT load {p['adapter_load_s']:.2f} s, max |d logit| vs service "
                f"{p['max_abs_logit_delta_vs_service']:.2e}"
                if "adapter_load_s" in p
                else f"; PEFT: {p.get('error')}"
            )
            return (
                f"save {r['save_s'] * 1e3:.0f} ms, load {r['load_s'] * 1e3:.0f} ms "
                f"({(r['adapter_bytes'] or 0) / 2**20:.1f} MiB, {r['tensors']} tensors, roundtrip max |d| "
                f"{r['roundtrip_max_abs_delta']:.1e})" + peft_part
            )
        if name == "packing":
            parts = [
                f"N={n} duty {v['duty']:.2f} speedup {v['speedup']:.2f}x (bound {v['bound']:.2f})"
                for n, v in r["by_n"].items()
            ]
            return f"f={r['solo_duty_f']:.2f}; " + "; ".join(parts)
        return ""

    def print_table(self) -> None:
        src = self.ticker.source if self.ticker else "none"
        mode = "SMOKE (tiny sizes on the CPU: not meaningful as performance)" if self.smoke else "GPU"
        print(f"\nGPU check, {mode}, device {self.device}; every sampling figure is the {SAMPLER_LABEL}'s")
        print(f"{'section':<10} {'status':<9} {'s / budget':>11}  result")
        for name, _, _ in SECTIONS:
            r = self.results.get(name)
            if r is None:
                continue
            took = f"{r.get('seconds', 0):.1f}/{r.get('budget_s', 0):.0f}"
            text = self.brief(name, r["result"]) if "result" in r else (r.get("reason") or r.get("error"))
            print(f"{name:<10} {r['status']:<9} {took:>11}  {text}")
        label = self.ticker.label if self.ticker and self.ticker.label else "NVML"
        if src == "none":
            why = (
                "pynvml missing or NVML unreadable" if self.device.startswith("cuda") else "not a CUDA device"
            )
            print(f"NVML ticks: none ({why}: telemetry.NvmlReader is not available)")
        else:
            print(f"NVML ticks ({label}, every {self.ticker.period_s} s, device {self.ticker.device}):")
            print(f"{'section':<10} {'ticks':>6} {'util mean':>10} {'util max':>9} {'mem max GiB':>12}")
            for name, _, _ in SECTIONS:
                t = self.results.get(name, {}).get("ticks")
                if not t:
                    continue
                if t["ticks"]:
                    cells = (f"{t['util_mean']:.0%}", f"{t['util_max']:.0%}")
                    mem = f"{t['memory_used_max_bytes'] / 2**30:.2f}"
                else:
                    cells, mem = ("-", "-"), "-"
                print(f"{name:<10} {t['ticks']:>6} {cells[0]:>10} {cells[1]:>9} {mem:>12}")
        counts = {s: sum(r["status"] == s for r in self.results.values()) for s in ("ok", "skipped")}
        bad = len(self.results) - counts["ok"] - counts["skipped"]
        print(
            f"gpu_check: {len(self.results)} sections: {counts['ok']} ok, {counts['skipped']} skipped, "
            f"{bad} failed in {time.time() - self.t_begin:.0f} s; JSON in {self.out / 'gpu_check.json'}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: every code path, no speed")
    p.add_argument("--device", default=None, help="torch device (default cuda; cpu with --smoke)")
    p.add_argument("--deadline-s", type=float, default=None, help="total seconds (default 250; smoke 240)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 151936; smoke 4096)")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results)")
    p.add_argument("--only", nargs="+", choices=[s for s, _, _ in SECTIONS], help="run only these sections")
    p.add_argument("--packing-args", default=None, help="bench/packing.py's options (replaces the defaults)")
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.deadline_s = args.deadline_s or (240.0 if args.smoke else 250.0)
    args.out = args.out or os.environ.get("OUT") or str(ROOT / "bench" / "results")
    if args.only:  # the import listing decides what can run; later sections need the model
        need = {"env"} | ({"model"} if NEEDS_MODEL & set(args.only) else set())
        need |= {"load"} if NEEDS_BENCH & set(args.only) else set()
        need |= {"sampler"} if "agreement" in args.only else set()
        args.only = sorted(need | set(args.only))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def on_alarm(signum, frame):
        raise SectionTimeout()

    def on_term(signum, frame):
        raise Terminated(f"signal {signum}")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    if args.smoke:  # a tiny model on a shared CPU: one thread is faster and disturbs others less
        import torch

        torch.set_num_threads(1)
    check = Check(args)
    print(
        f"gpu_check: mode {'smoke' if args.smoke else 'gpu'}, device {args.device}, deadline "
        f"{args.deadline_s:.0f} s, output {args.out}",
        flush=True,
    )
    try:
        return check.run()
    finally:
        import shutil

        shutil.rmtree(check.work, ignore_errors=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the results are written: skip the interpreter's teardown of torch & co (seconds)
