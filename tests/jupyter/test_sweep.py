"""Sweeps against the real service on loopback: the runs of a grid step at the same time, successive
halving stops the worse runs at each rung, the best survivor is picked and saved; bad input is a
clear error. Which run is worse is made certain by the grid itself: it varies the reward, and the
three rewards' ranges do not overlap, so no training noise can reorder them."""

from __future__ import annotations

import html
import statistics
import subprocess
import sys
import threading

import pytest

from openrl_jupyter import session as sess
from openrl_jupyter.rewards import registry
from openrl_jupyter.run import RunState
from openrl_jupyter.session import UsageError
from openrl_jupyter.sweep import (
    Score,
    Sweep,
    expand_grid,
    plan_rungs,
    point_label,
    survivors,
    window_mean,
)
from tests._support.runs import PROMPTS, SMALL, forget_runs, letters
from tests.conftest import ALICE_KEY


@pytest.fixture
def session(server):
    s = sess.connect(server.url, token=ALICE_KEY, name="sweeps")
    yield s
    forget_runs(s)
    sess.disconnect("sweeps")


def phased(name: str, early: float, late: float, barrier: threading.Barrier, runs: dict):
    """A reward in [early, early + 0.05] for its run's first two steps and [late, late + 0.05] after
    (``runs[name]``: its run, once the sweep made it). On its first call it waits until every run of
    the sweep is scoring at the same moment (so it only returns if the runs really step concurrently)."""
    first = threading.Event()

    def reward(prompt, completion, **info):
        if not first.is_set():
            first.set()
            barrier.wait()  # BrokenBarrierError after the timeout: the runs did not overlap
        run = runs.get(name)
        base = early if run is None or run.step < 2 else late
        return base + 0.05 * letters(prompt, completion)

    reward.__name__ = name
    return reward


