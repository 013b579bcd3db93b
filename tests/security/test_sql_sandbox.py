"""The text-to-SQL reward against a hostile query, and against a hostile neighbour on the host (issue 21).

A model's completion (or a prompt a user wrote) is SQL that the kernel's or a detached job's reward
runs. Whatever it tries, it scores 0.0 with the reason kept, the kernel's process never holds the
query's memory or waits past the time limit, and the next query scores normally. Queries run in one
scorer process per kernel (or job), started once and again after it was stopped, and gone with it.

The databases it scores against come from a per-user private cache: a database that another account
planted (in the old shared /tmp/openrl-sql, or in a cache folder it owns) is refused or never seen,
and one that is not what the generator builds is rebuilt before use.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import select
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from openrl_jupyter.sql import execution_match, generate, sql_reward
from openrl_jupyter.sql.reward import SQLError

GOLD = "SELECT name FROM customers WHERE city = 'Oslo'"
# strings built by doubling: every step is small (so no time limit stops it), the result is not
_DOUBLE = "WITH RECURSIVE s(x, n) AS (SELECT 'a', 0 UNION ALL SELECT x || x, n + 1 FROM s WHERE n < {n})"

# (query, what its reason names): each allocates up to SQLite's length limit (~1 GB) per value, or
# piles values up, unless the sandbox stops it
MEMORY_ATTACKS = {
    "two 1 GB zeroblobs": ("SELECT zeroblob(999999999), zeroblob(999999999)", "zeroblob"),
    "a 1 GB randomblob": ("SELECT randomblob(999999999)", "randomblob"),
    "printf padding": ("SELECT printf('%.*c', 999999999, 'x')", "printf"),
    "format padding": ("SELECT format('%.*c', 999999999, 'x')", "format"),
    "a recursive CTE over zeroblob": (
        "WITH RECURSIVE c(b, n) AS (SELECT zeroblob(100000000), 0 UNION ALL "
        "SELECT b || b, n + 1 FROM c WHERE n < 8) SELECT n, length(b) FROM c",
        "zeroblob",
    ),
    "a string doubled towards 1 GB": (
        _DOUBLE.format(n=30) + " SELECT max(length(x)) FROM s",
        "string or blob too big",
    ),
    "9,000 rows of a 512 KB string": (
        _DOUBLE.format(n=19) + ", r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 9000) "
        "SELECT x FROM s, r WHERE s.n = 19",
        "result too large",
    ),
    "one row of 400 copies of a 512 KB string": (
        _DOUBLE.format(n=19) + " SELECT " + ", ".join(["x"] * 400) + " FROM s WHERE n = 19",
        "too many columns",
    ),
}

# One VDBE instruction that runs for seconds: instr() over a 786,432-character haystack and a needle of
# 262,144 'a's and a 'b' that almost matches at every position; eight of them in one row, so the
# progress handler (every 1,000 instructions) never runs before the row is done (~1 min on 2 cores).
HUGE_STEP = (
    _DOUBLE.format(n=19) + ", h(hay) AS (SELECT a.x || b.x FROM s AS a, s AS b WHERE a.n = 19 AND b.n = 18), "
    "nd(needle) AS (SELECT x || 'b' FROM s WHERE n = 18) "
    "SELECT " + ", ".join(["instr(hay, needle)"] * 8) + " FROM h, nd"
)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return generate(0, directory=tmp_path_factory.mktemp("sql-attack"), per_template=1).db_path("shop")


def peak_rss_mib() -> float:
    """This process's peak resident memory (the kernel's, in these tests)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


@pytest.fixture
def kernel_memory_cap():
    """This process's address space capped 3 GiB above what it maps now, as the issue tried it: an
    attack whose memory lands in the kernel raises MemoryError here instead of exhausting the machine."""
    status = Path("/proc/self/status")
    if not status.exists():
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(re.search(r"VmSize:\s+(\d+) kB", status.read_text()).group(1)) * 1024
    cap = mapped + 3 * 2**30
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize(("sql", "reason"), MEMORY_ATTACKS.values(), ids=MEMORY_ATTACKS.keys())
def test_a_query_that_would_exhaust_memory_scores_0_with_the_reason(db, sql, reason, kernel_memory_cap):
    before = peak_rss_mib()
    r = execution_match(sql, GOLD, db)
    assert r.score == 0.0 and r.error is not None and reason in r.error, r
    assert peak_rss_mib() - before < 200, "the kernel held the query's memory"
    assert execution_match(GOLD, GOLD, db).score == 1.0  # the next query scores normally


