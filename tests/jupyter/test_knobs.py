"""The RL knobs of ``train`` (docs/knobs.md) against the real service on loopback, one test per knob, each
showing the knob changes what it should; and the service's limits checked in the cell."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from openrl_jupyter import UsageError
from openrl_jupyter import session as sess
from openrl_jupyter.knobs import aggregated, lr_at, minibatch_plan
from openrl_jupyter.rewards import registry
from openrl_jupyter.run import RunState
from tests._support.runs import PROMPTS, SMALL, forget_runs, letters
from tests.conftest import ALICE_KEY


@pytest.fixture
def session(server):
    s = sess.connect(server.url, token=ALICE_KEY, name="knobs")
    yield s
    forget_runs(s)
    sess.disconnect("knobs")


class Recording(httpx.AsyncHTTPTransport):
    """A real loopback connection that keeps the body of every train_step it sends."""

    def __init__(self):
        super().__init__()
        self.train_steps: list[dict] = []
        self.replies: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path.endswith("/train_step"):
            self.train_steps.append(json.loads(request.content))
            await response.aread()
            self.replies.append(response.json())
        return response


@pytest.fixture
def recorded(server):
    from openrl_jupyter import AsyncClient

    transport = Recording()
    s = sess.connect(server.url, token=ALICE_KEY, name="recorded")
    s._aclient = AsyncClient(server.url, token=ALICE_KEY, transport=transport)
    yield s, transport
    forget_runs(s)
    sess.disconnect("recorded")


def unique(prefix: str) -> str:
    return f"{prefix}_{time.monotonic_ns()}"


def finished(run, timeout=240):
    run.wait(timeout)
    assert run.state == RunState.FINISHED, run.last_error
    return run.history


# -- limits, checked in the cell --------------------------------------------------------------------
def test_options_past_the_services_limits_fail_in_the_cell_naming_the_limit_and_its_setting(session):
    before = len(session.client.list_runs() or [])
    with pytest.raises(UsageError) as e:
        session.train(reward=letters, prompts=PROMPTS, max_tokens=100_000)
    # the tiny model's context (2048) is below OPENRL_MAX_TOKENS (4096): the context is the limit
    assert "max_tokens" in str(e.value) and "2048" in str(e.value) and "context" in str(e.value)
    assert "OPENRL_MAX_TOKENS" in str(e.value)
    with pytest.raises(UsageError, match=r"rank .*\[0, 128\].*OPENRL_MAX_RANK.*got 300"):
        session.train(reward=letters, prompts=PROMPTS, rank=300)
    with pytest.raises(UsageError, match=r"group .*OPENRL_MAX_NUM_SAMPLES.*got 500"):
        session.train(reward=letters, prompts=PROMPTS, group=500)
    # the numbers are the service's own (its capabilities), not the client's guesses
    limits = session.limits[session.model]
    assert limits["max_rank"] == 128 and limits["max_tokens"] == 2048
    for bad, field in (
        ({"kl_coef": -1}, "kl_coef"),
        ({"lr_schedule": "step"}, "lr_schedule"),
        ({"epochs": 0}, "epochs"),
        ({"minibatches": 100}, "minibatches"),
        ({"loss_agg": "mean"}, "loss_agg"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"eval_every": 2}, "eval_prompts"),
        ({"warmup_steps": 60}, "warmup_steps"),
        ({"reward": {"letters_nope": 1.0}}, "letters_nope"),
    ):
        kwargs = {"reward": letters, "prompts": PROMPTS, "steps": 60, **bad}
        with pytest.raises(UsageError, match=field):
            session.train(**kwargs)
    assert len(session.client.list_runs() or []) == before  # nothing was created


# -- the learning-rate schedule ---------------------------------------------------------------------
def test_lr_schedules_warm_up_then_decay_to_their_floor():
    cos = [lr_at(u, 20, lr=1.0, schedule="cosine", warmup=4) for u in range(20)]
    assert cos[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8]) and cos[4] == 1.0
    assert all(a > b for a, b in zip(cos[4:], cos[5:], strict=False))  # decays after the warmup
    assert cos[-1] < 0.01  # to its floor near 0
    lin = [lr_at(u, 10, lr=1.0, schedule="linear", warmup=0) for u in range(10)]
    assert lin == pytest.approx([1 - u / 10 for u in range(10)])
    assert {lr_at(u, 10, lr=0.5, schedule="constant", warmup=0) for u in range(10)} == {0.5}


def test_the_service_applies_the_scheduled_learning_rate_of_every_update(session):
    run = session.train(
        reward=letters, prompts=PROMPTS, steps=5, lr=1e-3, lr_schedule="cosine", warmup_steps=1, **SMALL
    )
    rows = [r for r in finished(run) if r["trained"]]
    assert len(rows) >= 3
    lrs = {r["step"]: r["learning_rate"] for r in rows}  # the service's word: the rate it stepped with
    expected = {s: lr_at(s - 1, 5, lr=1e-3, schedule="cosine", warmup=1) for s in lrs}
    assert lrs == pytest.approx(expected)
    assert lrs.get(1, 0) < 1e-3 and min(lrs.values()) < 0.3e-3


# -- epochs and minibatches -------------------------------------------------------------------------
def test_minibatch_plan_covers_every_sample_once_per_epoch():
    plan = minibatch_plan(10, epochs=2, minibatches=3, seed=1)
    assert len(plan) == 6
    for epoch in (plan[:3], plan[3:]):
        assert sorted(i for part in epoch for i in part) == list(range(10))
    assert plan == minibatch_plan(10, epochs=2, minibatches=3, seed=1)  # a re-sent step trains the same
    assert minibatch_plan(2, epochs=1, minibatches=4, seed=0) == [[0], [1]]


def test_epochs_and_minibatches_take_that_many_optimizer_steps_per_batch(recorded):
    s, transport = recorded
    run = s.train(reward=letters, prompts=PROMPTS, steps=2, epochs=2, minibatches=2, lr=5e-3, **SMALL)
    rows = [r for r in finished(run) if r["trained"]]
    assert rows and all(r["updates"] == 4 for r in rows)
    assert len(transport.train_steps) == 4 * len(rows)
    first = transport.train_steps[:4]
    ids = [sorted(x["sample_id"] for x in body["samples"]) for body in first]
    # each epoch trains every chosen sample once, split in two minibatches
    assert sorted(ids[0] + ids[1]) == sorted(ids[2] + ids[3])
    assert not set(ids[0]) & set(ids[1])
    # the service stepped the optimizer four times per batch: its step counter says so
    assert [r["step"] for r in transport.replies] == list(range(1, 4 * len(rows) + 1))
    # the second epoch's ratio is against the sampler: the first epoch moved the policy
    assert any(abs(r["ratio_max"] - 1) > 1e-3 or abs(r["ratio_min"] - 1) > 1e-3 for r in rows)


# -- loss aggregation -------------------------------------------------------------------------------
def test_sequence_aggregation_weighs_each_sample_the_same_whatever_its_length():
    chosen = [{"sample_id": "a", "advantage": 1.0}, {"sample_id": "b", "advantage": 1.0}]
    assert aggregated(chosen, [2, 6], "token") == chosen
    seq = aggregated(chosen, [2, 6], "sequence")
    # advantage × tokens (each sample's total weight) is the same for both, at the batch's scale
    assert seq[0]["advantage"] * 2 == pytest.approx(seq[1]["advantage"] * 6) == pytest.approx(4.0)


def test_loss_agg_sequence_sends_length_weighted_advantages(recorded):
    s, transport = recorded
    # stop strings make the completions' lengths differ, which is what sequence weighting is about
    options = {**SMALL, "max_tokens": 16, "stop": ["e", " "], "skip_zero_variance": False, "seed": 5}
    finished(s.train(reward=letters, prompts=PROMPTS, steps=2, **options))
    token_bodies = list(transport.train_steps)
    transport.train_steps.clear()
    finished(s.train(reward=letters, prompts=PROMPTS, steps=2, loss_agg="sequence", **options))
    sequence_bodies = list(transport.train_steps)
    assert token_bodies and sequence_bodies
    tok = [abs(x["advantage"]) for b in token_bodies for x in b["samples"]]
    seq = [abs(x["advantage"]) for b in sequence_bodies for x in b["samples"]]
    # letters() is in [0, 1], so group-relative advantages are at most 1; weighting by mean length /
    # length (same seed, so the same samples) scales them by more than 1 for the short ones
    assert max(tok) <= 1.0 + 1e-9
    assert sorted(round(a, 6) for a in seq) != sorted(round(a, 6) for a in tok)


# -- zero-variance groups -------------------------------------------------------------------------
def test_zero_variance_groups_are_replaced_by_fresh_prompts_and_counted(session):
    flat = [{"prompt": p, "flat": True} for p in PROMPTS]
    moving = [{"prompt": p + " now", "flat": False} for p in PROMPTS]

    def reward(prompt, completion, flat=False, **info):
        return 0.5 if flat else letters(prompt, completion)

    run = session.train(reward=reward, prompts=flat + moving, steps=3, seed=3, **SMALL)
    rows = finished(run)
    drawn = SMALL["batch"] * SMALL["group"]
    assert sum(r["skipped_groups"] for r in rows) > 0
    refilled = [r for r in rows if r["n"] > drawn]
    assert refilled and all(r["n"] <= 2 * drawn for r in rows)
    off = session.train(
        reward=reward, prompts=flat + moving, steps=3, seed=3, skip_zero_variance=False, **SMALL
    )
    rows = finished(off)
    assert all(r["n"] == drawn for r in rows) and sum(r["skipped_groups"] for r in rows) > 0


# -- several rewards, weighted --------------------------------------------------------------------
def test_several_weighted_rewards_log_each_beside_the_weighted_total(session):
    short, lettered = unique("short"), unique("lettered")
    registry.register(short, lambda prompt, completion, **info: 1.0 / (1 + len(completion)))
    registry.register(lettered, letters)
    run = session.train(reward={lettered: 1.0, short: 0.5}, prompts=PROMPTS, steps=2, **SMALL)
    frame = run.to_pandas()
    finished(run)
    frame = run.to_pandas()
    assert f"rewards/{lettered}" in frame and f"rewards/{short}" in frame
    for _, row in frame.iterrows():
        total = row[f"rewards/{lettered}"] + 0.5 * row[f"rewards/{short}"]
        assert row["reward_mean"] == pytest.approx(total)
        assert row["reward_name"] == f"{lettered}+{short}"
    # stored with the run: an attached view draws the same columns
    stored = session.client.metrics(run.run_id)
    assert stored[-1][f"rewards/{short}"] == pytest.approx(frame.iloc[-1][f"rewards/{short}"])


# -- datasets -------------------------------------------------------------------------------------
def test_prompts_from_a_dataset_and_from_a_saved_split_reach_rewards_with_their_columns(session, tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets is in the test extra")
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS, "answer": ["red", "hi", "word", "Paris"]})
    seen = []

    def reward(prompt, completion, answer="", **info):
        seen.append((prompt, answer))
        return letters(prompt, completion)

    finished(session.train(reward=reward, prompts=ds, steps=1, **SMALL))
    assert seen and all(dict(zip(PROMPTS, ds["answer"], strict=True))[p] == a for p, a in seen)
    ds.save_to_disk(tmp_path / "train")
    seen.clear()
    finished(session.train(reward=reward, prompts=str(tmp_path / "train"), steps=1, **SMALL))
    assert seen
    with pytest.raises(UsageError, match="DatasetDict"):
        session.train(reward=reward, prompts=datasets.DatasetDict({"train": ds}))
    with pytest.raises(UsageError, match='"prompt" column'):
        session.train(reward=reward, prompts=ds.rename_column("prompt", "question"))


# -- periodic evaluation and checkpoints ----------------------------------------------------------
def test_eval_every_scores_held_out_prompts_and_keeps_the_best_checkpoint(session):
    calls = []

    def exact(prompt, completion, **info):
        calls.append(prompt)
        return letters(prompt, completion)

    held_out = ["Name a fruit:", "Say goodbye:"]
    run = session.train(
        reward=letters,
        prompts=PROMPTS,
        steps=4,
        eval_every=2,
        eval_prompts=held_out,
        eval_metric=exact,
        save_every=2,
        **SMALL,
    )
    rows = finished(run)
    evals = {r["step"]: r["eval_reward"] for r in rows if "eval_reward" in r}
    assert set(evals) == {2, 4} and set(calls) == set(held_out)
    assert run.best["eval_reward"] == max(evals.values()) and run.best["step"] in evals
    assert run.best["path"].endswith(f"{run.name}-best")
    assert [p.rsplit("/", 1)[-1] for p in run.checkpoints] == [f"{run.name}-step2", f"{run.name}-step4"]
    # the best checkpoint is a real one: a new run starts from it
    assert finished(
        session.train(reward=letters, prompts=PROMPTS, steps=1, load_from=run.best["path"], **SMALL)
    )


# -- rollout sampling -------------------------------------------------------------------------------
def test_top_k_one_and_stop_strings_shape_the_rollouts(session):
    run = session.train(
        reward=letters, prompts=PROMPTS, steps=1, top_k=1, temperature=1.0, skip_zero_variance=False, **SMALL
    )
    finished(run)
    by_prompt = {}
    for s in run.samples(SMALL["batch"] * SMALL["group"]):
        by_prompt.setdefault(s["prompt"], set()).add(s["completion"])
    assert by_prompt and all(
        len(v) == 1 for v in by_prompt.values()
    )  # top_k=1: greedy, whatever the temperature
    free = session.train(reward=letters, prompts=PROMPTS, steps=1, skip_zero_variance=False, **SMALL)
    finished(free)
    assert any(len({s["completion"] for s in free.samples(8) if s["prompt"] == p}) > 1 for p in PROMPTS)
    stopped = session.train(
        reward=letters, prompts=PROMPTS, steps=2, stop=["e", "a"], skip_zero_variance=False, **SMALL
    )
    finished(stopped)
    texts = [s["completion"] for s in stopped.samples(16)]
    assert texts and not any("e" in t or "a" in t for t in texts)


# -- KL to the reference ----------------------------------------------------------------------------
def test_kl_coef_reports_the_kl_to_the_starting_weights_and_it_grows_as_the_policy_moves(session):
    run = session.train(reward=letters, prompts=PROMPTS, steps=4, kl_coef=0.5, lr=2e-2, **SMALL)
    rows = [r for r in finished(run) if r["trained"]]
    kls = [r["kl_ref"] for r in rows]
    assert all(k is not None and k >= 0 for k in kls)
    assert kls[0] < 1e-3 and max(kls[1:]) > kls[0]  # step 1 samples the reference itself
    plain = session.train(reward=letters, prompts=PROMPTS, steps=1, **SMALL)
    assert all(r["kl_ref"] is None for r in finished(plain))
    assert not math.isnan(rows[-1]["loss"])


class RefuseSecondUpdate(Recording):
    """Refuses (400) the second train_step it is asked to send, as a service refuses a step whose
    reference checkpoint was overwritten; the others go through."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/train_step") and len(self.train_steps) == 1:
            self.train_steps.append({"refused": True})
            return httpx.Response(400, json={"detail": "refused for this test", "field": "kl_coef"})
        return await super().handle_async_request(request)