def test_a_sweep_runs_its_grid_concurrently_halves_at_rungs_and_saves_the_best(session):
    """Three runs, four steps: one rung, at step 2 (never after one noisy step). Every reward falls
    after step 2, so the run dropped there scored more over steps 1-2 than the winner does over
    steps 3-4: the tables show the dropped run only beside the winner's score over steps 1-2."""
    barrier, runs = threading.Barrier(3, timeout=90), {}
    low = phased("low", 0.3, 0.3, barrier, runs)
    high = phased("high", 0.8, 0.15, barrier, runs)
    mid = phased("mid", 0.5, 0.0, barrier, runs)
    sweep = session.sweep(
        prompts=PROMPTS, grid={"reward": [low, high, mid], "lr": [1e-4]}, steps=4, name="sw", **SMALL
    )
    runs.update({r.name.split("-")[1]: r for r in sweep.runs})
    assert sweep.rungs == [2]  # three runs would halve in two rungs; at 4 steps only step 2 is one
    names = [r.name for r in sweep.runs]
    assert names == ["sw-low-lr1e-4", "sw-high-lr1e-4", "sw-mid-lr1e-4"]
    assert len({r.run_id for r in sweep.runs}) == 3
    assert {r.run_id for r in sweep.runs} <= {r["run_id"] for r in session.client.list_runs()}  # one service
    sweep.wait(240)
    by = {r.name: r for r in sweep.runs}
    lo, hi, mi = by["sw-low-lr1e-4"], by["sw-high-lr1e-4"], by["sw-mid-lr1e-4"]
    # rung 1 (step 2): of three, the better two go on, ranked over steps 1-2
    assert sweep.stopped_at_rung == {lo.name: 1}
    assert [e["dropped"] for e in sweep.rung_log] == [[lo.name]]
    assert lo.state == RunState.STOPPED and lo.step == 2  # held at the rung, then stopped: no step wasted
    assert hi.state == mi.state == RunState.FINISHED and hi.step == mi.step == 4
    at_rung = dict(sweep.rung_log[0]["ranking"])
    assert lo.stop_reason == (
        "stopped by the sweep at rung 1 (step 2): score (mean reward_mean over steps 1-2) "
        f"{at_rung[lo.name]:.4g} vs {at_rung[mi.name]:.4g} for the last of the 2 kept"
    )
    assert all(0.15 <= r["reward_mean"] <= 0.2 for r in hi.history if r["step"] > 2)
    assert sweep.best is hi
    assert sweep.checkpoint is not None and sweep.checkpoint.startswith("tinker://")
    assert sweep.checkpoint.endswith("/weights/sw-best") and sweep.save_error is None

    frame = sweep.to_pandas()
    assert list(frame.index) == names
    assert list(frame["reward"]) == ["low", "high", "mid"] and list(frame["lr"]) == [1e-4] * 3
    assert list(frame["steps"]) == [2, 4, 4]
    assert list(frame["state"]) == ["stopped", "finished", "finished"]
    assert (
        frame["stopped_at_rung"].tolist()[0] == 1
        and frame["stopped_at_rung"].isna().tolist()[1:] == [True] * 2
    )
    assert frame.loc[hi.name, "best"] and not frame.loc[lo.name, "best"]
    assert "max_reward_mean" in frame.columns and "best_reward_mean" not in frame.columns

    # the survivors' scores share one column, over the same steps (since the rung: 3-4)
    rule = sweep.score_rule()
    assert rule.startswith(
        "score = mean reward_mean (higher is better) over each run's steps since rung 1 (step 2)"
    )
    assert frame.attrs["score"] == rule
    assert list(frame["score_steps"]) == ["", "3-4", "3-4"]
    assert frame.loc[hi.name, "score"] == pytest.approx(
        statistics.fmean(r["reward_mean"] for r in hi.history if r["step"] > 2)
    )
    kept = frame[frame["stopped_at_rung"].isna() & (frame["state"] != "failed")]
    assert kept["score"].idxmax() == sweep.best.name
    # the dropped run scored more over steps 1-2 than the winner over 3-4: it has no score in that
    # column, only its rung score beside the winner's over the same steps
    assert frame["score"].isna().tolist() == [True, False, False]
    assert frame.loc[lo.name, "rung_score"] == at_rung[lo.name] > frame.loc[hi.name, "score"]
    assert frame.loc[lo.name, "rung_steps"] == "1-2"
    assert frame.loc[lo.name, "best_rung_score"] == pytest.approx(
        statistics.fmean(r["reward_mean"] for r in hi.history if r["step"] <= 2)
    )
    assert frame.loc[lo.name, "best_rung_score"] > frame.loc[lo.name, "rung_score"]
    assert frame[["rung_score", "best_rung_score"]].iloc[1:].isna().all().all()

    text, page = repr(sweep), sweep._repr_html_()
    assert "* sw-high-lr1e-4" in text and sweep.checkpoint in text
    assert text.splitlines()[1] == f"  ranked by {rule}" and f"ranked by {html.escape(rule)}" in page
    compared = (
        f"dropped at rung 1: score {at_rung[lo.name]:.4g} vs "
        f"{frame.loc[lo.name, 'best_rung_score']:.4g} for the best (steps 1-2)"
    )
    (line,) = [ln for ln in text.splitlines() if f" {lo.name} " in ln]
    assert line.endswith(compared), line
    cells = page.split(f"<td>{lo.name}</td>", 1)[1].split("</tr>", 1)[0]
    assert f"<td></td><td></td><td>{html.escape(compared)}</td>" in cells, cells
    for name in (hi.name, mi.name):
        score = f"{frame.loc[name, 'score']:.4g}"
        (line,) = [ln for ln in text.splitlines() if f" {name} " in ln]
        assert line.endswith(f"score {score} (steps 3-4)"), line
        cells = page.split(f"<td>{name}</td>", 1)[1].split("</tr>", 1)[0]
        assert f"<td>{score}</td><td>3-4</td><td></td>" in cells, cells
    assert "font-weight:bold" in page.split("sw-high-lr1e-4")[0].rsplit("<tr", 1)[1]

    dash = sweep.dashboard(call_later=lambda delay, fn: None)  # drawn once when built
    try:
        traces = {t.meta: t for t in dash.fig.data}
        assert set(traces) == {f"run:{n}" for n in names}
        best, dropped = traces[f"run:{hi.name}"], traces[f"run:{lo.name}"]
        assert list(best.x) == [1, 2, 3, 4] and best.name.startswith("★") and best.line.width == 4
        assert list(dropped.x) == [1, 2] and dropped.line.color == "#b0b0b0" and "rung 1" in dropped.name
        assert list(traces[f"run:{mi.name}"].y) == [r["reward_mean"] for r in mi.history]
        assert "sw-best" in dash.table.value and dash._repr_mimebundle_()["text/plain"] == repr(sweep)
        assert dash.table.value == page  # the dashboard's table is the sweep's html: the same scores
    finally:
        dash.close()