@pytest.mark.parametrize(
    ("sql", "name"),
    [
        ("SELECT sqlite_version()", "sqlite_version"),
        ("SELECT load_extension('/tmp/x.so')", "load_extension"),
        ("SELECT json_extract('{\"a\": 1}', '$.a')", "json_extract"),
        ("SELECT value FROM json_each('[1, 2]')", "json_each"),
        (
            "SELECT name FROM customers WHERE name = (SELECT sqlite_compileoption_get(0))",
            "sqlite_compileoption_get",
        ),
    ],
)
def test_a_function_or_table_outside_the_allow_list_is_refused_by_name(db, sql, name):
    r = execution_match(sql, GOLD, db)
    assert r.score == 0.0 and r.error is not None and name in r.error, r
    assert "not allowed" in r.error


def test_a_gold_query_the_sandbox_refuses_is_a_data_error(db):
    with pytest.raises(SQLError, match="zeroblob"):
        execution_match(GOLD, "SELECT zeroblob(10)", db)


def test_an_attack_in_a_training_step_scores_0_with_its_reason_in_the_log(db):
    """Through the notebook's own reward path (a run's scoring step): the attack's sample scores 0,
    the step's log says why, and the other samples of the step score normally."""
    from openrl_jupyter.rewards import pinned, score

    info = {"sql": GOLD, "db_id": "shop", "db_path": str(db)}
    completions = [
        "```sql\nSELECT zeroblob(999999999), zeroblob(999999999);\n```",
        f"```sql\n{GOLD};\n```",
        "SELECT printf('%.*c', 999999999, 'x')",
        "SELECT name FROM customers",
    ]
    scored = asyncio.run(score(pinned(sql_reward), ["q"] * 4, completions, [info] * 4))
    assert scored.rewards == [0.0, 1.0, 0.0, 0.0] and scored.errors == [None] * 4
    log = scored.stdout
    assert "sql error:" in log and "zeroblob" in log and "printf" in log, log


def test_a_single_huge_step_is_stopped_by_the_watchdog(db):
    r = execution_match(HUGE_STEP, GOLD, db, timeout_s=0.5)
    assert r.score == 0.0 and r.error is not None and r.error.startswith("time limit"), r
    assert "watchdog" in r.error, r
    assert execution_match(GOLD, GOLD, db).score == 1.0  # a fresh scorer answers the next query


def test_one_scorer_process_serves_every_sample_of_a_step(db):
    """An RL step scores 64+ samples: one process serves them all, not one process per sample."""
    from openrl_jupyter.sql.reward import scorer_pid

    pids = set()
    for i in range(64):
        assert execution_match(GOLD if i % 2 else "SELECT 1", GOLD, db).score == i % 2
        pids.add(scorer_pid())
    assert len(pids) == 1 and None not in pids and os.getpid() not in pids, pids


def test_concurrent_scoring_threads_each_get_their_answer_while_one_query_is_killed(db):
    """The kernel scores from a thread pool (several runs at once): every thread gets its own answer,
    and a query stopped by the watchdog takes none of the others with it."""
    queries = [(GOLD, 1.0), ("SELECT name FROM customers", 0.0), ("SELECT zeroblob(999999999)", 0.0)]

    def work(k: int) -> list[tuple[float, float]]:
        out = []
        for i in range(30):
            sql, want = queries[(i + k) % len(queries)]
            out.append((execution_match(sql, GOLD, db).score, want))
        return out

    with ThreadPoolExecutor(8) as pool:
        huge = pool.submit(execution_match, HUGE_STEP, GOLD, db, timeout_s=0.5)
        results = [f.result() for f in [pool.submit(work, k) for k in range(6)]]
    assert huge.result().error.startswith("time limit"), huge.result()
    assert all(got == want for r in results for got, want in r), results


