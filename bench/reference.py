"""The service against a minimal in-process reference on the tiny model: how close to the limit is it?

Reference, no service: a plain PEFT LoRA model (rank 8, alpha 32, the service's targets: every
attention and MLP linear plus the unembedding) with ``torch.optim.AdamW`` for SFT (summed
cross-entropy, as Tinker defines it); Hugging Face ``generate`` on the same model with the LoRA
merged for sampling. Same fp32, same torch thread count as the service's worker. The service:

* ``direct``: ``Trainer`` / ``TorchSampler`` called on this thread (the model code alone);
* ``engine``: ``TrainingService`` in-process (its device-worker thread, futures, journal);
* ``HTTP``: ``openrl-service serve`` on loopback driven by the unmodified Tinker SDK.

One SFT step = forward/backward on ``--batch`` × ``--tokens`` tokens + one AdamW step. One sample =
``--samples`` completions of exactly ``--max-tokens`` tokens (no stop) of one prompt, temperature 1.
Each mode alternates reference and service repetitions, so both see the same load; medians of
``--repeats`` after one warm-up, in wall seconds and in CPU seconds (this process plus the service
process: steadier than wall time on a shared machine). Not a test: it prints a ratio table (targets:
SFT ≤ 1.3×, sampling ≤ 1.5× the reference). ``OPENRL_TORCH_THREADS`` sets both sides' thread count.

    python bench/reference.py [--repeats 7] [--modes direct engine http] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore", message=".*tied.*")

PROMPT = list(b"<|im_start|>user\nWrite a short line.<|im_end|>\n<|im_start|>assistant\n")
LR = 1e-3  # TINY_DEFAULTS["learning_rate"]
RANK = 8


def service_threads() -> int:
    """What the service's device worker runs with: OPENRL_TORCH_THREADS, else torch's default."""
    import torch

    return int(os.environ.get("OPENRL_TORCH_THREADS") or torch.get_num_threads())


def sft_batch(batch: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (batch, tokens + 1))
    return ids[:, :-1], ids[:, 1:]


class Reference:
    """PEFT LoRA + AdamW, and HF generate with the LoRA merged: the least a step can cost."""

    def __init__(self, data_dir: Path):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, GenerationConfig

        from openrl_service.models.loading import _quiet_transformers
        from openrl_service.models.tiny import ensure_tiny_model

        _quiet_transformers()
        self.folder = ensure_tiny_model(data_dir / "models" / "openrl-tiny")
        model = AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32)
        modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
        cfg = LoraConfig(r=RANK, lora_alpha=32, lora_dropout=0.0, target_modules=modules)
        self.model = get_peft_model(model, cfg)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.gen_model = None
        self.gen_config = None
        self._gen_cls = GenerationConfig

    def sft_step(self, ids: np.ndarray, target: np.ndarray) -> None:
        import torch
        import torch.nn.functional as F

        x, y = torch.from_numpy(ids), torch.from_numpy(target)
        logits = self.model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def merge(self) -> None:
        """A copy of the trained model with the LoRA merged into the base weights, for generate."""
        import copy

        self.gen_model = copy.deepcopy(self.model).merge_and_unload().eval()
        gc = self.gen_model.generation_config
        self.gen_config = self._gen_cls(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=gc.pad_token_id,
            eos_token_id=gc.eos_token_id,
        )

    def sample(self, samples: int, max_tokens: int) -> None:
        import torch

        with torch.inference_mode():
            out = self.gen_model.generate(
                torch.tensor([PROMPT]),
                generation_config=self.gen_config,
                num_return_sequences=samples,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
            )
        assert out.shape == (samples, len(PROMPT) + max_tokens), out.shape


# -- the service, three ways -----------------------------------------------------------------------
class Direct:
    """``Trainer`` and ``TorchSampler`` called on this thread: the service's model code alone."""

    def __init__(self, data_dir: Path):
        from openrl_service.models.loading import load_base_model
        from openrl_service.sampling.torch_sampler import TorchSampler
        from openrl_service.training.lora import LoraSpec
        from openrl_service.training.trainer import Trainer

        self.base = load_base_model("tiny", data_dir=data_dir)
        self.trainer = Trainer(self.base)
        self.sampler = TorchSampler(self.base)
        self.state = self.trainer.new_state(LoraSpec(rank=RANK), seed=0)

    def sft_step(self, ids: np.ndarray, target: np.ndarray) -> None:
        from openrl_service.training.optim_params import AdamParams
        from openrl_service.training.trainer import DatumArrays

        data = [DatumArrays(ids[i], {"target_tokens": target[i]}) for i in range(len(ids))]
        self.trainer.forward_backward(self.state, data, "cross_entropy", {}, forward_only=False)
        self.trainer.optim_step(self.state, AdamParams(learning_rate=LR))

    def merge(self) -> None:
        self.snapshot = self.state.adapter.snapshot()

    def sample(self, samples: int, max_tokens: int) -> None:
        from openrl_service.sampling.base import SampleJob, SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
        out = self.sampler.sample(SampleJob(PROMPT, samples, params, self.snapshot))
        assert all(len(s.tokens) == max_tokens for s in out.sequences)


