"""How much memory one batched generate of the torch sampler takes, and how a call is split into batches
that stay within OPENRL_SAMPLE_BATCH_BYTES.

A call (the OpenAI endpoint's thousands of prompts, a fused sampling op, one Tinker sample of 128
samples) becomes one or more batches: whole jobs while they fit, and a job too big for a batch of its
own split by samples (its rows keep their seeds, so the samples are the ones one batch would draw).
The estimate of a batch, in bytes, for ``J`` prompts left-padded to ``W`` tokens, ``R`` sample rows
and ``D`` tokens to decode, where ``b`` is the model's dtype size:

    prefill    J·W · b·(4·hidden + 2·(heads + 2·kv_heads)·head_dim + 3·intermediate [+ heads·W])
               (the residual stream, q/k/v, the MLP, and an attention row per token where the scores
               are materialised: a padded batch, or a model on eager attention; SDPA's fused kernels
               keep no W x W scores for an unpadded one)
               + vocab · 12 per position whose logits are kept: all J·W when a job of the batch
               asks for prompt logprobs (a single job: its own prompt), else none
    KV cache   J·W·kv + R·(W + D)·kv·(1 + 1/layers), kv = 2·layers·kv_heads·head_dim·b
               (the prompts' cache, repeated per sample and grown by the decode; one layer's copy)
    logits     J·vocab·8 + R·vocab·16 (the last positions, then each step's choice)

On this project's CPU the estimate is 1.3-1.9x a batch's measured peak on SmolLM2-135M and the tiny
model with decodes, about 0.9x for a prefill-only batch of the tiny model; with what the allocator keeps
between batches, one call's sampling stays within 1.5x the budget (bench/bounded_requests.py;
tests/service/test_bounded_requests.py holds a /v1 call of 2,048 prompts to 1.5x the budget, plus 150
bytes a prompt token for the call's own data, plus 32 MiB). A single sample whose estimate alone
exceeds the budget is refused at the request's checks (413, naming the numbers), before it is queued.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_DEFAULT_BYTES = 256 << 20
MAX_DEFAULT_CPU_BYTES = 8 << 30


@dataclass(frozen=True)
class Dims:
    """A model's sizes, from its Hugging Face config (a multimodal one's text config)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, config) -> Dims:
        text = getattr(config, "text_config", None) or config
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        return cls(
            hidden=hidden,
            heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
            inter=int(getattr(text, "intermediate_size", None) or 4 * hidden),
            layers=int(text.num_hidden_layers),
            vocab=int(text.vocab_size),
        )


@dataclass(frozen=True)
class BatchCost:
    """A model's memory per token while sampling (see the module docstring)."""

    prefill: int  # bytes per prompt token, less its attention row
    attention: int  # bytes per prompt token per padded prompt token (heads × dtype)
    kv: int  # KV-cache bytes per token
    layers: int
    vocab: int
    eager: bool = False  # attention scores materialised even for an unpadded batch

    @classmethod
    def of(cls, config, dtype_bytes: int) -> BatchCost:
        d = Dims.of(config)
        b = dtype_bytes
        return cls(
            prefill=b * (4 * d.hidden + 2 * (d.heads + 2 * d.kv_heads) * d.head_dim + 3 * d.inter),
            attention=b * d.heads,
            kv=2 * d.layers * d.kv_heads * d.head_dim * b,
            layers=d.layers,
            vocab=d.vocab,
            eager=getattr(config, "_attn_implementation", "eager") == "eager",
        )

    def bytes(
        self,
        *,
        prompts: int,
        width: int,
        rows: int,
        decode: int,
        logprob_tokens: int = 0,
        padded: bool = True,
    ) -> int:
        """The estimate for ``prompts`` prompts padded to ``width`` tokens (``padded``: of different
        lengths), ``rows`` samples decoding up to ``decode`` tokens, and ``logprob_tokens`` prompt
        positions whose logits are kept (for prompt logprobs)."""
        tokens = prompts * width
        scores = self.attention * width if (padded or self.eager) else 0
        prefill = tokens * (self.prefill + scores) + logprob_tokens * self.vocab * 12
        cache = tokens * self.kv + rows * (width + decode) * self.kv * (self.layers + 1) // self.layers
        logits = prompts * self.vocab * 8 + rows * self.vocab * 16
        return prefill + cache + logits


def cost_of(base) -> BatchCost:
    """The served model's :class:`BatchCost` (``base``: a models.loading.BaseModel)."""
    return BatchCost.of(base.model.config, base.dtype.itemsize)


def default_batch_bytes(device_type: str, free: int | None) -> int:
    """OPENRL_SAMPLE_BATCH_BYTES when unset: a quarter of what is free on a GPU once the models are
    loaded, an eighth of the available host memory on the CPU (at most 8 GiB: more only waits longer
    for one batch), never under 256 MiB."""
    if free is None:
        return 1 << 30
    if device_type == "cuda":
        return max(MIN_DEFAULT_BYTES, free // 4)
    return max(MIN_DEFAULT_BYTES, min(MAX_DEFAULT_CPU_BYTES, free // 8))


@dataclass(frozen=True)
class Piece:
    """Samples ``first_row`` .. ``first_row + rows - 1`` of job ``job`` of a call."""

    job: int
    first_row: int
    rows: int


def plan(jobs: list, cost: BatchCost, limit: int) -> list[list[Piece]]:
    """The call's jobs (SampleJob) as batches whose estimate is within ``limit``, in order: whole jobs
    while they fit, a job's samples split across batches where they do not. A single sample over the
    limit gets a batch of its own (the request's checks refuse those before they reach here)."""
    batches: list[list[Piece]] = []
    current: list[Piece] = []
    width = rows = decode = 0  # the current batch's
    shortest, asks_any = 1 << 62, False

    def asks(job, first_row: int) -> bool:
        return first_row == 0 and bool(job.prompt_logprobs or job.topk_prompt_logprobs)

    def fits(job, first_row: int, n: int) -> bool:
        wide = max(width, len(job.prompt))
        prompts = len(current) + 1
        kept = asks_any or asks(job, first_row)  # then every position's logits are kept
        return (
            cost.bytes(
                prompts=prompts,
                width=wide,
                rows=rows + n,
                decode=max(decode, job.params.max_tokens or 0),
                logprob_tokens=(len(job.prompt) if prompts == 1 else prompts * wide) if kept else 0,
                padded=min(shortest, len(job.prompt)) != wide,
            )
            <= limit
        )

    for j, job in enumerate(jobs):
        start = 0
        while start < job.num_samples:
            left = job.num_samples - start
            if fits(job, start, left):
                take = left
            else:  # the most rows that fit beside what the batch holds (binary search)
                lo, hi = 0, left - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if fits(job, start, mid):
                        lo = mid
                    else:
                        hi = mid - 1
                take = lo
            if take == 0 and current:  # full: this job starts the next batch
                batches.append(current)
                current, width, rows, decode, shortest, asks_any = [], 0, 0, 0, 1 << 62, False
                continue
            take = max(take, 1)  # one sample over the limit: alone
            asks_any = asks_any or asks(job, start)
            current.append(Piece(j, start, take))
            width, rows = max(width, len(job.prompt)), rows + take
            shortest = min(shortest, len(job.prompt))
            decode = max(decode, job.params.max_tokens or 0)
            start += take
            if start < job.num_samples:  # the batch is full
                batches.append(current)
                current, width, rows, decode, shortest, asks_any = [], 0, 0, 0, 1 << 62, False
    if current:
        batches.append(current)
    return batches
