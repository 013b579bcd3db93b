"""Sampling with plain torch on CPU, MPS or CUDA: batched decodes, KV-cached, within a memory budget.

The prompt is prefilled once and its cache repeated for the ``num_samples`` rows. Each row has its
own ``torch.Generator`` seeded from (seed, row), so a seeded request gives the same samples whatever
else is running. ``sample_many`` runs several requests (different runs' adapters, prompts and
parameters) as one batched generate: left-padded prefill, per-row LoRA routing
(``AdapterRouter.use_rows``), one shared KV cache whose rows keep their own generators and stop rules. Logprobs are always the raw model's (log-softmax of the unscaled logits), so they
match what training computes; temperature, top-k and top-p only shape the choice. A call bigger than
OPENRL_SAMPLE_BATCH_BYTES is split into batches that fit (sampling/budget.py): whole jobs, or a job's
samples across batches, each row keeping its seed, so the samples are those one batch would draw.
"""

from __future__ import annotations

import functools
import inspect
import random
from dataclasses import replace

import numpy as np
import torch

from openrl_service.errors import UserError
from openrl_service.models.loading import BaseModel
from openrl_service.sampling.base import SampledSequence, SampleJob, SampleOutput
from openrl_service.sampling.budget import Piece, cost_of, default_batch_bytes, plan

TOPK_EMPTY_LOGPROB = -99999.0


