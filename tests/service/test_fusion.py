"""Cross-run batching primitives: a fused pass over several runs equals running them one after another.

Works on the Trainer and TorchSampler directly (float32 CPU, the tiny model): per-row LoRA routing,
``Trainer.forward_backward_fused`` (losses, per-token logprobs, ratio stats and gradients within the
tolerance measured for the fused path, tests/_support/numerics.py; each run's ``optim_step`` equal to
AdamW in float64 from its gradient) and ``TorchSampler.sample_many``
(mixed adapters, incl. the base model, give the same greedy tokens as per-adapter sampling).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from openrl_service.models.loading import load_base_model
from openrl_service.sampling.base import SampleJob, SamplingParams
from openrl_service.sampling.torch_sampler import TorchSampler
from openrl_service.training.lora import LoraSpec
from openrl_service.training.losses import check_loss
from openrl_service.training.optim_params import AdamParams
from openrl_service.training.trainer import DatumArrays, Trainer
from tests._support.numerics import (
    GRADS_ATOL_OF_MAX,
    LOGPROBS_ATOL,
    LOSS_RTOL,
    STATS_RTOL,
    adamw_in_float64,
    assert_weights_match,
)

RTOL = 1e-5  # logits of routed rows vs each adapter alone


@pytest.fixture(scope="module")
def base(tiny_model_dir, tmp_path_factory):
    return load_base_model(
        str(tiny_model_dir), data_dir=tmp_path_factory.mktemp("fusion"), name="openrl/tiny", device="cpu"
    )


def ce_data(rng, n, weighted=True):
    out = []
    for _ in range(n):
        length = int(rng.integers(4, 40))
        w = rng.uniform(0, 1, length) if weighted else np.ones(length)
        out.append(
            DatumArrays(
                rng.integers(0, 256, length),
                {"target_tokens": rng.integers(0, 256, length), "weights": w.astype(np.float32)},
            )
        )
    return out


def rl_data(rng, n):
    out = []
    for _ in range(n):
        length = int(rng.integers(4, 40))
        adv = rng.normal(size=length).astype(np.float32)
        adv[: length // 3] = 0.0  # a prompt part without advantage
        out.append(
            DatumArrays(
                rng.integers(0, 256, length),
                {
                    "target_tokens": rng.integers(0, 256, length),
                    "logprobs": rng.uniform(-7, -4, length).astype(np.float32),
                    "advantages": adv,
                },
            )
        )
    return out


def nudge(trainer, state, rng, lr=1e-2):
    """A few SFT steps, so B != 0 and each adapter actually changes the model."""
    for _ in range(2):
        trainer.forward_backward(state, ce_data(rng, 2), "cross_entropy", {}, forward_only=False)
        trainer.optim_step(state, AdamParams(learning_rate=lr))


def three_runs(trainer, seed=0):
    rng = np.random.default_rng(seed)
    states = [trainer.new_state(LoraSpec(rank=r), seed=s) for r, s in ((8, 1), (4, 2), (8, 3))]
    for st in states:
        nudge(trainer, st, rng)
    calls = [
        (ce_data(rng, 3), "cross_entropy", {}),
        (rl_data(rng, 4), "importance_sampling", {}),
        (rl_data(rng, 2), "ppo", check_loss("ppo", {})),
    ]
    return states, calls


def clone_states(trainer, states):
    out = []
    for st in states:
        twin = trainer.state_for(st.adapter.snapshot())
        for p in twin.adapter.parameters():
            p.requires_grad_(True)
        twin.optimizer.load_state_dict(copy.deepcopy(st.optimizer.state_dict()))  # own Adam moments
        twin.steps = st.steps
        out.append(twin)
    return out


def assert_results_equal(fused, solo):
    """Within the fused path's measured tolerance (tests/_support/numerics.py)."""
    assert fused.tokens == solo.tokens
    assert fused.loss == pytest.approx(solo.loss, rel=LOSS_RTOL, abs=0)
    for a, b in zip(fused.logprobs, solo.logprobs, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=LOGPROBS_ATOL)
    assert (fused.stats is None) == (solo.stats is None)
    for k, v in (solo.stats or {}).items():
        assert fused.stats[k] == pytest.approx(v, rel=STATS_RTOL, abs=1e-12), k


