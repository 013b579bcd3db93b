"""Multi-turn environments through the Python API against the real service: a tinker-cookbook-style
token ``Env`` (written with ``tinker.ModelInput``) trains, a message environment's tool calls and
malformed calls are observations, an environment that raises or hangs fails its episodes as a failing
reward does, and bad options are refused naming them."""

from __future__ import annotations

import asyncio
import time

import pytest
import tinker

from openrl_jupyter import UsageError
from openrl_jupyter import session as sess
from openrl_jupyter.env import Env, MessageStepResult, ModelInput, StepResult, ToolEnv, envs
from openrl_jupyter.run import RunPaused, RunState
from tests._support.runs import PROMPTS, SMALL, forget_runs
from tests.conftest import ALICE_KEY

FOLLOW_UP = list(b"\n<|user|>again:\n")


@pytest.fixture
def session(server):
    s = sess.connect(server.url, token=ALICE_KEY, name="envs")
    yield s
    forget_runs(s)
    sess.disconnect("envs")


class TwoTurns(Env):
    """A cookbook-shaped token environment (tinker.ModelInput, as cookbook environments write it): the
    prompt, the model's turn, a follow-up the environment appends, a second turn; reward: the share of
    letters in what the model wrote."""

    def __init__(self, prompt: str, info: dict):
        self.prompt = list(prompt.encode())
        self.said: list[int] = []

    async def initial_observation(self):
        return tinker.ModelInput.from_ints(self.prompt), [10]  # a newline ends a turn

    async def step(self, action, *, extra=None):
        self.said += action
        text = bytes(t for t in action if t < 256).decode("utf-8", "replace")
        reward = sum(c.isalpha() for c in text) / max(1, len(text))
        if len(self.said) == len(action):  # the first turn: ask again
            ob = tinker.ModelInput.from_ints(self.prompt + self.said + FOLLOW_UP)
            return StepResult(reward, False, ob, [10], metrics={"tool_calls": 1})
        return StepResult(reward, True, tinker.ModelInput.from_ints([]), [10])


def test_a_cookbook_style_env_trains_on_two_turns_per_episode(session):
    run = session.train(env=TwoTurns, prompts=PROMPTS, steps=2, max_turns=4, name="two-turns", **SMALL)
    run.wait(300)
    assert run.state == RunState.FINISHED
    rows = run.history
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["turns"] == 2.0 and row["tool_calls"] == 1.0 and row["tool_errors"] == 0.0
        assert row["n"] == SMALL["batch"] * SMALL["group"] and row["trained"] > 0
        assert row["reward_name"] == "TwoTurns" and 0.0 <= row["reward_mean"] <= 2.0
    episodes = run.episodes()
    assert len(episodes) == SMALL["batch"] * SMALL["group"]
    for ep in episodes:
        first, second = ep.turns
        # the second observation is the first, the model's turn, then the environment's tokens
        assert second.observation == first.observation + first.tokens + FOLLOW_UP
        assert ep.reward == pytest.approx(first.reward + second.reward)
    frame = run.to_pandas()
    assert {"turns", "tool_calls", "tool_errors", "reward_mean"} <= set(frame.columns)


def test_an_environment_that_raises_or_hangs_fails_its_episodes_like_a_reward(session):
    class Broken(Env):
        def __init__(self, prompt, info):
            pass

        async def initial_observation(self):
            return ModelInput.from_ints(list(b"hi")), [10]

        async def step(self, action, *, extra=None):
            raise ZeroDivisionError("the env divided by zero")

    run = session.train(env=Broken, prompts=PROMPTS, steps=2, name="broken-env", **SMALL)
    with pytest.raises(RunPaused):
        run.wait(120)
    failure = run.reward_failure
    assert failure is not None and failure.kind == "environment" and failure.paused
    assert "ZeroDivisionError: the env divided by zero" in failure.error
    assert "environment Broken v1 failed" in failure.text()
    run.stop()

    class Slow(Env):
        def __init__(self, prompt, info):
            pass

        async def initial_observation(self):
            return ModelInput.from_ints(list(b"hi")), [10]

        async def step(self, action, *, extra=None):
            await asyncio.sleep(30)

    t0 = time.monotonic()
    slow = session.train(env=Slow, prompts=PROMPTS, steps=1, step_timeout_s=0.5, name="slow-env", **SMALL)
    with pytest.raises(RunPaused):
        slow.wait(120)
    assert "took longer than step_timeout_s" in slow.reward_failure.error
    assert time.monotonic() - t0 < 30  # cut at the timeout, not after the environment's 30 s


def test_a_registered_environment_is_versioned_and_options_are_checked(session):
    envs.register("twice", TwoTurns)
    v2 = envs.register("twice", TwoTurns)
    assert v2.version == 2 and envs.latest("twice") is v2
    with pytest.raises(UsageError, match="not both"):
        session.train(env="twice", reward=lambda p, c, **i: 0.0, prompts=PROMPTS)
    with pytest.raises(UsageError, match="unknown environment 'nope'.*%%openrl env nope"):
        session.train(env="nope", prompts=PROMPTS)
    with pytest.raises(UsageError, match="max_turns"):
        session.train(env="twice", prompts=PROMPTS, max_turns=0)
    with pytest.raises(UsageError, match="max_episode_tokens.*context"):
        session.train(env="twice", prompts=PROMPTS, max_episode_tokens=10**9)
    with pytest.raises(UsageError, match="reward= .*or env="):
        session.train(prompts=PROMPTS)