def _cache_io(model) -> tuple[str, str]:
    """transformers >= 5.2x names the KV cache ``cache``; older releases ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return ("cache", "cache") if "cache" in params else ("past_key_values", "past_key_values")


def row_seed(seed: int, row: int) -> int:
    return (seed * 1_000_003 + row * 7_919 + 17) % (2**63 - 1)


class TorchSampler:
    def __init__(self, base: BaseModel):
        self.base = base
        self._cache_arg, self._cache_out = _cache_io(base.model)
        self._keep_arg = "logits_to_keep" in inspect.signature(base.model.forward).parameters
        self.cost = cost_of(base)
        self._default_bytes: int | None = None

    @property
    def batch_bytes(self) -> int:
        """The most one batch may take: the served model's OPENRL_SAMPLE_BATCH_BYTES (set at setup), else
        the device's default."""
        if self.base.sample_batch_bytes:
            return self.base.sample_batch_bytes
        if self._default_bytes is None:
            from openrl_service.models.loading import free_bytes

            self._default_bytes = default_batch_bytes(self.base.device.type, free_bytes(self.base.device))
        return self._default_bytes

    def sample(self, job: SampleJob) -> SampleOutput:
        return self.sample_many([job])[0]

    def sample_many(self, jobs: list[SampleJob]) -> list[SampleOutput]:
        """Several jobs (any adapters, prompts and parameters), one output per job: one batched generate
        (:meth:`_batched`) per batch of the plan that keeps each within :attr:`batch_bytes`."""
        if not jobs:
            return []
        jobs = [
            j if j.params.seed is not None else replace(j, params=replace(j.params, seed=_fresh_seed()))
            for j in jobs
        ]  # a job split across batches draws every row from one seed
        batches = plan(jobs, self.cost, self.batch_bytes)
        if len(batches) <= 1 and all(p.rows == jobs[p.job].num_samples for b in batches for p in b):
            return self._generate(jobs)
        outs: list[SampleOutput | None] = [None] * len(jobs)
        for batch in batches:
            done = self._generate([_piece(jobs[p.job], p) for p in batch])
            for p, out in zip(batch, done, strict=True):
                first = outs[p.job]
                outs[p.job] = out if first is None else _joined(first, out, len(jobs[p.job].prompt))
        return outs  # type: ignore[return-value]

    def _generate(self, jobs: list[SampleJob]) -> list[SampleOutput]:
        return [self._one(jobs[0])] if len(jobs) == 1 else self._batched(jobs)

    @torch.inference_mode()
    def _one(self, job: SampleJob) -> SampleOutput:
        base = self.base
        dev = base.device
        p = job.params
        n = job.num_samples
        prompt = torch.tensor([job.prompt], dtype=torch.long, device=dev)
        # Without prompt logprobs only the last position's logits are needed: skip the [P, V] rest.
        keep = (
            {}
            if (job.prompt_logprobs or job.topk_prompt_logprobs or not self._keep_arg)
            else {"logits_to_keep": 1}
        )
        with base.router.use(job.adapter):
            out = base.model(input_ids=prompt, use_cache=True, **keep)
        logits_prompt = out.logits[0].float()  # [P, V], or [1, V] with logits_to_keep
        cache = getattr(out, self._cache_out)
        result = _prompt_outputs(job, logits_prompt, prompt[0])

        base_seed = p.seed if p.seed is not None else random.SystemRandom().randrange(2**62)
        gens = [
            torch.Generator(device=dev).manual_seed(row_seed(base_seed, job.first_row + r)) for r in range(n)
        ]
        stop_ids = set(p.stop_token_ids)
        window = max((len(s) for s in p.stop_strings), default=0) + 8
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        topk_rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
        stop_reason = ["length"] * n
        active = list(range(n))  # rows still generating, in cache order
        logits = logits_prompt[-1:].expand(n, -1)
        if n > 1:
            cache.batch_repeat_interleave(n)
        pos = len(job.prompt)
        for step in range(p.max_tokens):
            logits = logits.float()
            raw = torch.log_softmax(logits, dim=-1)  # [A, V]
            chosen = _choose(logits, p, [gens[r] for r in active])
            chosen_lp = raw.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
            if job.topk_sample_logprobs:
                top = torch.topk(raw, job.topk_sample_logprobs, dim=-1)
                top_ids, top_vals = top.indices.cpu().numpy(), top.values.cpu().numpy()
            chosen_l = chosen.tolist()
            chosen_lp_l = chosen_lp.tolist()
            keep = []
            for j, r in enumerate(active):
                tok = chosen_l[j]
                tokens[r].append(tok)
                logprobs[r].append(chosen_lp_l[j])
                if job.on_token is not None:
                    job.on_token(job.first_row + r, tok)
                if job.topk_sample_logprobs:
                    topk_rows[r].append((top_ids[j], top_vals[j]))
                if tok in stop_ids or (
                    p.stop_strings and self._hits_stop_string(tokens[r], p.stop_strings, window)
                ):
                    stop_reason[r] = "stop"
                else:
                    keep.append(j)
            if len(keep) == 0 or step == p.max_tokens - 1:
                break
            if len(keep) < len(active):
                cache.batch_select_indices(torch.tensor(keep, device=dev))
                chosen = chosen[keep]
                active = [active[j] for j in keep]
            pos_ids = torch.full((len(active), 1), pos, dtype=torch.long, device=dev)
            with base.router.use(job.adapter):
                cache, logits = self._decode_step(chosen, pos_ids, cache)
            pos += 1
        for r in range(n):
            seq = SampledSequence(tokens=tokens[r], logprobs=logprobs[r], stop_reason=stop_reason[r])
            if job.topk_sample_logprobs:
                seq.topk_ids = np.stack([t[0] for t in topk_rows[r]]).astype(np.int32)
                seq.topk_logprobs = np.stack([t[1] for t in topk_rows[r]]).astype(np.float32)
            result.sequences.append(seq)
        result.tokens = len(job.prompt) + sum(len(t) for t in tokens)
        return result

    @torch.inference_mode()
    def _batched(self, jobs: list[SampleJob]) -> list[SampleOutput]:
        """Several jobs (any adapters, prompts and parameters) in ONE batched generate; one output per job.

        Prompts are left-padded into one prefill (attention mask + per-row positions), routed per row
        to each job's adapter; every sample then decodes as a row of one shared KV cache, with its own
        stop rules, ``max_tokens`` and generator (seeded from (job seed, row) exactly as in
        :meth:`sample`), and the batch shrinks as rows finish. Greedy tokens equal per-job sampling;
        logprobs agree to float32 rounding (padding changes matmul shapes, not the math)."""
        base = self.base
        dev = base.device
        lens = [len(j.prompt) for j in jobs]
        width = max(lens)
        padded = min(lens) != width
        pad_id = base.tokenizer.pad_token_id or 0
        ids = torch.full((len(jobs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for j, job in enumerate(jobs):
            ids[j, width - lens[j] :] = torch.tensor(job.prompt, dtype=torch.long)
            mask[j, width - lens[j] :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        want_prompt = any(j.prompt_logprobs or j.topk_prompt_logprobs for j in jobs)
        kw: dict = {} if (want_prompt or not self._keep_arg) else {"logits_to_keep": 1}
        if padded:
            kw["attention_mask"] = mask
            kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        with base.router.use_rows([j.adapter for j in jobs], device=dev):
            out = base.model(input_ids=ids, use_cache=True, **kw)
        cache = getattr(out, self._cache_out)
        results = []
        for j, job in enumerate(jobs):
            logits_prompt = (
                out.logits[j, width - lens[j] :].float() if want_prompt else out.logits[j, -1:].float()
            )
            results.append(_prompt_outputs(job, logits_prompt, ids[j, width - lens[j] :]))

        # One decode row per sample: (job, sample index), in job order.
        rows = [(j, r) for j, job in enumerate(jobs) for r in range(job.num_samples)]
        seeds = [
            j.params.seed if j.params.seed is not None else random.SystemRandom().randrange(2**62)
            for j in jobs
        ]
        gens = [
            torch.Generator(device=dev).manual_seed(row_seed(seeds[j], jobs[j].first_row + r))
            for j, r in rows
        ]
        stop_ids = [set(j.params.stop_token_ids) for j in jobs]
        windows = [max((len(s) for s in j.params.stop_strings), default=0) + 8 for j in jobs]
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        topk_rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in rows]
        stop_reason = ["length"] * len(rows)
        job_of = torch.tensor([j for j, _ in rows], dtype=torch.long, device=dev)
        cache.batch_select_indices(job_of)  # the prompt cache, repeated for each job's samples
        logits = out.logits[job_of, -1]
        row_mask = mask[job_of]
        active = [i for i, (j, _) in enumerate(rows) if jobs[j].params.max_tokens > 0]
        if len(active) < len(rows):
            keep_t = torch.tensor(active, dtype=torch.long, device=dev)
            cache.batch_select_indices(keep_t)
            logits, row_mask = logits[keep_t], row_mask[keep_t]
        while active:
            logits = logits.float()
            raw = torch.log_softmax(logits, dim=-1)  # [A, V]
            chosen = torch.empty(len(active), dtype=torch.long, device=dev)
            by_job: dict[int, list[int]] = {}
            for a, i in enumerate(active):
                by_job.setdefault(rows[i][0], []).append(a)
            tops: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            for j, sel in by_job.items():
                sel_t = torch.tensor(sel, dtype=torch.long, device=dev)
                chosen[sel_t] = _choose(logits[sel_t], jobs[j].params, [gens[active[a]] for a in sel])
                if jobs[j].topk_sample_logprobs:
                    top = torch.topk(raw[sel_t], jobs[j].topk_sample_logprobs, dim=-1)
                    for q, a in enumerate(sel):
                        tops[a] = (top.indices[q].cpu().numpy(), top.values[q].cpu().numpy())
            chosen_lp = raw.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
            chosen_l, chosen_lp_l = chosen.tolist(), chosen_lp.tolist()
            keep = []
            for a, i in enumerate(active):
                job = jobs[rows[i][0]]
                tok = chosen_l[a]
                tokens[i].append(tok)
                logprobs[i].append(chosen_lp_l[a])
                if job.on_token is not None:
                    job.on_token(job.first_row + rows[i][1], tok)
                if a in tops:
                    topk_rows[i].append(tops[a])
                if tok in stop_ids[rows[i][0]] or (
                    job.params.stop_strings
                    and self._hits_stop_string(tokens[i], job.params.stop_strings, windows[rows[i][0]])
                ):
                    stop_reason[i] = "stop"
                elif len(tokens[i]) < job.params.max_tokens:
                    keep.append(a)
            if not keep:
                break
            if len(keep) < len(active):
                keep_t = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(keep_t)
                chosen, row_mask = chosen[keep_t], row_mask[keep_t]
                active = [active[a] for a in keep]
            pos_ids = torch.tensor(
                [[lens[rows[i][0]] + len(tokens[i]) - 1] for i in active], dtype=torch.long, device=dev
            )
            kw = {}
            if padded:
                row_mask = torch.cat([row_mask, row_mask.new_ones((len(active), 1))], dim=1)
                kw["attention_mask"] = row_mask
            with base.router.use_rows([jobs[rows[i][0]].adapter for i in active], device=dev):
                cache, logits = self._decode_step(chosen, pos_ids, cache, **kw)
        for i, (j, _) in enumerate(rows):
            seq = SampledSequence(tokens=tokens[i], logprobs=logprobs[i], stop_reason=stop_reason[i])
            if jobs[j].topk_sample_logprobs:
                seq.topk_ids = np.stack([t[0] for t in topk_rows[i]]).astype(np.int32)
                seq.topk_logprobs = np.stack([t[1] for t in topk_rows[i]]).astype(np.float32)
            results[j].sequences.append(seq)
        for j, res in enumerate(results):
            res.tokens = lens[j] + sum(len(s.tokens) for s in res.sequences)
        return results

    def _decode_step(self, chosen: torch.Tensor, pos_ids: torch.Tensor, cache, **kw):
        """One token per active row through the cached model: (the new cache, next-token logits)."""
        out = self.base.model(
            input_ids=chosen.unsqueeze(-1),
            position_ids=pos_ids,
            use_cache=True,
            **{self._cache_arg: cache},
            **kw,
        )
        return getattr(out, self._cache_out), out.logits[:, -1]

    def _hits_stop_string(self, toks: list[int], stops: tuple[str, ...], window: int) -> bool:
        tok = self.base.tokenizer
        tail = tok.decode(toks[-window:], skip_special_tokens=False)
        if not any(s in tail for s in stops):
            return False
        # Only the newest token can complete a stop string (earlier ones were checked already).
        before = tok.decode(toks[-window:-1], skip_special_tokens=False) if len(toks) > 1 else ""
        return any(s in tail and s not in before for s in stops) or not before


def _fresh_seed() -> int:
    return random.SystemRandom().randrange(2**62)


def _piece(job: SampleJob, piece: Piece) -> SampleJob:
    """The samples of ``job`` that ``piece`` names, as a job of their own (prompt logprobs: the first)."""
    if piece.rows == job.num_samples:
        return job
    first = piece.first_row == 0
    return replace(
        job,
        num_samples=piece.rows,
        first_row=job.first_row + piece.first_row,
        prompt_logprobs=job.prompt_logprobs and first,
        topk_prompt_logprobs=job.topk_prompt_logprobs if first else 0,
    )


def _joined(out: SampleOutput, more: SampleOutput, prompt_tokens: int) -> SampleOutput:
    """A job's output from its pieces' outputs, in row order (the prompt counted once)."""
    out.sequences.extend(more.sequences)
    out.tokens += more.tokens - prompt_tokens
    out.notice = out.notice or more.notice
    return out


def _prompt_outputs(job: SampleJob, logits_prompt: torch.Tensor, prompt: torch.Tensor) -> SampleOutput:
    """A fresh output holding the prompt logprobs the job asked for (``logits_prompt``: [P, V] float)."""
    result = SampleOutput(sequences=[])
    if job.prompt_logprobs or job.topk_prompt_logprobs:
        logp = torch.log_softmax(logits_prompt[:-1], dim=-1)
        if job.prompt_logprobs:
            pl = torch.full((len(job.prompt),), float("nan"))
            if len(job.prompt) > 1:
                pl[1:] = logp.gather(-1, prompt[1:].unsqueeze(-1)).squeeze(-1).cpu()
            result.prompt_logprobs = pl.numpy().astype(np.float32)
        if job.topk_prompt_logprobs:
            k = job.topk_prompt_logprobs
            ids = np.zeros((len(job.prompt), k), dtype=np.int32)
            vals = np.full((len(job.prompt), k), TOPK_EMPTY_LOGPROB, dtype=np.float32)
            if len(job.prompt) > 1:
                top = torch.topk(logp, k, dim=-1)
                ids[1:] = top.indices.cpu().numpy()
                vals[1:] = top.values.cpu().numpy()
            result.topk_prompt_ids, result.topk_prompt_logprobs = ids, vals
    return result


def _choose(logits: torch.Tensor, p, gens: list[torch.Generator]) -> torch.Tensor:
    """Pick one token per row: greedy at temperature 0, else top-k/top-p filtered sampling.

    Row ``j`` draws with ``gens[j]`` exactly as ``torch.multinomial(probs[j], 1, generator=gens[j])``
    would (see :func:`_draw`)."""
    if p.temperature == 0 or _underflows(p.temperature, logits.dtype):  # 1e-300 is 0 in fp32
        return logits.argmax(dim=-1)
    scaled = logits if p.temperature == 1.0 else logits / p.temperature  # x / 1 is x, bit for bit
    if p.temperature < 1.0 and not torch.isfinite(scaled).all():
        # A tiny temperature overflows the division; shifted by the row's max, the best token's
        # logit is 0 and the others fall to -inf (the greedy limit) instead of inf - inf = NaN.
        scaled = (logits - logits.max(dim=-1, keepdim=True).values) / p.temperature
    if p.top_k is not None and p.top_k > 0 and p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = probs.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = (cum - probs) >= p.top_p
        drop[..., 0] = False  # a top_p below float32's smallest value (5e-324) would drop every token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(scaled, dim=-1)
    if not torch.isfinite(probs).all():
        raise UserError(
            "sampling: the weights give NaN or infinite logits (did training diverge? a lower "
            "learning_rate, or a checkpoint from before, samples again)",
            field="model",
        )
    return _draw(probs, gens)


def _draw(probs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` [A, V], row ``j`` drawn with ``gens[j]``.

    This is what ``torch.multinomial(probs[j], 1, generator=gens[j])`` does for one sample (argmax of
    p / q with q ~ Exp(1) from the row's generator), with the division and argmax batched: one
    ``exponential_`` per row instead of a whole multinomial call per row and decoded token. The
    same tokens, bit for bit (tests/service/test_sampling.py checks it against torch.multinomial)."""
    q = torch.empty_like(probs)
    for j, g in enumerate(gens):
        q[j].exponential_(1, generator=g)
    return (probs / q).argmax(dim=-1)


@functools.lru_cache(maxsize=64)
def _underflows(temperature: float, dtype: torch.dtype) -> bool:
    """True when ``temperature`` rounds to 0 in ``dtype`` (sampling at it is greedy)."""
    return bool(torch.tensor(temperature, dtype=dtype) == 0)