class Engine:
    """``TrainingService`` in-process: its device-worker thread, scheduler, futures and journal."""

    def __init__(self, data_dir: Path):
        from openrl_service.config import from_env
        from openrl_service.engine.service import TrainingService

        self.svc = TrainingService(from_env(data_dir=data_dir / "engine"))
        self.svc.start()
        self.svc.wait_ready(300)
        self.wait = self.svc.futures.wait_sync
        sess = self.svc.create_session("bench")
        rec = self.svc.create_model(
            "bench",
            session_id=sess.session_id,
            model_seq_id=0,
            base_model=None,
            spec=self.svc.checks.lora_spec(RANK),
            seed=0,
            user_metadata=None,
            idem=None,
        )
        self.wait(rec)
        self.run_id = rec.result["model_id"]
        self.seq = 1

    def sft_step(self, ids: np.ndarray, target: np.ndarray) -> None:
        from openrl_service.training.optim_params import AdamParams
        from openrl_service.training.trainer import DatumArrays

        data = [DatumArrays(ids[i], {"target_tokens": target[i]}) for i in range(len(ids))]
        fb = self.svc.forward_backward("bench", self.run_id, self.seq, data, "cross_entropy", {}, False, None)
        opt = self.svc.optim_step("bench", self.run_id, self.seq + 1, AdamParams(learning_rate=LR), None)
        self.seq += 2
        self.wait(fb)
        self.wait(opt)
        assert fb.error is None and opt.error is None, (fb.error, opt.error)

    def merge(self) -> None:
        snap = self.svc.save_for_sampler("bench", self.run_id, self.seq, None, 0, None, None)
        self.seq += 1
        self.wait(snap)
        self.sampler_id = snap.result["sampling_session_id"]

    def sample(self, samples: int, max_tokens: int) -> None:
        params = self.svc.checks.sampling_params({"max_tokens": max_tokens, "temperature": 1.0, "stop": []})
        rec = self.svc.sample(
            "bench",
            sampler_id=self.sampler_id,
            prompt=PROMPT,
            num_samples=samples,
            params=params,
            prompt_logprobs=False,
            topk_prompt_logprobs=0,
            topk_sample_logprobs=0,
            idem=None,
        )
        self.wait(rec)
        assert rec.error is None, rec.error
        assert all(len(s.tokens) == max_tokens for s in rec.result.sequences)

    def close(self) -> None:
        self.svc.stop()


class Http:
    """``openrl-service serve`` on loopback, driven by the unmodified Tinker SDK."""

    def __init__(self, data_dir: Path):
        import tinker

        from openrl_jupyter.local import start_service

        os.environ.setdefault("TINKER_API_KEY", "tml-bench")
        os.environ.setdefault("TINKER_TELEMETRY", "0")
        self.service = start_service(auth=False, timeout_s=180)
        self.sc = tinker.ServiceClient(base_url=self.service.url)
        self.tc = self.sc.create_lora_training_client(base_model="openrl/tiny", rank=RANK, seed=0).result()
        self.datums = None

    def sft_step(self, ids: np.ndarray, target: np.ndarray) -> None:
        from tinker import types

        datums = [
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[i].tolist()),
                loss_fn_inputs={"target_tokens": target[i].tolist()},
            )
            for i in range(len(ids))
        ]
        fb = self.tc.forward_backward(datums, "cross_entropy")
        opt = self.tc.optim_step(types.AdamParams(learning_rate=LR))
        fb.result()
        opt.result()

    def merge(self) -> None:
        self.sampler = self.tc.save_weights_and_get_sampling_client()

    def sample(self, samples: int, max_tokens: int) -> None:
        from tinker import types

        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])
        out = self.sampler.sample(types.ModelInput.from_ints(PROMPT), samples, params).result()
        assert all(len(s.tokens) == max_tokens for s in out.sequences)

    def close(self) -> None:
        self.sc.close("success").result()
        self.service.stop()


