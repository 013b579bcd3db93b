"""Background runs through the Python API against the real service on loopback: hot swap, pause,
save, stop, several runs at once, reward failures, and bad arguments."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from openrl_jupyter import OpenRLError
from openrl_jupyter import session as sess
from openrl_jupyter.advantages import group_advantages
from openrl_jupyter.config import load_prompts
from openrl_jupyter.rewards import registry
from openrl_jupyter.run import RunPaused, RunState
from tests._support.runs import PROMPTS, SMALL, forget_runs, letters
from tests._support.transports import DropReply
from tests.conftest import ALICE_KEY


@pytest.fixture
def session(server):
    s = sess.connect(server.url, token=ALICE_KEY, name="runs")
    yield s
    forget_runs(s)
    sess.disconnect("runs")


def unique(prefix: str) -> str:
    return f"{prefix}_{time.monotonic_ns()}"


def wait_until(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def test_a_run_trains_in_the_background_and_reports_every_step(session):
    name = unique("letters")
    scoring, release = threading.Event(), threading.Event()

    def gated(prompt, completion, **info):
        scoring.set()
        assert release.wait(60)
        return letters(prompt, completion)

    registry.register(name, gated)
    run = session.train(reward=name, prompts=PROMPTS, steps=4, **SMALL)
    try:
        # train() returned while the first step's reward cannot finish: it does not wait for steps
        assert run.step == 0 and run.state in (RunState.STARTING, RunState.RUNNING)
        assert scoring.wait(60) and run.step == 0 and run.state == RunState.RUNNING
    finally:
        release.set()
    run.wait(120)
    assert run.state == RunState.FINISHED and run.step == 4
    rows = run.history
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 0.0 <= r["reward_min"] <= r["reward_mean"] <= r["reward_max"] <= 1.0
        assert r["reward_name"] == name and r["reward_version"] == 1 and r["n"] == 8
        if r["trained"]:
            assert r["loss"] is not None and r["ratio_mean"] == pytest.approx(1.0, abs=0.05)
            assert r["tokens"] > 0 and r["grad_norm"] > 0
    # the step statistics are stored with the run on the service too
    stored = session.client.metrics(run.run_id)
    assert [m["step"] for m in stored] == [1, 2, 3, 4]
    assert stored[-1]["reward_mean"] == pytest.approx(rows[-1]["reward_mean"])
    assert stored[-1]["reward_name"] == name
    latest = run.samples(3)
    assert len(latest) == 3 and all(s["step"] == 4 and s["reward"] is not None for s in latest)
    frame = run.to_pandas()
    assert list(frame.index) == [1, 2, 3, 4] and "reward_mean" in frame
    # step is a column too: selecting it with the metrics works, and so does sorting by it
    picked = frame[["step", "reward_mean"]]
    assert (
        picked["step"].tolist() == [1, 2, 3, 4]
        and picked.loc[3, "reward_mean"] == run.history[2]["reward_mean"]
    )
    assert frame.sort_values("step", ascending=False)["step"].tolist() == [4, 3, 2, 1]


def test_hot_swap_applies_from_the_next_step_with_no_step_lost_or_repeated(session):
    name = unique("swap")
    at_step_3 = threading.Event()
    release = threading.Event()
    calls = []

    def reward_group(prompts, completions, infos):  # v1: once per prompt's group; gates inside step 3
        calls.append(prompts)
        if len(calls) == 2 * 2 + 1:  # batch 2: the first group of step 3
            at_step_3.set()
            assert release.wait(60)
        return [letters(p, c) for p, c in zip(prompts, completions, strict=True)]

    registry.register(name, reward_group)
    run = session.train(reward=name, prompts=PROMPTS, steps=6, **SMALL)
    assert at_step_3.wait(60)
    v2 = registry.register(name, lambda prompt, completion, **info: 0.5 + 0.5 * letters(prompt, completion))
    assert v2.version == 2
    release.set()
    run.wait(120)
    rows = run.history
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["reward_version"] for r in rows] == [1, 1, 1, 2, 2, 2]
    assert all(r["reward_min"] >= 0.5 for r in rows[3:])
    assert len(calls) == 3 * 2 and all(len(p) == 4 and len(set(p)) == 1 for p in calls)  # one prompt each


def test_pause_holds_every_step_until_resume_and_save_gives_a_loadable_path(session, service_client):
    name = unique("pause")
    registry.register(name, letters)
    run = session.train(reward=name, prompts=PROMPTS, steps=200, **SMALL)
    wait_until(lambda: run.step >= 1, what="the first step")
    run.pause(wait=True, timeout=60)
    assert run.state == RunState.PAUSED
    held = run.step
    path = run.save("paused")
    # the save queued behind anything the run had sent: the service trained exactly the held steps
    assert session.client.get_run(run.run_id)["step"] == held
    assert run.step == held and run.state == RunState.PAUSED
    assert path.startswith("tinker://") and path.endswith("/weights/paused")
    run.resume()
    wait_until(lambda: run.step >= held + 2, what="two steps after resume")
    run.stop(wait=True, timeout=60)
    assert run.state == RunState.STOPPED and run.step < 200
    assert [r["step"] for r in run.history] == list(range(1, run.step + 1))
    tc = service_client.create_training_client_from_state(path)  # the Tinker SDK loads it
    info = tc.get_info()
    assert info.model_data.model_name == "openrl/tiny" and info.lora_rank == 8
    with pytest.raises(sess.UsageError, match="cannot resume"):
        run.resume()


def test_two_runs_in_one_process_progress_together(session):
    """Each run's second step waits (in its reward) for the other run's first step: run one after
    the other, they would never finish."""
    runs: dict[str, object] = {}
    both_started = threading.Event()

    def waits_for(other: str):
        def reward(prompt, completion, **info):
            assert both_started.wait(60)
            if reward.calls >= SMALL["batch"] * SMALL["group"]:  # a sample of this run's second step
                wait_until(lambda: runs[other].step >= 1, timeout=60, what=f"run {other}'s first step")
            reward.calls += 1
            return letters(prompt, completion)

        reward.calls = 0
        return reward

    a = session.train(reward=waits_for("b"), prompts=PROMPTS, steps=3, name=unique("a"), **SMALL)
    runs["a"] = a
    b = session.train(reward=waits_for("a"), prompts=PROMPTS, steps=3, name=unique("b"), **SMALL)
    runs["b"] = b
    both_started.set()
    a.wait(180)
    b.wait(180)
    assert a.state == b.state == RunState.FINISHED
    assert a.run_id != b.run_id


def test_failed_samples_are_left_out_and_an_all_failed_step_pauses_the_run(session, capsys):
    name = unique("flaky")

    def flaky(prompt, completion, **info):
        if prompt.startswith("Say"):
            raise ValueError("no greetings")
        if prompt.startswith("Write"):
            return float("nan")
        return letters(prompt, completion)

    registry.register(name, flaky)
    run = session.train(reward=name, prompts=PROMPTS, steps=3, batch=4, group=4, max_tokens=8)
    run.wait(120)
    assert run.state == RunState.FINISHED
    assert all(r["failed"] == 8 and r["n"] == 16 for r in run.history)
    errors = {s["error"] for s in run.samples(16) if s["error"]}
    assert "ValueError: no greetings" in errors and any("not a finite number" in e for e in errors)
    assert all(s["reward"] is None for s in run.samples(16) if s["error"])
    # said at once where a script looks (stderr), once for the reward's version, with a sample
    failure = run.reward_failure  # the last one
    assert (failure.reward, failure.version, failure.step, failure.paused) == (name, 1, 3, False)
    assert failure.failed == 8 and failure.n == 16 and failure.prompt.startswith(("Say", "Write"))
    said = capsys.readouterr().err
    assert said.count(f"reward {name} v1 failed on 8 of 16 samples") == 1, said  # at step 1 only
    assert f"reward {name} v1 failed on 8 of 16 samples at step 1: " in said
    assert "left out of the update; the run goes on" in said

    broken = unique("broken")

    def always_fails(prompt, completion, **info):
        raise RuntimeError("bug in my reward")

    registry.register(broken, always_fails)
    run = session.train(reward=broken, prompts=PROMPTS, steps=2, **SMALL)
    with pytest.raises(RunPaused, match="bug in my reward"):  # wait() does not hang on a paused run
        run.wait(120)
    assert run.state == RunState.PAUSED
    assert run.step == 0 and "RuntimeError: bug in my reward" in run.last_error
    assert "Traceback" in run.last_error and 'raise RuntimeError("bug in my reward")' in run.last_error
    assert "rewards.py" not in run.last_error  # only the user's frames
    failure = run.reward_failure
    assert failure.paused and failure.error == "RuntimeError: bug in my reward"
    assert failure.prompt in PROMPTS and failure.completion in {s["completion"] for s in run.samples(8)}
    said = capsys.readouterr().err
    assert f"reward {broken} v1 failed on 8 of 8 samples at step 1: RuntimeError: bug in my reward" in said
    assert "the run is paused: fix the reward, then run.resume()" in said
    registry.register(broken, letters)  # the fix
    run.resume()
    run.wait(120)
    assert [r["step"] for r in run.history] == [1, 2]
    assert [r["reward_version"] for r in run.history] == [2, 2]


def test_async_rewards_are_awaited(session):
    name = unique("async")

    async def reward(prompt, completion, **info):
        import asyncio

        await asyncio.sleep(0.01)
        return letters(prompt, completion)

    registry.register(name, reward)
    run = session.train(reward=name, prompts=[{"prompt": "Say hi:", "want": 1}], steps=2, **SMALL)
    run.wait(120)
    assert run.state == RunState.FINISHED and run.history[-1]["failed"] == 0


@pytest.mark.parametrize("loss", ["cispo", "gspo"])
def test_every_rl_loss_of_the_service_trains_from_the_notebook(session, loss):
    """The notebook offers the losses a train step takes (one shared list, openrl_common.protocol),
    not a shorter copy of it: each one trains."""
    name = unique(loss)
    registry.register(name, letters)
    run = session.train(reward=name, prompts=PROMPTS, steps=1, loss=loss, **SMALL)
    run.wait(120)
    assert run.state == RunState.FINISHED and run.history[-1]["trained"] > 0
    assert run.history[-1]["loss"] is not None


def test_info_fields_reach_the_reward(session, tmp_path):
    name = unique("info")
    seen = []

    def reward(prompt, completion, **info):
        seen.append(info)
        return 1.0 if info.get("answer") == "x" else 0.0

    registry.register(name, reward)
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "Pick x:", "answer": "x"}\n{"prompt": "Pick y:", "answer": "y"}\n')
    run = session.train(reward=name, prompts=str(src), steps=1, **SMALL)
    run.wait(120)
    assert {s["answer"] for s in seen} == {"x", "y"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"reward": "no_such_reward"}, "unknown reward 'no_such_reward'"),
        ({"prompts": []}, "prompts is empty"),
        ({"prompts": ["ok", ""]}, r"prompts\[1\] is an empty prompt"),
        ({"prompts": [{"text": "x"}]}, r'prompts\[0\] needs a non-empty "prompt"'),
        ({"prompts": "missing.txt"}, "no such file"),
        ({"steps": 0}, r"steps must be an integer in \[1, 1000000\]; got 0"),
        ({"group": 1}, "group must be at least 2"),
        ({"lr": -1.0}, r"lr must be a finite number in \(0, 1\]; got -1.0"),
        ({"lr": 0}, r"lr must be a finite number in \(0, 1\]; got 0"),
        (
            {"batch": 2.5},
            r"batch must be an integer in \[1, 4096\] \(the service's OPENRL_MAX_DATUMS\); got 2.5",
        ),
        ({"loss": "sft"}, "loss must be one of importance_sampling, ppo, cispo, dro, gspo"),
        ({"temperature": 99}, r"temperature must be a finite number in \[0, 10\]; got 99"),
    ],
)
def test_bad_arguments_are_one_clear_usage_error(session, kwargs, message):
    name = unique("ok")
    registry.register(name, letters)
    args = {"reward": name, "prompts": PROMPTS, "steps": 2, **kwargs}
    with pytest.raises(sess.UsageError, match=message):
        session.train(**args)
    assert not session.runs


def test_prompt_sources_dataframe_and_dict(session):
    import pandas as pd

    frame = pd.DataFrame({"prompt": ["Pick x:", "Pick y:"], "answer": ["x", "y"]})
    assert load_prompts(frame) == [
        {"prompt": "Pick x:", "info": {"answer": "x"}},
        {"prompt": "Pick y:", "info": {"answer": "y"}},
    ]
    with pytest.raises(sess.UsageError, match='needs a "prompt" column'):
        load_prompts(pd.DataFrame({"text": ["a"]}))
    with pytest.raises(sess.UsageError, match="not a dict"):
        load_prompts({"x": 1, "y": 2})


def test_service_refusals_at_creation_raise_in_the_cell(session):
    name = unique("rank")
    registry.register(name, letters)
    with pytest.raises(OpenRLError, match="rank"):
        session.train(reward=name, prompts=PROMPTS, steps=2, rank=512, **SMALL)
    assert not session.runs


def test_save_twice_needs_overwrite_and_samples_zero_is_empty(session):
    name = unique("save")
    registry.register(name, letters)
    run = session.train(reward=name, prompts=PROMPTS, steps=1, **SMALL).wait(120)
    first = run.save("same")
    with pytest.raises(OpenRLError, match="overwrite"):
        run.save("same")
    assert run.save("same", overwrite=True) == first
    assert run.samples(0) == [] and len(run.samples(3)) == 3


def test_reconnecting_a_session_with_active_runs_is_refused(session, server):
    name = unique("busy")
    registry.register(name, letters)
    run = session.train(reward=name, prompts=PROMPTS, steps=500, name=unique("busy"), **SMALL)
    with pytest.raises(sess.UsageError, match="has active runs"):
        sess.connect(server.url, token=ALICE_KEY, name="runs")
    assert not run.done
    run.stop(wait=True, timeout=60)


def test_overlap_samples_one_step_ahead_and_still_learns(session):
    name = unique("overlap")
    registry.register(name, letters)
    on = session.train(reward=name, prompts=PROMPTS, steps=4, **SMALL).wait(180)
    off = session.train(reward=name, prompts=PROMPTS, steps=4, overlap=1, **SMALL).wait(180)
    assert [r["step"] for r in off.history] == [1, 2, 3, 4]
    assert [r["off_policy"] for r in off.history] == [0, 1, 1, 1]
    assert [r["off_policy"] for r in on.history] == [0, 0, 0, 0]
    # on-policy the sampler's logprobs are the trainer's; one step behind, the ratio moves off 1
    trained_on = [r for r in on.history if r["trained"]]
    trained_off = [r for r in off.history[1:] if r["trained"]]
    assert all(abs(r["ratio_mean"] - 1) < 1e-3 for r in trained_on)
    assert trained_off and any(abs(r["ratio_max"] - 1) > 1e-3 for r in trained_off)
    with pytest.raises(sess.UsageError, match="overlap must be 0"):
        session.train(reward=name, prompts=PROMPTS, steps=2, overlap=2)


def test_group_advantages():
    assert group_advantages([1.0, 0.0, None, 0.5]) == [0.5, -0.5, 0.0, 0.0]
    assert group_advantages([0.2, 0.2]) == [0.0, 0.0]
    assert group_advantages([1.0, None]) == [0.0, 0.0]
    norm = group_advantages([1.0, 0.0], normalize_std=True)
    assert norm[0] == pytest.approx(1.0, abs=1e-5) and norm[1] == pytest.approx(-1.0, abs=1e-5)


def test_load_prompts_from_text_file(tmp_path):
    src = tmp_path / "p.txt"
    src.write_text("one\n\ntwo\n")
    assert [p["prompt"] for p in load_prompts(str(src))] == ["one", "two"]


def test_a_function_reward_is_pinned_to_its_run_and_leaves_the_named_rewards_alone(session):
    """train(reward=fn) keeps calling fn: a later train(reward=lambda ...) does not swap it, and a
    function that shares a registered reward's name does not become that reward's next version."""
    name = unique("letters")
    registry.register(name, letters)  # what a %%openrl reward NAME cell would have made
    names_before = registry.names()
    first_call, release = threading.Event(), threading.Event()

    def gated(prompt, completion, **info):
        first_call.set()
        assert release.wait(60)
        return 0.25

    gated.__name__ = "<lambda>"  # as anonymous as the lambda that follows
    a = session.train(reward=gated, prompts=PROMPTS, steps=2, **SMALL)
    assert first_call.wait(60)  # a is inside its first step
    b = session.train(reward=lambda prompt, completion, **info: 0.75, prompts=PROMPTS, steps=2, **SMALL)
    release.set()
    a.wait(120)
    b.wait(120)
    assert [r["reward_mean"] for r in a.history] == [0.25, 0.25]
    assert [r["reward_mean"] for r in b.history] == [0.75, 0.75]

    def same_name(prompt, completion, **info):
        return 0.5

    same_name.__name__ = name  # a function that happens to share the registered reward's name
    c = session.train(reward=same_name, prompts=PROMPTS, steps=1, **SMALL).wait(120)
    assert [r["reward_mean"] for r in c.history] == [0.5]
    assert registry.names() == names_before
    assert registry.latest(name).version == 1 and registry.latest(name).fn is letters


def test_a_paused_run_heartbeats_so_its_session_outlives_the_idle_timeout(make_server):
    """A run paused for longer than the service's idle timeout is still there to resume: the
    notebook heartbeats it (every third of the timeout) while it exists, paused or not."""
    idle_s = 6.0
    live = make_server(session_idle_timeout_s=idle_s, future_ttl_s=4.0)  # the reaper looks every 1 s
    svc = live.service
    s = sess.connect(live.url, token=ALICE_KEY, name="heartbeat")
    try:
        name = unique("hb")
        registry.register(name, letters)
        run = s.train(reward=name, prompts=PROMPTS, steps=3, **SMALL)
        run.wait(120, step=1)
        run.pause(wait=True, timeout=60)
        session = svc.sessions[svc.runs[run.run_id].session_id]
        paused_at = time.time()
        # The service's own clock says when it last heard of the run; wait until that is well past
        # the idle timeout after pausing (or the reaper finished the session).
        wait_until(
            lambda: session.finished or session.last_heartbeat > paused_at + 2 * idle_s,
            timeout=120,
            what="heartbeats past the idle timeout",
        )
        assert not session.finished, "the paused run's session was reaped as idle"
        assert run.state == RunState.PAUSED
        run.resume()
        run.wait(120)
        assert run.state == RunState.FINISHED and [r["step"] for r in run.history] == [1, 2, 3]
    finally:
        sess.disconnect("heartbeat")


def test_a_train_step_whose_reply_is_lost_is_sent_again_not_resampled(server):
    """The reply to step 1's train_step is lost and the client does not retry: the service is
    unavailable as far as the run knows, so it says so and retries by itself (no pause). It re-sends
    that same train_step (same key) instead of sampling and training again, so the service applies
    exactly the updates the notebook recorded."""
    from openrl_jupyter import AsyncClient

    lossy = DropReply("/train_step")
    s = sess.connect(server.url, token=ALICE_KEY, name="lossy")
    s._aclient = AsyncClient(server.url, token=ALICE_KEY, retries=0, transport=lossy)
    counter = itertools.count()
    logs, subscribed = [], threading.Event()

    def reward(prompt, completion, **info):
        assert subscribed.wait(60)  # the log is heard from the first step on
        return float(next(counter))

    try:
        run = s.train(reward=reward, prompts=PROMPTS, steps=2, **SMALL)
        run.subscribe(lambda event: logs.append(event.get("text", "")))
        subscribed.set()
        run.wait(120)
        assert run.state == RunState.FINISHED and lossy.dropped == 1
        assert any("step 1: service unavailable — retrying" in t and "reply arrived" in t for t in logs)
        assert [r["step"] for r in run.history] == [1, 2] and all(r["trained"] for r in run.history)
        assert s.client.get_run(run.run_id)["step"] == 2  # one update per recorded step
        samples = [p for p, _ in lossy.sent if p.endswith("/sample")]
        steps = [k for p, k in lossy.sent if p.endswith("/train_step")]
        assert len(samples) == 2  # step 1 was not sampled again
        assert len(steps) == 3 and steps[0] == steps[1] != steps[2] and steps[0]
    finally:
        for run in s.runs.values():
            s.client.delete_run(run.run_id)
        sess.disconnect("lossy")


def test_a_full_fine_tune_trains_in_the_background_like_a_lora_run(session):
    """rank=0: the run trains its own copy of every weight; the loop, history and save are the same."""
    name = unique("letters_full")
    registry.register(name, letters)
    run = session.train(reward=name, prompts=PROMPTS, steps=2, **{**SMALL, "rank": 0, "lr": 1e-4})
    run.wait(120)
    assert run.state == RunState.FINISHED and run.step == 2
    assert session.client.get_run(run.run_id)["lora_rank"] == 0
    assert any(r["trained"] and r["grad_norm"] > 0 for r in run.history)
    path = run.save("full")
    assert path.startswith("tinker://")