def test_the_budget_caps_the_steps_of_all_runs_together(session):
    sweep = session.sweep(
        reward=letters, prompts=PROMPTS, grid={"lr": [1e-4, 2e-4]}, steps=50, budget=4, rungs=0, **SMALL
    )
    sweep.wait(180)
    total = sum(r.step for r in sweep.runs)
    assert 4 <= total <= 4 + len(sweep.runs)  # a step already under way when the budget ran out ends
    for run in sweep.runs:
        assert run.state == RunState.STOPPED
        assert run.stop_reason == "stopped by the sweep: its budget of 4 steps is spent"
    assert sweep.stopped_at_rung == {} and sweep.best in sweep.runs
    # two survivors, no rungs: the best is the one with the top score over all its steps
    frame = sweep.to_pandas()
    assert (
        frame.attrs["score"] == "score = mean reward_mean (higher is better) over each run's steps (no rungs)"
    )
    assert frame["score"].idxmax() == sweep.best.name
    for run in sweep.runs:
        rows = [r for r in run.history if "reward_mean" in r]
        assert frame.loc[run.name, "score"] == pytest.approx(statistics.fmean(r["reward_mean"] for r in rows))
        assert frame.loc[run.name, "score_steps"] == ("1" if run.step == 1 else f"1-{run.step}")


def test_sweep_stop_stops_every_run(session):
    sweep = session.sweep(reward=letters, prompts=PROMPTS, grid={"rank": [4, 8]}, steps=500, rungs=0, **SMALL)
    sweep.stop(wait=True, timeout=120)
    assert all(r.state == RunState.STOPPED for r in sweep.runs) and sweep.done
    assert [r.name.split("-")[-1] for r in sweep.runs] == ["r4", "r8"]


def test_a_failed_run_is_never_the_best(session):
    """The best-scoring run fails (the service lost it after its first step): ``best`` is the best
    run that did not fail, and that is the one saved."""
    lost: dict = {}

    def high(prompt, completion, **info):
        run = lost.get("run")
        if run is not None and run.step >= 1 and not lost.get("deleted"):
            lost["deleted"] = True
            session.client.delete_run(run.run_id)  # behind the notebook's back: its next step fails
        return 0.8 + 0.1 * letters(prompt, completion)

    def low(prompt, completion, **info):
        return 0.1 * letters(prompt, completion)

    sweep = session.sweep(prompts=PROMPTS, grid={"reward": [high, low]}, steps=3, rungs=0, name="fl", **SMALL)
    lost["run"] = sweep.runs[0]
    sweep.wait(240)
    hi, lo = sweep.runs
    assert lost.get("deleted") and hi.state == RunState.FAILED and hi.history  # it scored, then failed
    assert sweep.score(hi) > sweep.score(lo)
    assert lo.state == RunState.FINISHED
    assert sweep.best is lo
    assert sweep.checkpoint is not None and sweep.checkpoint.endswith("/weights/fl-best"), sweep.save_error
    frame = sweep.rows()
    assert [r["best"] for r in frame] == [False, True]
    assert frame[0]["score"] > frame[1]["score"]  # the top score failed: the best is the top survivor
    assert [ln[:3] for ln in repr(sweep).splitlines()[2:4]] == ["   ", " * "]
    # the fixture's disconnect closes the session: a failed run is done with, its RunFailed is not raised


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grid": {}}, "grid must be a non-empty dict"),
        ({"grid": {"lr": []}}, r"grid\['lr'\] is empty"),
        ({"grid": {"dropout": [0.1]}}, "grid key 'dropout' is not a train option.*lr, rank, loss"),
        ({"grid": {"lr": 1e-4}}, r"grid\['lr'\] must be a list of values; got float"),
        ({"grid": {"loss": "ppo"}}, r"grid\['loss'\] must be a list of values; got str"),
        ({"grid": {"lr": [1e-4, 1e-4]}}, "repeats a value"),
        ({"grid": {"lr": [1e-4]}, "keep": 1}, "keep must be a share between 0 and 1"),
        ({"grid": {"lr": [1e-4]}, "keep": 0}, "keep must be a share between 0 and 1"),
        ({"grid": {"lr": [1e-4, 2e-4]}, "budget": 1}, r"budget must be .* at least the number of runs \(2\)"),
        ({"grid": {"lr": [1e-4]}, "rungs": [5, 3]}, "rungs must be increasing"),
        (
            {"grid": {"lr": [1e-4]}, "steps": 10, "rungs": [10]},
            r"rungs must be steps from 1 to steps-1 \(9\)",
        ),
        (
            {"grid": {"lr": [1e-4, 2e-4]}, "steps": 4, "rungs": 3},
            r"rungs=3 does not fit 4 steps: .* no earlier than step 2",
        ),
        ({"grid": {"lr": [1e-4]}, "mode": "up"}, "mode must be 'max'"),
        ({"grid": {"lr": [1e-4]}, "lr": 1e-3}, "lr is both in the grid and given as an option"),
        ({"grid": {"lr": list(range(1, 66))}}, "the grid has 65 points; a sweep starts at most 64"),
        ({"grid": {"lr": [1e-4]}, "name": "my sweep"}, "name must be 1 to 64 letters"),
    ],
)
def test_bad_sweep_arguments_name_the_field_and_its_limit(kwargs, message):
    with pytest.raises(UsageError, match=message):
        Sweep(None, reward="letters", prompts=PROMPTS, **kwargs)