MODES = {"direct": Direct, "engine": Engine, "http": Http}
LABELS = {
    "direct": "in-process: Trainer / TorchSampler",
    "engine": "in-process: TrainingService",
    "http": "Tinker SDK over HTTP",
}


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system, all threads) of this process, or of process ``pid`` (Linux /proc)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def timed(fn, *args, pid: int | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process plus process ``pid``) of one call."""
    c0 = cpu_seconds() + (cpu_seconds(pid) if pid else 0.0)
    t0 = time.perf_counter()
    fn(*args)
    wall = time.perf_counter() - t0
    return wall, cpu_seconds() + (cpu_seconds(pid) if pid else 0.0) - c0


def measure(ref: Reference, svc, args, batch) -> dict[str, list[tuple[float, float]]]:
    """Alternate reference and service repetitions (the first pair warms up and is dropped)."""
    pid = svc.service.process.pid if isinstance(svc, Http) else None
    out: dict[str, list[tuple[float, float]]] = {
        k: [] for k in ("ref_sft", "svc_sft", "ref_sample", "svc_sample")
    }
    for i in range(args.repeats + 1):
        r, s = timed(ref.sft_step, *batch), timed(svc.sft_step, *batch, pid=pid)
        if i:
            out["ref_sft"].append(r)
            out["svc_sft"].append(s)
    ref.merge()
    svc.merge()
    shape = (args.samples, args.max_tokens)
    for i in range(args.repeats + 1):
        r, s = timed(ref.sample, *shape), timed(svc.sample, *shape, pid=pid)
        if i:
            out["ref_sample"].append(r)
            out["svc_sample"].append(s)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--json", type=Path, default=None, help="also write the raw timings here")
    args = p.parse_args()

    import torch

    threads = service_threads()
    torch.set_num_threads(threads)
    batch = sft_batch(args.batch, args.tokens)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        for mode in args.modes:
            ref = Reference(data_dir)  # a fresh reference per mode: both start from step 0
            svc = MODES[mode](data_dir)
            try:
                results[mode] = measure(ref, svc, args, batch)
            finally:
                if hasattr(svc, "close"):
                    svc.close()
    med = {
        m: {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in r.items()}
        for m, r in results.items()
    }
    print(
        f"openrl/tiny fp32, {threads} torch threads, median of {args.repeats} after a warm-up: SFT step = "
        f"{args.batch} x {args.tokens} tokens, LoRA r{RANK} fwd/bwd + AdamW; sample = "
        f"{args.samples} x {args.max_tokens} tokens, temperature 1; load average {os.getloadavg()[0]:.1f}"
    )
    print("wall s (CPU s: this process + the service process)")
    head = f"{'service':<36} {'SFT':>13} {'reference':>13} {'ratio':>6}   {'sample':>13} {'reference':>13} {'ratio':>6}"
    print(head)
    for mode, m in med.items():
        cells = []
        for op in ("sft", "sample"):
            (sw, sc), (rw, rc) = m[f"svc_{op}"], m[f"ref_{op}"]
            cells.append(f"{sw:>6.3f} ({sc:>4.2f}) {rw:>6.3f} ({rc:>4.2f}) {sw / rw:>5.2f}x")
        print(f"{LABELS[mode]:<36} {cells[0]}   {cells[1]}")
    print("targets: SFT <= 1.30x, sampling <= 1.50x the reference (wall)")
    if args.json:
        payload = {"threads": threads, "load": os.getloadavg(), "raw": results, "median": med}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
