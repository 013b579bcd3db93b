"""Rewards: versions, per-sample failures, group and async rewards, captured output, no blocking."""

import asyncio
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from openrl_jupyter.rewards import RewardRegistry, registry, reward, score
from openrl_jupyter.session import UsageError


def letters(prompt, completion, **info):
    return sum(c.isalpha() for c in completion) / max(1, len(completion))


def test_registering_again_makes_the_next_version():
    reg = RewardRegistry()
    assert reg.register("letters", letters).version == 1
    v2 = reg.register("letters", lambda p, c, **i: 1.0)
    assert reg.latest("letters") is v2 and v2.version == 2
    with pytest.raises(UsageError, match=r"unknown reward 'nope' \(registered: letters\)"):
        reg.latest("nope")
    with pytest.raises(UsageError, match="identifier"):
        reg.register("bad name", letters)


def test_decorator_registers_in_the_global_registry():
    @reward("decorated_test")
    def r(prompt, completion, **info):
        return 0.5

    assert registry.latest("decorated_test").fn is r


def test_failing_samples_are_marked_with_their_error():
    def flaky(prompt, completion, **info):
        if completion == "boom":
            raise ValueError("cannot score boom")
        return {"nan": math.nan, "text": "high"}.get(completion, len(completion))

    v = RewardRegistry().register("flaky", flaky)
    out = asyncio.run(score(v, ["p"] * 4, ["ok", "boom", "nan", "text"]))
    assert out.rewards == [2.0, None, None, None]
    assert out.errors[0] is None and "ValueError: cannot score boom" in out.errors[1]
    assert "not a finite number" in out.errors[2] and "not a number" in out.errors[3]
    assert not out.all_failed


def test_group_rewards_and_info_fields():
    def reward_group(prompts, completions, infos):
        return [float(info["target"] in c) for c, info in zip(completions, infos, strict=True)]

    v = RewardRegistry().register("grp", reward_group)
    assert v.per_group
    out = asyncio.run(score(v, ["a", "b"], ["has 42", "nothing"], [{"target": "42"}, {"target": "7"}]))
    assert out.rewards == [1.0, 0.0]
    short = RewardRegistry().register("short", lambda ps, cs, infos: [1.0], per_group=True)
    assert asyncio.run(score(short, ["a", "b"], ["x", "y"])).all_failed


def test_async_rewards_are_awaited():
    async def judge(prompt, completion, **info):
        await asyncio.sleep(0)
        return len(completion) / 10

    out = asyncio.run(score(RewardRegistry().register("judge", judge), ["p", "p"], ["abc", "abcdefghij"]))
    assert out.rewards == [0.3, 1.0]


def test_prints_are_captured_per_step_not_leaked(capsys):
    def chatty(prompt, completion, **info):
        print(f"scoring {completion}")
        return 1.0

    out = asyncio.run(score(RewardRegistry().register("chatty", chatty), ["p", "p"], ["x", "y"]))
    assert out.stdout == "scoring x\nscoring y\n"
    assert "scoring" not in capsys.readouterr().out


def test_a_slow_reward_does_not_stall_another_runs_scoring():
    gate = threading.Event()

    def slow(prompt, completion, **info):
        assert gate.wait(30), "hang guard"
        return 0.0

    reg = RewardRegistry()
    slow_v, fast_v = reg.register("slow", slow), reg.register("fast", letters)

    async def main():
        with ThreadPoolExecutor(4) as pool:
            slow_task = asyncio.create_task(score(slow_v, ["p"], ["x"], pool=pool))
            fast = await asyncio.wait_for(score(fast_v, ["p"], ["ab"], pool=pool), timeout=30)
            assert not slow_task.done()  # the slow reward is still running; the fast one finished
            gate.set()
            return fast, await slow_task

    fast, slow_out = asyncio.run(main())
    assert fast.rewards == [1.0] and slow_out.rewards == [0.0]


def test_numpy_scalars_and_bools_are_numbers_and_signatures_are_checked_when_registering():
    import numpy as np

    values = {"a": np.float32(0.25), "b": np.int64(2), "c": True, "d": np.float64(0.5)}
    v = RewardRegistry().register("np", lambda prompt, completion, **info: values[completion])
    out = asyncio.run(score(v, ["p"] * 4, list(values)))
    assert out.rewards == [0.25, 2.0, 1.0, 0.5] and out.errors == [None] * 4
    with pytest.raises(UsageError, match=r"reward\(prompt, completion, \*\*info\) -> float"):
        RewardRegistry().register("bad", lambda completion: 1.0)
    with pytest.raises(UsageError, match=r"reward_group\(prompts, completions, infos\)"):
        RewardRegistry().register("badg", lambda prompts: [1.0], per_group=True)


def test_reward_group_is_called_once_per_prompt_group():
    calls = []

    def reward_group(prompts, completions, infos):
        calls.append(list(prompts))
        best = max(len(c) for c in completions)
        return [float(len(c) == best) for c in completions]

    v = RewardRegistry().register("rank", reward_group)
    out = asyncio.run(score(v, ["a", "a", "b", "b"], ["x", "xx", "yyy", "y"], groups=[[0, 1], [2, 3]]))
    assert calls == [["a", "a"], ["b", "b"]] and out.rewards == [0.0, 1.0, 1.0, 0.0]


def test_async_reward_prints_are_captured_per_step():
    async def reward(prompt, completion, **info):
        print(f"scored {completion}")
        await asyncio.sleep(0)
        return 1.0

    v = RewardRegistry().register("aprint", reward)
    out = asyncio.run(score(v, ["p", "p"], ["one", "two"]))
    assert sorted(out.stdout.splitlines()) == ["scored one", "scored two"]