def assert_grads_close(a_list, b_list):
    """Each element within GRADS_ATOL_OF_MAX × the tensor's largest magnitude: elements that are sums
    of cancelling terms carry float32 reassociation noise on the tensor's scale."""
    for a, b in zip(a_list, b_list, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=GRADS_ATOL_OF_MAX * float(b.detach().abs().max()))


@pytest.mark.parametrize("microbatch_tokens", [16384, 64])
def test_fused_training_equals_runs_in_turn(base, microbatch_tokens):
    trainer = Trainer(base)
    trainer.microbatch_tokens = microbatch_tokens  # 64: several mixed micro-batches per pass
    fused_states, calls = three_runs(trainer)
    solo_states = clone_states(trainer, fused_states)

    solo = [
        trainer.forward_backward(st, *c, forward_only=False) for st, c in zip(solo_states, calls, strict=True)
    ]
    fused = trainer.forward_backward_fused([(st, *c) for st, c in zip(fused_states, calls, strict=True)])
    for f, s in zip(fused, solo, strict=True):
        assert_results_equal(f, s)
    for f, s in zip(fused_states, solo_states, strict=True):
        assert f.pending_backward == s.pending_backward == 1
        assert_grads_close([p.grad for p in f.adapter.parameters()], [p.grad for p in s.adapter.parameters()])

    # Per-run grad clipping and optimizer: the second run clips, the others do not.
    adams = [
        AdamParams(learning_rate=1e-3),
        AdamParams(learning_rate=2e-3, grad_clip_norm=1e-3),
        AdamParams(),
    ]
    for f, s, adam in zip(fused_states, solo_states, adams, strict=True):
        expected = adamw_in_float64(f, adam)  # from the gradient compared above
        mf, ms = trainer.optim_step(f, adam), trainer.optim_step(s, adam)
        assert mf["grad_norm:mean"] == pytest.approx(ms["grad_norm:mean"], rel=GRADS_ATOL_OF_MAX)
        assert_weights_match(f.adapter.parameters(), expected, adam.learning_rate)


def test_fused_gradients_stay_with_their_run(base):
    """A run's gradient from a fused pass equals its gradient computed alone, bit for bit in isolation:
    rows of other runs contribute nothing, and accumulation across calls still adds up."""
    trainer = Trainer(base)
    (a, b, c), calls = three_runs(trainer, seed=5)
    trainer.forward_backward(a, *calls[0], forward_only=False)  # an earlier call's gradient is kept
    before = [p.grad.clone() for p in a.adapter.parameters()]
    twin = clone_states(trainer, [a])[0]
    only_a = trainer.forward_backward(twin, *calls[1], forward_only=False)
    fused = trainer.forward_backward_fused([(a, *calls[1]), (b, *calls[2]), (c, *calls[0], True)])
    assert_results_equal(fused[0], only_a)
    assert a.pending_backward == 2 and b.pending_backward == 1 and c.pending_backward == 0
    assert all(p.grad is None for p in c.adapter.parameters())  # forward-only: no gradient
    assert_grads_close(
        [p.grad for p in a.adapter.parameters()],
        [g0 + p.grad for g0, p in zip(before, twin.adapter.parameters(), strict=True)],
    )


def test_fused_forward_with_base_model_rows(base):
    trainer = Trainer(base)
    (a, b, _), calls = three_runs(trainer, seed=7)
    solo_base = trainer.forward_backward(None, *calls[0], forward_only=True)
    solo_a = trainer.forward_backward(a, *calls[1], forward_only=True)
    fused = trainer.forward_backward_fused([(None, *calls[0], True), (a, *calls[1], True)])
    assert_results_equal(fused[0], solo_base)
    assert_results_equal(fused[1], solo_a)
    with pytest.raises(ValueError):
        trainer.forward_backward_fused([(None, *calls[0]), (b, *calls[1])])