def test_a_refused_later_update_ends_the_step_with_the_updates_applied_not_twice(server):
    from openrl_jupyter import AsyncClient

    transport = RefuseSecondUpdate()
    s = sess.connect(server.url, token=ALICE_KEY, name="refusing")
    s._aclient = AsyncClient(server.url, token=ALICE_KEY, transport=transport)
    try:
        logs = []
        run = s.train(reward=letters, prompts=PROMPTS, steps=2, epochs=2, skip_zero_variance=False, **SMALL)
        run.subscribe(lambda e: logs.append(e.get("text") or ""))
        rows = [r for r in finished(run) if r["trained"]]
        # the first trained step kept its one applied update, the next took both; nothing was sent twice
        assert rows and rows[0]["updates"] == 1 and all(r["updates"] == 2 for r in rows[1:])
        assert [r["step"] for r in transport.replies] == list(range(1, sum(r["updates"] for r in rows) + 1))
        assert any("update 2 of 2 was refused" in line for line in logs)
    finally:
        forget_runs(s)
        sess.disconnect("refusing")


def test_a_refill_whose_samples_all_fail_does_not_pause_a_step_that_scored(session):
    calls = []

    def reward(prompt, completion, **info):
        calls.append(prompt)
        if len(calls) <= SMALL["group"]:
            return 0.5  # the first prompt's group: flat, so it is replaced
        if len(calls) <= 2 * SMALL["group"]:
            return float(len(calls))  # the second's: spread
        raise ValueError("the refill's prompts break this reward")

    run = session.train(reward=reward, prompts=PROMPTS, steps=1, **SMALL)
    (row,) = finished(run)
    group = SMALL["group"]
    assert row["n"] == 3 * group and row["failed"] == group and row["skipped_groups"] == 1
    assert row["trained"] > 0  # the group that spread trains
    assert run.reward_failure is not None and "refill" in run.reward_failure.error