def gone(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` (not necessarily our child) has exited within ``timeout_s``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def test_a_scorer_that_died_between_steps_is_started_again(db):
    from openrl_jupyter.sql.reward import scorer_pid

    assert execution_match(GOLD, GOLD, db).score == 1.0
    pid = scorer_pid()
    os.kill(pid, signal.SIGKILL)
    assert gone(pid, 30)
    assert execution_match(GOLD, GOLD, db).score == 1.0  # scored normally, not 0
    assert scorer_pid() not in (None, pid)


KERNEL = textwrap.dedent(
    """
    import sys
    from openrl_jupyter.sql import execution_match
    from openrl_jupyter.sql.reward import scorer_pid
    assert execution_match(sys.argv[2], sys.argv[2], sys.argv[1]).score == 1.0
    print(scorer_pid(), flush=True)
    if sys.argv[3] == "wait":
        sys.stdin.read()
    """
)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on the scorer with a pidfd (Linux)")
@pytest.mark.parametrize("end", ["exits", "is killed"])
def test_the_scorer_process_ends_with_its_kernel(db, end):
    proc = subprocess.Popen(
        [sys.executable, "-c", KERNEL, str(db), GOLD, "wait" if end == "is killed" else "exit"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    with proc:
        line = proc.stdout.readline()
        if end == "is killed":
            proc.kill()
        proc.wait(timeout=120)
    assert line.strip().isdigit(), f"the kernel printed no scorer pid: {line!r}"
    assert gone(int(line), 30), f"the scorer outlived its kernel ({end})"


def test_interrupting_the_kernel_mid_query_leaves_the_next_query_in_step(db):
    """The notebook scores in its main thread too: an interrupt (KeyboardInterrupt) during a query must
    not leave that query's late answer to be read as the next query's."""
    import threading

    # A kernel handles SIGINT; this process may have inherited it ignored (started in the background
    # by a script, as make test's second pytest is): handle it here as a kernel does.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            execution_match(HUGE_STEP, GOLD, db, timeout_s=30)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert execution_match(GOLD, GOLD, db).score == 1.0
    assert execution_match("SELECT name FROM customers", GOLD, db).score == 0.0


# -- a hostile neighbour: planted and tampered databases --------------------------------------------
ATTACKER = 12345  # another account on the same host (the tests run as root, so they can chown to it)
INFO = {"sql": GOLD, "db_id": "shop", "seed": 0}  # no db_path: rebuilt from db_id and seed, as in a job


@pytest.fixture
def host(tmp_path, monkeypatch):
    """The host's shared temporary folder and this user's home, inside the test's folder."""
    import tempfile
    from types import SimpleNamespace

    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return SimpleNamespace(shared=shared, home=home, cache=home / ".cache" / "openrl-jupyter" / "sql")


def db_name() -> str:
    from openrl_jupyter.sql.schemas import GENERATOR_VERSION

    return f"shop-v{GENERATOR_VERSION}-seed0.sqlite"


def plant(path: Path, owner: int | None = ATTACKER) -> Path:
    """A database in which the gold query's answer is 'pwned', so ``SELECT 'pwned'`` matches it."""
    import sqlite3

    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT, joined_year INTEGER)")
    con.execute("INSERT INTO customers VALUES (1, 'pwned', 'Oslo', 2020)")
    con.commit()
    con.close()
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def fresh_digest(tmp_path: Path) -> str:
    import hashlib

    from openrl_jupyter.sql.schemas import build_database

    return hashlib.sha256(build_database("shop", 0, tmp_path / "fresh.sqlite").read_bytes()).hexdigest()


def digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_database_planted_in_the_shared_temp_folder_is_never_used(host):
    from openrl_jupyter.sql.cache import database_path

    folder = host.shared / "openrl-sql"  # where every account's rewards used to look
    plant(folder / db_name())
    os.chown(folder, ATTACKER, ATTACKER)
    assert sql_reward("q", "SELECT 'pwned'", **INFO) == 0.0
    assert sql_reward("q", GOLD, **INFO) == 1.0
    assert host.shared not in database_path("shop", 0).parents


def _unsafe(case: str, folder: Path) -> tuple[Path, str]:
    """Set up ``folder`` (the cache folder) as ``case`` says; the path the refusal must name, and why."""
    if case == "folder owned by another account":
        plant(folder / db_name())
        os.chown(folder, ATTACKER, ATTACKER)
        return folder, f"owned by uid {ATTACKER}"
    if case == "folder writable by others":
        plant(folder / db_name(), owner=None)
        folder.chmod(0o777)
        return folder, "writable by"
    if case == "parent folder owned by another account":
        plant(folder / db_name(), owner=None)
        folder.chmod(0o700)
        os.chown(folder.parent, ATTACKER, ATTACKER)
        return folder.parent, f"owned by uid {ATTACKER}"
    folder.mkdir(parents=True, mode=0o700)
    target = folder / db_name()
    if case == "file owned by another account":
        plant(target).chmod(0o600)
        return target, f"owned by uid {ATTACKER}"
    if case == "file writable by others":
        plant(target, owner=None).chmod(0o666)
        return target, "writable by"
    if case == "file is a symbolic link":
        target.symlink_to(plant(folder.parent / "elsewhere.sqlite"))
        return target, "symbolic link"
    raise AssertionError(case)


UNSAFE = [
    "folder owned by another account",
    "folder writable by others",
    "parent folder owned by another account",
    "file owned by another account",
    "file writable by others",
    "file is a symbolic link",
]


@pytest.mark.parametrize("case", UNSAFE)
def test_an_unsafe_default_cache_is_refused_naming_the_path_and_why(host, case):
    from openrl_jupyter.sql.cache import database_path

    host.cache.parent.mkdir(parents=True, mode=0o700)
    where, why = _unsafe(case, host.cache)
    with pytest.raises(PermissionError) as refused:
        database_path("shop", 0)
    assert str(where) in str(refused.value) and why in str(refused.value), refused.value
    with pytest.raises(PermissionError):  # the reward fails with the reason: never a 1.0 from the plant
        sql_reward("q", "SELECT 'pwned'", **INFO)


@pytest.mark.parametrize("case", UNSAFE)
def test_an_unsafe_explicit_directory_is_refused_naming_the_path_and_why(tmp_path, case):
    folder = tmp_path / "parent" / "mine"
    folder.parent.mkdir(mode=0o700)
    where, why = _unsafe(case, folder)
    with pytest.raises(PermissionError) as refused:
        generate(0, directory=folder, per_template=1)
    assert str(where) in str(refused.value) and why in str(refused.value), refused.value


@pytest.mark.parametrize("where", ["default", "directory="])
def test_a_tampered_database_of_the_same_owner_is_rebuilt_before_use(host, tmp_path, where):
    """Same owner, private modes, wrong content (a stale generator, a bad disk, a plant by a process
    of this user): not trusted; rebuilt from the seed, and scored against the rebuilt one."""
    from openrl_jupyter.sql.cache import database_path

    folder = host.cache if where == "default" else tmp_path / "explicit"
    folder.mkdir(parents=True, mode=0o700)
    plant(folder / db_name(), owner=None).chmod(0o600)
    directory = None if where == "default" else folder
    path = database_path("shop", 0, directory)
    assert path == folder / db_name() and digest(path) == fresh_digest(tmp_path)
    info = {**INFO, "db_path": str(path)}
    assert sql_reward("q", "SELECT 'pwned'", **info) == 0.0
    assert sql_reward("q", GOLD, **info) == 1.0


def test_a_database_replaced_after_first_use_is_checked_again(host, tmp_path):
    from openrl_jupyter.sql.cache import database_path

    path = database_path("shop", 0)
    os.replace(plant(tmp_path / "new.sqlite", owner=None), path)
    assert database_path("shop", 0) == path and digest(path) == fresh_digest(tmp_path)
    assert sql_reward("q", "SELECT 'pwned'", **INFO) == 0.0