def test_failed_fused_pass_leaves_every_runs_gradients_untouched(base):
    trainer = Trainer(base)
    trainer.microbatch_tokens = 64  # earlier micro-batches have run backward when the last one fails
    (a, b, c), calls = three_runs(trainer, seed=9)
    trainer.forward_backward(a, *calls[0], forward_only=False)
    before = [p.grad.clone() for p in a.adapter.parameters()]
    short = rl_data(np.random.default_rng(0), 1)[0]
    bad = DatumArrays(short.tokens[:2], {"target_tokens": short.inputs["target_tokens"][:2]})  # no advantages
    with pytest.raises(KeyError):
        trainer.forward_backward_fused([(a, *calls[0]), (b, [bad], *calls[1][1:]), (c, *calls[2])])
    assert all(
        torch.equal(p.grad, g) for p, g in zip(a.adapter.parameters(), before, strict=True)
    )  # restored
    assert all(p.grad is None for st in (b, c) for p in st.adapter.parameters())
    assert a.pending_backward == 1 and b.pending_backward == 0 and c.pending_backward == 0


def test_single_item_fused_is_forward_backward(base):
    trainer = Trainer(base)
    (a, _, _), calls = three_runs(trainer, seed=11)
    twin = clone_states(trainer, [a])[0]
    solo = trainer.forward_backward(twin, *calls[1], forward_only=False)
    (fused,) = trainer.forward_backward_fused([(a, *calls[1])])
    assert fused.loss == solo.loss
    for x, y in zip(fused.logprobs, solo.logprobs, strict=True):
        np.testing.assert_array_equal(x, y)
    for p, q in zip(a.adapter.parameters(), twin.adapter.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


# -- sampling ----------------------------------------------------------------------------------------
def adapters_for_sampling(base):
    trainer = Trainer(base)
    states, _ = three_runs(trainer, seed=13)
    return [st.adapter.snapshot() for st in states]


def jobs_for(adapters, **params):
    prompts = [list(b"Once upon a time"), list(b"ab"), list(b"The cat sat on"), list(b"Hello, world")]
    adapters = [adapters[0], None, adapters[1], adapters[2], adapters[0]]
    jobs = []
    for i, adapter in enumerate(adapters):
        jobs.append(
            SampleJob(
                prompt=prompts[i % len(prompts)],
                num_samples=1 + i % 3,
                params=SamplingParams(max_tokens=6 + 2 * i, **params),
                adapter=adapter,
            )
        )
    return jobs


def test_mixed_adapter_greedy_sampling_equals_per_adapter(base):
    sampler = TorchSampler(base)
    jobs = jobs_for(adapters_for_sampling(base), temperature=0.0)
    jobs[1].prompt_logprobs = True
    jobs[2].topk_sample_logprobs = 3
    jobs[3].params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(ord(" "),))
    solo = [sampler.sample(j) for j in jobs]
    shapes = []
    hook = base.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        mixed = sampler.sample_many(jobs)
    finally:
        hook.remove()
    assert shapes[0] == (len(jobs), max(len(j.prompt) for j in jobs))  # one prefill for all jobs
    assert shapes[1][0] == sum(j.num_samples for j in jobs)  # then one decode batch for every sample
    assert len({tuple(s.sequences[0].tokens) for s in solo}) > 1  # the adapters really differ
    for m, s in zip(mixed, solo, strict=True):
        assert m.tokens == s.tokens
        assert [q.tokens for q in m.sequences] == [q.tokens for q in s.sequences]
        assert [q.stop_reason for q in m.sequences] == [q.stop_reason for q in s.sequences]
        for mq, sq in zip(m.sequences, s.sequences, strict=True):
            np.testing.assert_allclose(mq.logprobs, sq.logprobs, rtol=1e-4, atol=1e-4)
            if sq.topk_ids is not None:
                np.testing.assert_array_equal(mq.topk_ids, sq.topk_ids)
        if s.prompt_logprobs is not None:
            np.testing.assert_allclose(m.prompt_logprobs, s.prompt_logprobs, rtol=1e-4, atol=1e-4)


def test_mixed_adapter_seeded_sampling_equals_per_adapter(base):
    sampler = TorchSampler(base)
    jobs = jobs_for(adapters_for_sampling(base), temperature=1.0, seed=42)
    solo = [sampler.sample(j) for j in jobs]
    mixed = sampler.sample_many(jobs)
    for m, s in zip(mixed, solo, strict=True):
        assert [q.tokens for q in m.sequences] == [q.tokens for q in s.sequences]


