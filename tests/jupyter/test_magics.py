"""%openrl and %%openrl reward through a real IPython InteractiveShell, against the real service."""

from __future__ import annotations

import re
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from openrl_jupyter import session as sess
from openrl_jupyter.rewards import registry
from openrl_jupyter.run import RunState
from tests._support.runs import forget_runs
from tests.conftest import ALICE_KEY, free_port


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "openrl_jupyter")
    yield ip
    ip.run_line_magic("unload_ext", "openrl_jupyter")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for var in ("OPENRL_URL", "OPENRL_TOKEN", "TINKER_BASE_URL", "TINKER_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    yield
    for name, session in list(sess.sessions().items()):
        forget_runs(session)
        sess.disconnect(name)


class Cell:
    def __init__(self, result, captured):
        self.result, self.out, self.err = result, captured.stdout, captured.stderr
        self.text = self.out + self.err

    @property
    def ok(self) -> bool:
        return self.result.success


def run(shell, source: str) -> Cell:
    with capture_output() as captured:
        result = shell.run_cell(source, store_history=False)
    cell = Cell(result, captured)
    assert ALICE_KEY not in cell.text, "a key leaked into a cell's output"
    return cell


def one_error_line(cell: Cell, *needles: str) -> str:
    assert not cell.ok
    assert "Traceback" not in cell.text and "File " not in cell.text, cell.text
    lines = [line for line in cell.text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, cell.text
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def connect(shell, server, monkeypatch, name="m"):
    monkeypatch.setenv("OPENRL_TOKEN", ALICE_KEY)
    cell = run(shell, f"%openrl connect {server.url} --name {name}")
    assert cell.ok, cell.text
    return cell


def test_help_and_docstring(shell):
    cell = run(shell, "%openrl help")
    assert cell.ok and "Subcommands" in cell.out and "%%openrl reward NAME" in cell.out
    assert "Subcommands" in shell.find_line_magic("openrl").__doc__  # what %openrl? shows
    cell = run(shell, "%openrl train --help")
    assert cell.ok and "--reward" in cell.out and "--max-tokens" in cell.out


def test_every_way_of_asking_for_help_answers(shell):
    """%openrl --help, %openrl help CMD and %openrl CMD --help: each answers, headed as one types it,
    every option with a description and, where it has one, its default."""
    for line in ("%openrl --help", "%openrl -h"):
        cell = run(shell, line)
        assert cell.ok and "Subcommands" in cell.out, (line, cell.text)
    by_verb = run(shell, "%openrl help train")
    by_flag = run(shell, "%openrl train --help")
    for cell in (by_verb, by_flag):
        assert cell.ok, cell.text
        assert cell.out.lstrip().startswith("usage: %openrl train"), cell.out[:80]
        assert "::" not in cell.out
        # the cell magics keep their %%; every other subcommand is a line magic, written %openrl
        assert set(re.findall(r"%%openrl (\w+)", cell.out)) == {"reward", "env"}, cell.out
        assert "RL steps to run (default: 60)" in " ".join(cell.out.split())
    one_error_line(
        run(shell, "%openrl help trian"), "UsageError", "no subcommand 'trian'", "did you mean train?"
    )
    from openrl_jupyter.magic_args import parsers

    manual = run(shell, "%openrl help").out
    assert set(re.findall(r"%%openrl (\w+)", manual)) == {"reward", "env"}, manual
    assert "the next %openrl chat of the same model" in " ".join(manual.split())
    assert "one subcommand's options: %openrl help train." in manual
    chat = " ".join(run(shell, "%openrl chat --help").out.split())
    assert "the next %openrl chat of the same model" in chat and "%%" not in chat

    undescribed = [(verb, a.dest) for verb, p in parsers().items() for a in p._actions if not a.help]
    assert undescribed == []


def test_the_help_names_every_option_of_every_subcommand(shell):
    """The manual is written from the parsers, so an option added to one cannot be missing from it."""
    from openrl_jupyter.magic_args import parsers

    manual = shell.find_line_magic("openrl").__doc__
    printed = run(shell, "%openrl help").out
    for verb, parser in parsers().items():
        assert f"%openrl {verb}" in manual, verb
        for action in parser._actions:
            names = action.option_strings or [action.metavar or action.dest]
            for name in names:
                if name not in ("-h", "--help"):
                    assert name in manual and name in printed, f"%openrl {verb} {name}"
    assert all(o in manual for o in ("--normalize-std", "--seed", "--model", "--overlap"))


def test_connect_precedence_and_errors(shell, server, monkeypatch):
    one_error_line(run(shell, "%openrl connect"), "UsageError", "OPENRL_URL", "--local")
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(sess, "Client", _no_retry_client(sess.Client))
    one_error_line(run(shell, f"%openrl connect {dead}"), "ServiceUnavailable", dead, "nothing answers")
    monkeypatch.setenv("OPENRL_TOKEN", "tml-wrong-key-000000")
    line = one_error_line(run(shell, f"%openrl connect {server.url}"), "AuthenticationError", "check the key")
    assert line.count("check the key") == 1 and "connect(token=...)" in line, line
    monkeypatch.setenv("OPENRL_URL", server.url)
    monkeypatch.setenv("OPENRL_TOKEN", ALICE_KEY)
    cell = run(shell, "%openrl connect")
    assert cell.ok and f"connected to the service at {server.url}" in cell.out
    # traitlets config is used when neither flag nor env gives a URL
    monkeypatch.delenv("OPENRL_URL")
    magics = shell.magics_manager.registry["OpenRLMagics"]
    magics.url = server.url
    try:
        cell = run(shell, "%openrl connect --name fromconfig")
        assert cell.ok and "'fromconfig'" in cell.out
    finally:
        magics.url = None


def test_a_url_where_nothing_answers_is_named_before_any_retrying_client_is_made(shell, monkeypatch):
    """A wrong URL: connect tries it for a few seconds (refused connections again, as a service that
    restarts refuses them), then says so, naming the URL, what it tried, and how to start a service;
    the client whose retries take minutes is never made."""
    made = []
    monkeypatch.setattr(sess, "Client", lambda url, **kw: made.append(url))
    monkeypatch.setenv("OPENRL_TOKEN", "tml-any-0123456789")
    dead = f"http://127.0.0.1:{free_port()}"
    line = one_error_line(run(shell, f"%openrl connect {dead}"), "ServiceUnavailable")
    assert re.search(rf"nothing answers at {dead}: tried GET {dead}/readyz \d+ times over \d+\.\d s", line), (
        line
    )
    assert "Connection refused" in line and "`openrl-service serve`" in line and "--local" in line, line
    assert made == []


def _no_retry_client(cls):
    def make(url, **kw):
        kw["retries"] = 0
        return cls(url, **kw)

    return make


def test_local_without_the_service_extra_names_it(shell, monkeypatch):
    monkeypatch.setattr(sess, "_installed", lambda module: False)
    one_error_line(run(shell, "%openrl connect --local"), "UsageError", 'pip install -e ".[service]"')


def test_reward_cells_register_versions_and_a_failing_cell_registers_nothing(shell):
    name = f"r{time.monotonic_ns()}"
    cell = run(shell, f"%%openrl reward {name}\ndef reward(prompt, completion, **info):\n    return 1.0\n")
    assert cell.ok and f"reward {name} v1 registered (per sample)" in cell.out
    cell = run(
        shell,
        f"%%openrl reward {name}\ndef reward_group(prompts, completions, infos):\n    return [0.0] * len(prompts)\n",
    )
    assert cell.ok and f"reward {name} v2 registered (per group)" in cell.out
    cell = run(
        shell, f"%%openrl reward {name}\ndef reward(prompt, completion, **info):\n    return 1 / 0\nboom()\n"
    )
    assert not cell.ok and "NameError" in cell.text
    assert registry.latest(name).version == 2
    one_error_line(run(shell, f"%%openrl reward {name}\nx = 1\n"), "UsageError", "defines no reward")
    one_error_line(
        run(shell, "%%openrl reward 1bad\ndef reward(p, c): return 0\n"), "UsageError", "identifier"
    )
    one_error_line(run(shell, "%%openrl train\npass\n"), "UsageError", "%%openrl reward NAME")
    assert registry.latest(name).version == 2


def test_train_and_every_run_subcommand(shell, server, monkeypatch):
    connect(shell, server, monkeypatch)
    name = f"letters{time.monotonic_ns()}"
    assert run(
        shell,
        f"%%openrl reward {name}\n"
        "def reward(prompt, completion, **info):\n"
        "    return sum(c.isalpha() for c in completion) / max(1, len(completion))\n",
    ).ok
    shell.user_ns["PROMPTS"] = ["Name a colour:", "Say hello:", "Write a word:"]
    cell = run(
        shell,
        f"run = %openrl train --reward {name} --prompts PROMPTS --steps 40 --group 4 --batch 2 "
        "--max-tokens 8 --name quick",
    )
    assert cell.ok, cell.text
    r = shell.user_ns["run"]
    assert r.name == "quick" and r.total_steps == 40 and r.config.group == 4 and r.config.batch == 2
    deadline = time.monotonic() + 60
    while r.step < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    cell = run(shell, "%openrl pause quick --wait")
    assert cell.ok and "is paused" in cell.out and r.state == RunState.PAUSED
    cell = run(shell, "%openrl save quick mid")
    assert cell.ok and "tinker://" in cell.out and "/weights/mid" in cell.out
    assert run(shell, "%openrl runs").ok
    text = repr(shell.run_line_magic("openrl", "runs"))
    assert "quick" in text and "paused" in text and r.run_id in text
    assert "quick" in shell.run_line_magic("openrl", "runs")._repr_html_()
    status = repr(shell.run_line_magic("openrl", "status"))
    assert "ready" in status and "openrl/tiny" in status and server.url in status
    assert "paused" in repr(shell.run_line_magic("openrl", "status quick"))
    sessions_table = repr(shell.run_line_magic("openrl", "sessions"))
    assert sessions_table.splitlines()[1].split()[:3] == ["m", server.url, "remote"]
    cell = run(shell, "%openrl resume quick")
    assert cell.ok and "'quick' is running" in cell.out
    held = r.step
    deadline = time.monotonic() + 60
    while r.step <= held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.step > held, "the run did not continue after %openrl resume"
    cell = run(shell, "%openrl stop quick --wait")
    assert cell.ok and r.state in (RunState.STOPPED, RunState.FINISHED)
    board = shell.run_line_magic("openrl", "dashboard")
    assert type(board).__name__ == "ServiceDashboard"
    board.close()
    cell = run(shell, "%openrl disconnect m")
    assert cell.ok and "disconnected" in cell.out and not sess.sessions()


@pytest.mark.parametrize(
    "line, needles",
    [
        ("%openrl frobnicate", ["unknown subcommand 'frobnicate'"]),
        ("%openrl trian", ["unknown subcommand 'trian'", "did you mean train?"]),
        ("run = %openrl train --reward nope_not_defined --prompts P", ["unknown reward 'nope_not_defined'"]),
        ("run = %openrl train --reward R --prompts MISSING", ["no variable 'MISSING'"]),
        ("run = %openrl train --reward R --prompts EMPTY", ["prompts is empty"]),
        ("run = %openrl train --reward R --prompts P --steps abc", ["--steps", "invalid int value"]),
        ("run = %openrl train --reward R --prompts P --loss sft", ["--loss must be one of", "got 'sft'"]),
        ("run = %openrl train --reward R --prompts P --loss ppoo", ["did you mean ppo?"]),
        ("run = %openrl train --prompts P", ["--reward"]),
        ("run = %openrl train --reward R --prompts P --group 1", ["group must be at least 2"]),
        ("run = %openrl train --reward R --prompts P --bogus 3", ["unknown option --bogus"]),
        # no abbreviations: --step is not silently --steps
        (
            "run = %openrl train --reward R --prompts P --step 5",
            ["unknown option --step", "did you mean --steps?"],
        ),
        ("%openrl stop nothere", ["no runs yet"]),
        ("%openrl disconnect other", ["no session named 'other'"]),
    ],
)
def test_bad_input_is_one_clear_line(shell, server, monkeypatch, line, needles):
    connect(shell, server, monkeypatch)
    shell.user_ns["P"] = ["hi"]
    shell.user_ns["EMPTY"] = []
    registry.register("R", lambda prompt, completion, **info: 0.0)
    one_error_line(run(shell, line), "UsageError", *needles)
    assert not sess.get_session("m").runs


def test_not_connected_is_a_hint(shell):
    one_error_line(run(shell, "%openrl runs"), "UsageError", "not connected")


def test_quoted_arguments_lose_their_quotes(shell, server, monkeypatch):
    connect(shell, server, monkeypatch)
    registry.register("Q", lambda prompt, completion, **info: 0.5)
    shell.user_ns["P"] = ["hi"]
    cell = run(
        shell, 'r = %openrl train --reward Q --prompts "P" --steps 1 --group 2 --batch 1 --name "my run"'
    )
    assert cell.ok, cell.text
    r = shell.user_ns["r"]
    assert r.name == "my run"
    r.wait(120)
    cell = run(shell, '%openrl save "my run" "ckpt-one"')
    assert cell.ok and "/weights/ckpt-one" in cell.out, cell.text
    # again: the refusal names the magic's flag, not the Python keyword
    line = one_error_line(run(shell, '%openrl save "my run" "ckpt-one"'), "UsageError", "add --overwrite")
    assert "overwrite=True" not in line
    cell = run(shell, '%openrl save "my run" "ckpt-one" --overwrite')
    assert cell.ok and "/weights/ckpt-one" in cell.out, cell.text


def test_a_trailing_comment_is_a_comment_and_a_hash_inside_a_word_is_not(shell, server, monkeypatch):
    """As in Python: `%openrl connect URL  # why` (the README writes comments after magics)."""
    connect(shell, server, monkeypatch)
    registry.register("H", lambda prompt, completion, **info: 0.5)
    shell.user_ns["P"] = ["hi"]
    line = 'r = %openrl train --reward H --prompts P --steps 1 --group 2 --batch 1 --name "run #1"  # a note'
    cell = run(shell, line)
    assert cell.ok, cell.text
    assert shell.user_ns["r"].name == "run #1"
    shell.user_ns["r"].wait(120)
    cell = run(shell, "%openrl save 'run #1' v2   # --overwrite here is a comment")
    assert cell.ok and "/weights/v2" in cell.out, cell.text


def test_a_server_that_is_not_openrl_is_one_line(shell, monkeypatch):
    import http.server
    import threading

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", "/hub/login")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        one_error_line(
            run(shell, f"%openrl connect {url}"), "RequestError", "302", "/hub/login", "openrl service"
        )
    finally:
        httpd.shutdown()
    one_error_line(run(shell, "%openrl connect 127.0.0.1:8000"), "UsageError", "http://")


def test_keys_stay_hidden_even_in_verbose_tracebacks(shell, monkeypatch):
    monkeypatch.setenv("OPENRL_TOKEN", ALICE_KEY)
    monkeypatch.setattr(sess, "Client", _no_retry_client(sess.Client))
    shell.run_line_magic("xmode", "Verbose")
    try:
        with capture_output() as captured:
            shell.run_cell(f"import openrl_jupyter as oj\noj.connect('http://127.0.0.1:{free_port()}')")
        text = captured.stdout + captured.stderr
    finally:
        shell.run_line_magic("xmode", "Context")
    assert "ServiceUnavailable" in text and ALICE_KEY not in text


def test_reward_cells_accept_ipython_syntax_and_empty_tables_print(shell):
    name = f"ipy{time.monotonic_ns()}"
    cell = run(
        shell,
        f"%%openrl reward {name}\nx = !echo 3\ndef reward(prompt, completion, **info):\n    return 1.0\n",
    )
    assert cell.ok and "v1 registered" in cell.out, cell.text
    text = repr(shell.run_line_magic("openrl", "sessions"))
    assert text.split() == ["name", "url", "kind", "model", "runs"]


def test_disconnect_names_the_runs_it_stopped(shell, server, monkeypatch):
    connect(shell, server, monkeypatch)
    registry.register("D", lambda prompt, completion, **info: 0.5)
    shell.user_ns["P"] = ["hi"]
    assert run(
        shell, "r = %openrl train --reward D --prompts P --steps 500 --group 2 --batch 1 --name long"
    ).ok
    cell = run(shell, "%openrl disconnect")
    assert cell.ok and "stopped its active runs: long" in cell.out
    assert shell.user_ns["r"].done


def test_status_tables_fit_their_columns():
    """A long error wraps in its column; no other row is padded out to it, no line ends in spaces."""
    from openrl_jupyter.magics import Table

    error = "RunPaused: every sample failed in reward boom v1: ZeroDivisionError: division by zero " * 3
    text = repr(Table(["field", "value"], [["reward", "boom v1"], ["last error", error]]))
    lines = text.splitlines()
    assert "reward      boom v1" in lines and max(len(line) for line in lines) <= 12 + Table.LAST_WIDTH
    assert all(line == line.rstrip() for line in lines)
    assert " ".join(
        " ".join(line.split()[2:]) if i == 2 else line.strip() for i, line in enumerate(lines[2:], 2)
    )
    assert "".join(text.split()).count("ZeroDivisionError") == 3  # nothing of the error is cut


@pytest.mark.parametrize(
    "body, error, line",
    [
        ("def reward(prompt, completion, **info:\n    return 1.0\n", "SyntaxError", "def reward(prompt"),
        (
            "scale = 1 / 0\ndef reward(prompt, completion, **info):\n    return scale\n",
            "ZeroDivisionError",
            "1 / 0",
        ),
        ("def helper():\n    return {}['k']\nhelper()\n", "KeyError", "return {}['k']"),
    ],
    ids=["syntax", "raises", "raises-in-a-function"],
)
def test_a_reward_cell_that_fails_shows_the_users_lines_only(shell, body, error, line):
    """The traceback of a failing %%openrl reward cell is the user's code (its lines, its error), not
    the magic's machinery; nothing is registered."""
    cell = run(shell, f"%%openrl reward broken_cell\n{body}")
    assert not cell.ok
    assert error in cell.text and line in cell.text, cell.text
    assert "magics.py" not in cell.text and "openrl_jupyter" not in cell.text, cell.text
    assert "nothing was registered" in cell.text
    assert "broken_cell" not in registry.names()


def test_runs_marks_another_kernels_ended_runs_and_prune_forgets_only_those(shell, server, monkeypatch):
    """A kernel lists what an earlier one left: its finished run is 'finished' (not 'on service'),
    with a hint; --prune forgets it, and keeps the other kernel's paused run and this kernel's own."""
    connect(shell, server, monkeypatch, name="old")
    name = f"plain{time.monotonic_ns()}"
    assert run(
        shell,
        f"%%openrl reward {name}\ndef reward(prompt, completion, **info):\n    return len(completion) / 8\n",
    ).ok
    shell.user_ns["P"] = ["Say hi:", "Name a colour:"]
    common = "--prompts P --group 2 --batch 1 --max-tokens 4 --session old"
    assert run(shell, f"done = %openrl train --reward {name} {common} --steps 2 --name ended-early").ok
    assert run(shell, f"held = %openrl train --reward {name} {common} --steps 200 --name held-back").ok
    shell.user_ns["done"].wait(120)
    held = shell.user_ns["held"]
    deadline = time.monotonic() + 60
    while held.step < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run(shell, "%openrl pause held-back --wait --session old").ok
    ended_id, held_id = shell.user_ns["done"].run_id, held.run_id

    connect(shell, server, monkeypatch, name="new")
    table = shell.run_line_magic("openrl", "runs --session new")
    rows = {line.split()[0]: line for line in repr(table).splitlines()[1:] if line.strip()}
    assert "another kernel" in rows["ended-early"] and "finished" in rows["ended-early"], repr(table)
    assert "2/2" in rows["ended-early"] and "on service" not in repr(table)
    assert "paused" in rows["held-back"] and "--prune" in repr(table)

    with capture_output():
        table = shell.run_line_magic("openrl", "runs --prune --session new")
    forgot = repr(table).splitlines()[0].partition("ended or orphaned: ")[2].split(", ")
    assert "ended-early" in forgot and "held-back" not in forgot, repr(table)
    listed = {r["run_id"] for r in sess.get_session("new").client.list_runs()}
    assert ended_id not in listed and held_id in listed
    assert "nothing to prune" in repr(shell.run_line_magic("openrl", "runs --prune --session new"))
    assert run(shell, "%openrl stop held-back --wait --session old").ok


def test_train_takes_every_rl_knob_and_a_bad_one_fails_in_the_cell(shell, server, monkeypatch):
    connect(shell, server, monkeypatch)
    stamp = time.monotonic_ns()
    for reward in ("lettered", "short"):
        assert run(
            shell,
            f"%%openrl reward {reward}{stamp}\n"
            "def reward(prompt, completion, **info):\n"
            "    return sum(c.isalpha() for c in completion) / max(1, len(completion))\n",
        ).ok
    shell.user_ns["PROMPTS"] = ["Name a colour:", "Say hello:", "Write a word:"]
    shell.user_ns["HELD_OUT"] = ["Name a fruit:"]
    # past the model's context: refused in the cell, naming the option, the limit and its setting
    line = one_error_line(
        run(shell, f"%openrl train --reward lettered{stamp} --prompts PROMPTS --max-tokens 100000"),
        "UsageError",
        "max_tokens",
        "2048",
        "OPENRL_MAX_TOKENS",
    )
    assert "100000" in line
    one_error_line(
        run(shell, f"%openrl train --reward lettered{stamp} --prompts PROMPTS --rank 300"), "OPENRL_MAX_RANK"
    )
    cell = run(
        shell,
        f"knobbed = %openrl train --reward lettered{stamp}=1,short{stamp}=0.5 --prompts PROMPTS --steps 2 "
        "--group 2 --batch 2 --max-tokens 4 --kl-coef 0.1 --lr-schedule cosine --warmup-steps 1 --epochs 2 "
        "--minibatches 2 --loss-agg sequence --top-p 0.9 --top-k 20 --stop X --stop Y --eval-every 1 "
        f"--eval-prompts HELD_OUT --eval-metric short{stamp} --save-every 2 --no-skip-zero-variance",
    )
    assert cell.ok, cell.text
    r = shell.user_ns["knobbed"]
    k = r.config.knobs
    assert (k.kl_coef, k.lr_schedule, k.warmup_steps, k.epochs, k.minibatches, k.loss_agg) == (
        0.1,
        "cosine",
        1,
        2,
        2,
        "sequence",
    )
    assert (k.top_p, k.top_k, k.stop, k.eval_every, k.save_every, k.skip_zero_variance) == (
        0.9,
        20,
        ("X", "Y"),
        1,
        2,
        False,
    )
    assert [(n, w) for n, w, _ in r.config.parts] == [(f"lettered{stamp}", 1.0), (f"short{stamp}", 0.5)]
    assert r.config.eval_prompts[0]["prompt"] == "Name a fruit:" and r.config.eval_metric == f"short{stamp}"
    r.wait(240)
    frame = r.to_pandas()
    assert {f"rewards/lettered{stamp}", f"rewards/short{stamp}", "eval_reward", "kl_ref"} <= set(
        frame.columns
    )
    # a sweep takes the same knobs, and --kl-coef as a list to sweep over
    cell = run(
        shell,
        f"sw = %openrl sweep --reward lettered{stamp} --prompts PROMPTS --kl-coef 0,0.2 --epochs 2 --steps 1 "
        "--group 2 --batch 1 --max-tokens 4",
    )
    assert cell.ok, cell.text
    sw = shell.user_ns["sw"]
    sw.wait(240)
    assert sorted(run_.config.knobs.kl_coef for run_ in sw.runs) == [0.0, 0.2]
    assert all(run_.config.knobs.epochs == 2 for run_ in sw.runs)
    # one weighted reward for every run of a sweep
    cell = run(
        shell,
        f"sw2 = %openrl sweep --reward lettered{stamp}=1,short{stamp}=0.5 --prompts PROMPTS --lr 1e-3,2e-3 "
        "--steps 1 --group 2 --batch 1 --max-tokens 4",
    )
    assert cell.ok, cell.text
    shell.user_ns["sw2"].wait(240)
    for run_ in shell.user_ns["sw2"].runs:
        assert [(n, w) for n, w, _ in run_.config.parts] == [
            (f"lettered{stamp}", 1.0),
            (f"short{stamp}", 0.5),
        ]