def test_a_sweep_needs_exactly_one_source_of_reward():
    with pytest.raises(UsageError, match="reward is missing"):
        Sweep(None, prompts=PROMPTS, grid={"lr": [1e-4]})
    with pytest.raises(UsageError, match="not both"):
        Sweep(None, reward="letters", prompts=PROMPTS, grid={"reward": [letters]})


def test_a_score_is_the_mean_of_the_metric_over_a_window_of_steps():
    history = [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.3}, {"step": 3, "loss": 1.0}]
    history.append({"step": 4, "reward_mean": 0.8})
    assert window_mean(history, "reward_mean", 0, None) == Score(pytest.approx(0.4), 1, 4)
    assert window_mean(history, "reward_mean", 1, 3) == Score(0.3, 2, 2)
    assert window_mean(history, "reward_mean", 4, None) == Score(None, None, None)
    assert [s.steps for s in (Score(0.4, 1, 4), Score(0.3, 2, 2), Score(None, None, None))] == [
        "1-4",
        "2",
        "",
    ]


def test_grid_points_names_and_rungs():
    points = expand_grid({"lr": [1e-4, 3e-5], "rank": [8], "loss": ["ppo", "importance_sampling"]})
    assert [point_label(p) for p in points] == [
        "lr1e-4-r8-ppo",
        "lr1e-4-r8-is",
        "lr3e-5-r8-ppo",
        "lr3e-5-r8-is",
    ]
    assert [survivors(n, 0.5) for n in (1, 2, 3, 6)] == [1, 1, 2, 3]
    assert plan_rungs(None, 40, 4, 0.5) == [10, 20]  # 4 -> 2 -> 1: two rungs, at steps/4 and steps/2
    assert plan_rungs(None, 40, 6, 0.5) == [5, 10, 20]  # 6 -> 3 -> 2 -> 1: three
    assert plan_rungs(None, 40, 6, 0.25) == [10, 20]  # 6 -> 2 -> 1
    # rungs scale with the steps: none before steps/8 (at least step 2, at most 10), none within 2 steps
    # of another; a short sweep drops fewer runs rather than dropping them after one noisy step
    assert plan_rungs(None, 4, 3, 0.5) == [2] and plan_rungs(None, 2, 8, 0.5) == []
    assert plan_rungs(None, 6, 8, 0.5) == [3] and plan_rungs(None, 10, 8, 0.5) == [3, 5]
    assert plan_rungs(None, 60, 8, 0.5) == [8, 15, 30]
    assert plan_rungs(None, 1000, 64, 0.5) == [16, 32, 63, 125, 250, 500]  # 64 -> 1 in six
    assert plan_rungs(1, 4, 3, 0.5) == [2] and plan_rungs(0, 4, 3, 0.5) == []
    with pytest.raises(
        UsageError, match=r"rungs=2 does not fit 4 steps: at most 1 rung\(s\) fit \(steps 2\)"
    ):
        plan_rungs(2, 4, 3, 0.5)
    assert plan_rungs([3, 7], 10, 4, 0.5) == [3, 7] and plan_rungs([1, 2], 4, 3, 0.5) == [1, 2]  # as given