def test_a_step_whose_groups_are_all_flat_is_not_redrawn(session):
    run = session.train(reward=lambda prompt, completion, **info: 0.0, prompts=PROMPTS, steps=2, **SMALL)
    rows = finished(run)
    drawn = SMALL["batch"] * SMALL["group"]
    assert all(r["n"] == drawn and r["skipped_groups"] == SMALL["batch"] and r["trained"] == 0 for r in rows)


def test_a_weighted_rewards_failure_names_the_reward_that_failed_its_sample():
    import asyncio

    from openrl_jupyter.knobs import score_weighted
    from openrl_jupyter.rewards import pinned

    def first(prompt, completion, **info):
        if completion == "b":
            raise RuntimeError("first fails on b")
        return 1.0

    def second(prompt, completion, **info):
        if completion == "a":
            raise RuntimeError("second fails on a")
        return 1.0

    parts = (("first", 1.0, pinned(first)), ("second", 2.0, pinned(second)))
    scored, columns, combined = asyncio.run(
        score_weighted(parts, ["p"] * 3, ["a", "b", "c"], [{}] * 3, groups=[[0, 1, 2]], pool=None)
    )
    assert scored.rewards == [None, None, 3.0]
    failure = scored.failure(run="r", step=1, prompts=["p"] * 3, completions=["a", "b", "c"])
    # the first failing sample is "a", which the second reward failed: the box names it, with its error
    assert failure.reward == "second" and "second fails on a" in failure.error
    assert columns["rewards/first"] == [1.0, None, 1.0] and columns["rewards/second"] == [None, 1.0, 1.0]
    assert combined.name == "first+second"