def test_a_tool_environment_runs_calls_and_shows_malformed_ones_to_the_model():
    """ToolEnv alone (no model): a call runs the tool here, a failing tool and a malformed call become
    tool messages the model reads next, and an answer without a call ends the episode, scored."""

    def lookup(city: str) -> dict:
        if city == "Atlantis":
            raise LookupError("no such city")
        return {"city": city, "sky": "clear"}

    env = ToolEnv(
        "Weather in Paris?",
        tools={"lookup": lookup},
        schemas=[{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
        score=lambda answer, info: float(info["want"] in answer),
        info={"want": "clear"},
    )

    async def play():
        assert (await env.initial_observation())[-1]["content"] == "Weather in Paris?"
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"city": "Paris"}'},
        }
        bad = {
            "id": "c2",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"city": "Atlantis"}'},
        }
        first = await env.step({"role": "assistant", "content": "", "tool_calls": [call, bad]})
        assert not first.episode_done and first.metrics["tool_failures"] == 1
        results = [m["content"] for m in first.next_messages if m["role"] == "tool"]
        assert '"sky": "clear"' in results[0] and "LookupError: no such city" in results[1]
        second = await env.step(
            {"role": "assistant", "content": "", "parse_errors": ["tool call 1: not JSON"]}
        )
        assert (
            not second.episode_done and "error: tool call 1: not JSON" in second.next_messages[-1]["content"]
        )
        last = await env.step({"role": "assistant", "content": "It is clear."})
        assert isinstance(last, MessageStepResult) and last.episode_done and last.reward == 1.0

    asyncio.run(play())


def test_evaluate_scores_a_checkpoint_greedily_on_held_out_rows(session):
    run = session.train(env=TwoTurns, prompts=PROMPTS, steps=1, name="to-evaluate", **SMALL)
    run.wait(300)
    path = run.save("evaluated")
    held_out = ["Name a river:", "Say goodbye:"]
    first = session.evaluate(env=TwoTurns, prompts=held_out, checkpoint=path, max_tokens=8)
    again = session.evaluate(env=TwoTurns, prompts=held_out, checkpoint=path, max_tokens=8)
    assert len(first.episodes) == 2 and first.failed == 0
    # greedy: the same checkpoint plays the same episodes
    assert [ep.reward for ep in first.episodes] == [ep.reward for ep in again.episodes]
    assert [[t.tokens for t in ep.turns] for ep in first.episodes] == [
        [t.tokens for t in ep.turns] for ep in again.episodes
    ]
    frame = first.to_pandas()
    assert list(frame["prompt"]) == held_out and (frame["turns"] == 2).all()
    assert "mean reward" in repr(first) and path in repr(first)
    base = session.evaluate(env=TwoTurns, prompts=held_out, max_tokens=8)
    assert base.checkpoint is None and len(base.episodes) == 2


def test_a_sweep_takes_an_environment(session):
    sweep = session.sweep(
        env=TwoTurns, prompts=PROMPTS, grid={"lr": [1e-4, 3e-4]}, steps=1, save_best=False, **SMALL
    )
    sweep.wait(300)
    assert len(sweep.runs) == 2
    for run in sweep.runs:
        assert run.state == RunState.FINISHED and run.history[-1]["turns"] == 2.0


def test_an_environment_run_takes_the_rl_knobs(session):
    run = session.train(
        env=TwoTurns,
        prompts=PROMPTS,
        steps=2,
        max_turns=4,
        epochs=2,
        loss_agg="sequence",
        lr_schedule="linear",
        top_k=50,
        eval_every=2,
        eval_prompts=["Held out:"],
        save_every=2,
        **SMALL,
    )
    run.wait(300)
    assert run.state == RunState.FINISHED, run.last_error
    rows = run.history
    trained = [r for r in rows if r["trained"]]
    assert trained and all(r["updates"] == 2 for r in trained)
    assert rows[-1]["eval_reward"] is not None and run.best["step"] == 2
    assert run.checkpoints and run.checkpoints[-1].endswith("-step2")
    assert all("skipped_groups" in r for r in rows)


def test_an_environment_runs_rollouts_take_top_k_and_refuse_stop_strings(session):
    run = session.train(
        env=TwoTurns, prompts=PROMPTS, steps=1, max_turns=4, top_k=1, skip_zero_variance=False, **SMALL
    )
    run.wait(300)
    assert run.state == RunState.FINISHED, run.last_error
    by_row: dict = {}
    for ep in run.episodes():
        by_row.setdefault(ep.row, set()).add(tuple(t for turn in ep.turns for t in turn.tokens))
    # top_k=1 reached every turn's sampling: a prompt's episodes are all the same, at temperature 1
    assert by_row and all(len(v) == 1 for v in by_row.values())
    with pytest.raises(UsageError, match="stop is for reward runs"):
        session.train(env=TwoTurns, prompts=PROMPTS, stop=["zz"])