def test_a_numpy_grid_starts_its_runs_with_those_values(session):
    """``grid={"rank": np.array([4, 8])}`` (and numpy scalars elsewhere: a seed from an rng) is a
    grid like a list: each run is created on the service with that rank, sent as plain JSON."""
    np = pytest.importorskip("numpy")
    sweep = session.sweep(
        reward=letters,
        prompts=PROMPTS,
        grid={"rank": np.array([4, 8]), "lr": np.array([1e-4], dtype=np.float32)},
        seed=np.int64(3),
        steps=1,
        rungs=0,
        name="np",
        **SMALL,
    )
    sweep.wait(240)
    assert [r.name for r in sweep.runs] == ["np-r4-lr1e-4", "np-r8-lr1e-4"]
    assert all(r.state == RunState.FINISHED for r in sweep.runs), [r.state for r in sweep.runs]
    assert [session.client.get_run(r.run_id)["lora_rank"] for r in sweep.runs] == [4, 8]
    assert [type(r.config.rank) for r in sweep.runs] == [int, int] and sweep.runs[0].config.seed == 3


def test_the_sweep_module_imports_without_torch_or_pandas():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['pandas'] = None\n"
        "from openrl_jupyter.sweep import Sweep\nfrom openrl_jupyter import Session\n"
        "print(hasattr(Session, 'sweep'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr


@pytest.fixture
def shell(server, monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("OPENRL_TOKEN", ALICE_KEY)
    monkeypatch.delenv("OPENRL_URL", raising=False)
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "openrl_jupyter")
    ip.run_line_magic("openrl", f"connect {server.url} --name msweeps")
    yield ip
    forget_runs(sess.get_session("msweeps"))
    ip.run_line_magic("unload_ext", "openrl_jupyter")


def test_the_sweep_magic_starts_a_sweep_from_comma_separated_lists(shell):
    from IPython.core.error import UsageError as IPythonUsageError

    from openrl_jupyter.magic_args import help_text, parsers

    registry.register("sweep_letters", letters)
    shell.user_ns["P"] = PROMPTS
    line = "sweep --reward sweep_letters --prompts P --lr 1e-4,2e-4 --loss ppo --steps 4 --rungs 1"
    sweep = shell.run_line_magic("openrl", line + " --group 4 --batch 2 --max-tokens 8 --name msw")
    assert isinstance(sweep, Sweep) and sweep.rungs == [2]
    assert [r.name for r in sweep.runs] == ["msw-lr1e-4-ppo", "msw-lr2e-4-ppo"]
    sweep.wait(180)
    assert len(sweep.stopped_at_rung) == 1 and sweep.best is not None
    assert sweep.best.step == 4 and sweep.best.name not in sweep.stopped_at_rung
    with pytest.raises(IPythonUsageError, match="--lr takes comma-separated float values"):
        shell.run_line_magic("openrl", "sweep --reward sweep_letters --prompts P --lr 1e-4,fast")
    with pytest.raises(IPythonUsageError, match=r"rungs=2 does not fit 2 steps: at most 0 rung"):
        shell.run_line_magic(
            "openrl", "sweep --reward sweep_letters --prompts P --lr 1e-4,2e-4 --steps 2 --rungs 2"
        )
    with pytest.raises(IPythonUsageError, match=r"--rungs: takes a count \(2\) or comma-separated steps"):
        shell.run_line_magic("openrl", "sweep --reward sweep_letters --prompts P --lr 1e-4 --rungs soon")
    assert parsers()["sweep"].parse_args(["--reward", "r", "--prompts", "P", "--rungs", "5,10"]).rungs == [
        5,
        10,
    ]
    manual = help_text(parsers())
    assert "sweep = %openrl sweep --reward REWARD --prompts PROMPTS" in manual
    sweep_help = " ".join(parsers()["sweep"].format_help().split())
    assert "none before steps/8, at least step 2 and at most step 10" in sweep_help