def test_eval_prompts_without_eval_every_evaluate_once_after_the_last_step(session):
    run = session.train(reward=letters, prompts=PROMPTS, steps=2, eval_prompts=["Held out:"], **SMALL)
    rows = finished(run)
    assert "eval_reward" not in rows[0] and rows[1]["eval_reward"] is not None
    assert run.best["step"] == 2
    with pytest.raises(UsageError, match="eval_metric needs eval_prompts"):
        session.train(reward=letters, prompts=PROMPTS, eval_metric="letters")
    with pytest.raises(UsageError, match=r"len\(eval_prompts\).*OPENRL_MAX_DATUMS"):
        session.train(reward=letters, prompts=PROMPTS, eval_prompts=["x"] * 5000)


def test_a_sweep_gives_every_run_the_knobs_and_sweeps_over_them(session):
    sweep = session.sweep(
        reward=letters,
        prompts=PROMPTS,
        grid={"kl_coef": [0.0, 0.1], "loss_agg": ["token", "sequence"]},
        steps=2,
        epochs=2,
        minibatches=2,
        lr_schedule="linear",
        warmup_steps=1,
        top_p=0.9,
        top_k=20,
        stop=["\n"],
        eval_prompts=["Held out:"],
        save_every=2,
        skip_zero_variance=False,
        **SMALL,
    )
    sweep.wait(300)
    assert len(sweep.runs) == 4
    assert sorted((r.config.knobs.kl_coef, r.config.knobs.loss_agg) for r in sweep.runs) == [
        (0.0, "sequence"),
        (0.0, "token"),
        (0.1, "sequence"),
        (0.1, "token"),
    ]
    for r in sweep.runs:
        k = r.config.knobs
        assert (k.epochs, k.minibatches, k.lr_schedule, k.warmup_steps) == (2, 2, "linear", 1)
        assert (k.top_p, k.top_k, k.stop, k.save_every, k.skip_zero_variance) == (0.9, 20, ("\n",), 2, False)
        assert "-kl" in r.name and r.name.endswith(("-token", "-sequence"))
    finished_runs = [r for r in sweep.runs if r.step == 2]
    assert finished_runs and all(r.history[-1]["eval_reward"] is not None for r in finished_runs)