def test_fused_mixes_token_and_topk_targets(base):
    """One run's cross_entropy over [N, K] targets shares a micro-batch with [N]-target runs."""
    trainer = Trainer(base)
    states, calls = three_runs(trainer, seed=17)
    rng = np.random.default_rng(17)
    multi = []
    for _ in range(3):
        n = int(rng.integers(4, 30))
        multi.append(
            DatumArrays(
                rng.integers(0, 256, n),
                {
                    "target_tokens": rng.integers(0, 256, (n, 3)),
                    "weights": rng.uniform(0, 1, (n, 3)).astype(np.float32),
                },
            )
        )
    calls[0] = (multi, "cross_entropy", {})
    twins = clone_states(trainer, states)
    solo = [trainer.forward_backward(st, *c, forward_only=False) for st, c in zip(twins, calls, strict=True)]
    fused = trainer.forward_backward_fused([(st, *c) for st, c in zip(states, calls, strict=True)])
    for f, s in zip(fused, solo, strict=True):
        assert_results_equal(f, s)
    for f, s in zip(states, twins, strict=True):
        assert_grads_close([p.grad for p in f.adapter.parameters()], [p.grad for p in s.adapter.parameters()])


@pytest.mark.parametrize("layout", ["blocks", "interleaved", "mixed"])
def test_row_routing_equals_each_adapter_alone(base, layout):
    """Rows routed to [a, a, b, None] (blocks: sliced updates), [a, b, a, None] (interleaved: gathered
    and scattered) or [a, b, c, b] (a and c are blocks, b is not: all gathered) give each row the logits
    of its adapter applied to that row alone."""
    trainer = Trainer(base)
    rng = np.random.default_rng(5)
    a, b = (trainer.new_state(LoraSpec(rank=r), seed=s) for r, s in ((8, 1), (4, 2)))
    nudge(trainer, a, rng)
    nudge(trainer, b, rng)
    c = trainer.new_state(LoraSpec(rank=8), seed=3)
    nudge(trainer, c, rng)
    adapters = {
        "blocks": [a.adapter, a.adapter, b.adapter, None],
        "interleaved": [a.adapter, b.adapter, a.adapter, None],
        "mixed": [a.adapter, b.adapter, c.adapter, b.adapter],
    }[layout]
    ids = torch.as_tensor(rng.integers(0, 256, (4, 12)))
    with torch.no_grad(), base.router.use_rows(adapters):
        groups = base.router.groups
        mixed = base.model(input_ids=ids, use_cache=False).logits
    assert all(g.span is not None for g in groups) == (layout == "blocks")
    for r, adapter in enumerate(adapters):
        with torch.no_grad(), base.router.use(adapter):
            alone = base.model(input_ids=ids[r : r + 1], use_cache=False).logits[0]
        torch.testing.assert_close(mixed[r], alone, rtol=RTOL, atol=1e-5)


def test_streamed_tokens_are_each_rows_tokens_in_order_alone_and_batched(base):
    """``on_token`` hears every chosen token, row by row, in order: what a streamed reply sends as it
    decodes (one job alone, several jobs in one batch, and a job split over batches)."""
    sampler = TorchSampler(base)
    heard: dict[tuple[int, int], list[int]] = {}

    def hook(j):
        return lambda row, tok: heard.setdefault((j, row), []).append(tok)

    jobs = [
        dataclasses.replace(j, on_token=hook(i))
        for i, j in enumerate(jobs_for(adapters_for_sampling(base), temperature=1.0, seed=7))
    ]
    (alone,) = [sampler.sample(jobs[0])]
    assert {k: v for k, v in heard.items() if k[0] == 0} == {
        (0, r): s.tokens for r, s in enumerate(alone.sequences)
    }
    heard.clear()
    mixed = sampler.sample_many(jobs)
    assert heard == {(j, r): s.tokens for j, out in enumerate(mixed) for r, s in enumerate(out.sequences)}
    heard.clear()
    saved, base.sample_batch_bytes = base.sample_batch_bytes, 1  # every row a batch of its own
    try:
        split = sampler.sample_many([jobs[2]])
    finally:
        base.sample_batch_bytes = saved
    assert len(split[0].sequences) == 3  # rows keep their numbers across the pieces
    assert heard == {(2, r): s.tokens for r, s in enumerate(split[0].sequences)}
