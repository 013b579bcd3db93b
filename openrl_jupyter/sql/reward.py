"""Execution-match reward for text-to-SQL: run predicted and gold SQL read-only and compare results.

    r = execution_match("SELECT name FROM customers", gold_sql, db_path)
    r.score   # 1.0 or 0.0
    r.error   # the sqlite error (or "result too large", "time limit"), None when the query ran

A query runs in the sandbox of ``openrl_jupyter.sql.sandbox``: read-only, an allow-list of
actions, tables and functions, SQLite's own size limits, a time limit, and at most ``max_rows`` rows
(more scores 0 with "result too large"). Results are compared as multisets of row tuples (floats
rounded), or as ordered lists when the gold query has ORDER BY.

**The scorer process.** Queries never run in the calling process (a kernel, a detached job): one
scorer process per calling process runs them, started on first use and reused for every query after
(an RL step scores 64+ samples: one process, not one per sample). A **watchdog** here waits for each
answer at most ``timeout_s`` plus a grace (1 s, or ``timeout_s`` when that is longer); past it the
process is killed, the query scores 0 with "time limit: ... watchdog", and the next query starts a
fresh process. So one huge SQLite step, which the in-process progress handler cannot interrupt, costs
a second or two, and a query that crashes the process costs a 0 with the reason, never the kernel.

How it is started, and why: ``subprocess.Popen([sys.executable, "-I", "-S", sandbox.py])`` with pipes
(fork+exec in C, safe from a multi-threaded kernel, unlike a plain fork; no ``multiprocessing`` spawn,
which would re-import the kernel's ``__main__`` and its sys.path), the same interpreter, standard
library only (``-I -S``: no site-packages, no ``PYTHON*`` variables, never torch). Requests and replies
are length-prefixed JSON, never pickle: a scorer that a query could subvert still cannot run code in
the kernel. It is safe from threads (the reward's scoring pool): one lock serialises requests. It
ends with its parent: at interpreter exit (``atexit``), when the parent dies (its stdin closes, and it
polls its parent id while a query runs), and a forked child of the kernel starts its own.
Gold results are cached here per (database file digest, gold SQL, ``max_rows``).
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import json
import os
import re
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from openrl_jupyter.sql import sandbox
from openrl_jupyter.sql.sandbox import SQLError

DEFAULT_TIMEOUT_S = 1.0
DEFAULT_MAX_ROWS = 10_000
FLOAT_DIGITS = sandbox.FLOAT_DIGITS
WATCHDOG_GRACE_S = 1.0  # the watchdog kills a query at timeout_s + max(this, timeout_s)
STARTUP_TIMEOUT_S = 60.0  # a scorer process that is not ready by then is a broken install, not a query
GOLD_CACHE_SIZE = 4096
# a reply larger than this is no answer (the scorer caps a result at MAX_RESULT_BYTES as it counts them)
MAX_REPLY_BYTES = 8 * sandbox.MAX_RESULT_BYTES


@dataclass(frozen=True)
class MatchResult:
    score: float
    error: str | None = None  # why the predicted query scored 0 without running to a result
    rows: int | None = None  # rows the predicted query returned

    def __float__(self) -> float:
        return self.score


def extract_sql(completion: str) -> str:
    """The SQL in a model's completion: a ```sql fence if there is one, else the text from the first
    SELECT/WITH; cut after the first complete statement, trailing semicolons dropped."""
    text = completion
    fence = re.search(r"```(?:sql|sqlite)?[ \t]*\n?(.*?)(?:```|$)", text, re.S | re.I)
    if fence:
        text = fence.group(1)
    # SQL in capitals anywhere, else a line that starts with select/with ("to select ..." is prose)
    m = re.search(r"\b(SELECT|WITH)\b", text) or re.search(r"^\s*(select|with)\b", text, re.I | re.M)
    if m:
        text = text[m.start() :]
    for i, ch in enumerate(text):
        if ch == ";" and sqlite3.complete_statement(text[: i + 1]):
            text = text[:i]
            break
    return text.strip().rstrip(";").strip()


class _Scorer:
    """The scorer process of this process: started on first use, started again after it died or the
    watchdog killed it. Requests are serialised by ``lock``; ``proc`` changes only under it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        proc = self.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def query(self, sql: str, db: str, timeout_s: float, max_rows: int) -> list[tuple[Any, ...]]:
        request = {"sql": sql, "db": db, "timeout_s": timeout_s, "max_rows": max_rows}
        watchdog_s = timeout_s + max(WATCHDOG_GRACE_S, timeout_s)
        with self.lock:
            for attempt in (1, 2):
                proc = self._running()
                try:
                    sandbox.write_message(proc.stdin.fileno(), request)
                    break
                except OSError:  # it died since the last query (killed from outside): once more
                    self.stop()
                    if attempt == 2:
                        raise
                except BaseException:  # interrupted mid-request: the process cannot be trusted to be in step
                    self.stop()
                    raise
            try:
                reply = self._reply(proc, time.monotonic() + watchdog_s)
            except TimeoutError:
                self.stop()
                raise SQLError(
                    f"time limit: stopped by the watchdog after {watchdog_s:g} s (one step of the query "
                    f"ran past the {timeout_s:g} s limit); the scorer process was killed and starts again"
                ) from None
            except EOFError:
                how = self.stop()
                raise SQLError(
                    f"the query stopped the scorer process ({how}); it starts again for the next query"
                ) from None
            except BaseException:  # e.g. KeyboardInterrupt: the reply still to come must never be
                self.stop()  # taken for the next query's
                raise
        if "missing" in reply:
            raise FileNotFoundError(reply["missing"])
        if "error" in reply:
            raise SQLError(reply["error"])
        return [
            tuple(bytes.fromhex(v["b"]) if isinstance(v, dict) else v for v in row) for row in reply["rows"]
        ]

    def _running(self) -> subprocess.Popen[bytes]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.stop()
        if not sys.executable:
            raise RuntimeError("cannot start the SQL scorer process: sys.executable is empty")
        script = sandbox.__file__
        program = [script] if os.path.isfile(script) else ["-c", inspect.getsource(sandbox)]
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", *program],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            close_fds=True,
            cwd=os.path.dirname(os.path.abspath(script)) or "/",
        )
        self.proc = proc
        try:
            ready = self._reply(proc, time.monotonic() + STARTUP_TIMEOUT_S)
        except (TimeoutError, EOFError):
            how = self.stop()
            raise RuntimeError(
                f"the SQL scorer process ({sys.executable} -I -S {script}) did not start within "
                f"{STARTUP_TIMEOUT_S:g} s ({how}); its error, if any, is on this process's stderr"
            ) from None
        except BaseException:  # interrupted: its "ready" must never be taken for a reply
            self.stop()
            raise
        if ready.get("ready") != proc.pid:
            self.stop()
            raise RuntimeError(f"the SQL scorer process answered {ready!r} instead of being ready")
        return proc

    def _reply(self, proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
        """The next message from ``proc``; TimeoutError past ``deadline``, EOFError if it ended."""
        fd = proc.stdout.fileno()
        poller = select.poll()  # not select(): a kernel may hold more than FD_SETSIZE descriptors
        poller.register(fd, select.POLLIN)

        def read(n: int) -> bytes:
            chunks = []
            while n:
                left = deadline - time.monotonic()
                if left <= 0 or not poller.poll(left * 1000):
                    raise TimeoutError
                chunk = os.read(fd, min(n, 1 << 20))
                if not chunk:
                    raise EOFError
                chunks.append(chunk)
                n -= len(chunk)
            return b"".join(chunks)

        (size,) = sandbox.HEADER.unpack(read(sandbox.HEADER.size))
        if size > MAX_REPLY_BYTES:
            raise EOFError  # not a reply this side reads: the process is stopped
        return json.loads(read(size).decode("utf-8", "surrogatepass"))

    def stop(self) -> str:
        """Kill the process (if any) and say how it ended."""
        proc, self.proc = self.proc, None
        if proc is None:
            return "not running"
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"


_scorer = _Scorer()


def _after_fork() -> None:
    """In a forked child: the parent's scorer is not ours to use or stop; close our copies of its
    pipes (so it still sees its parent's end close) and start our own when asked."""
    global _scorer
    proc = _scorer.proc
    if proc is not None:
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        proc.returncode = 0  # not our child: never waited for here
    _scorer = _Scorer()


def _at_exit() -> None:
    if _scorer.lock.acquire(timeout=1.0):
        try:
            _scorer.stop()
        finally:
            _scorer.lock.release()
    elif (proc := _scorer.proc) is not None:  # a daemon thread is still waiting on a query: end it anyway
        proc.kill()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
atexit.register(_at_exit)


def scorer_pid() -> int | None:
    """The process id of this process's SQL scorer, None before the first query (or after it ended)."""
    return _scorer.pid


def run_query(
    sql: str,
    db: str | os.PathLike[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_rows: int = DEFAULT_MAX_ROWS,
) -> list[tuple[Any, ...]]:
    """Run one read-only query in the scorer process, with a time limit and a row cap; raise SQLError
    on any failure (FileNotFoundError when ``db`` is not there)."""
    if not sql.strip():
        raise SQLError("empty query")
    limit = dict(sandbox.LIMITS)["SQLITE_LIMIT_SQL_LENGTH"]
    if len(sql.encode("utf-8", "replace")) > limit:
        raise SQLError(f"query too long: more than {limit:,} bytes of SQL")
    path = os.path.abspath(os.fspath(db))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"database not found: {path}")
    return _scorer.query(sql, path, float(timeout_s), int(max_rows))


_gold_lock = threading.Lock()
_gold: OrderedDict[tuple[str, str, int], list[tuple[Any, ...]]] = OrderedDict()
_digests: dict[tuple[str, int, int, int, int], str] = {}


def _digest(path: str) -> str:
    """SHA-256 of the database file, remembered while the file stays the same (device, inode, size, mtime)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    digest = _digests.get(key)
    if digest is None:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        _digests[key] = digest
    return digest


def _gold_rows(
    gold_sql: str, db: str | os.PathLike[str], timeout_s: float, max_rows: int
) -> list[tuple[Any, ...]]:
    path = os.fspath(db)
    key = (_digest(path) if os.path.isfile(path) else "", gold_sql, max_rows)
    with _gold_lock:
        if key in _gold:
            _gold.move_to_end(key)
            return _gold[key]
    rows = run_query(gold_sql, db, timeout_s=timeout_s, max_rows=max_rows)
    with _gold_lock:
        _gold[key] = rows
        while len(_gold) > GOLD_CACHE_SIZE:
            _gold.popitem(last=False)
    return rows


def execution_match(
    pred_sql: str,
    gold_sql: str,
    db: str | os.PathLike[str],
    *,
    ordered: bool | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_rows: int = DEFAULT_MAX_ROWS,
) -> MatchResult:
    """1.0 when ``pred_sql`` returns the same result as ``gold_sql`` on ``db``, else 0.0 with the error.

    ``ordered`` defaults to whether the gold query has ORDER BY. A gold query that fails raises
    SQLError (that is a data bug, not the model's fault); a gold result is cached for the next call.
    """
    gold = _gold_rows(gold_sql, db, max(timeout_s, 5.0), max_rows)
    if ordered is None:
        ordered = re.search(r"\border\s+by\b", gold_sql, re.I) is not None
    try:
        pred = run_query(pred_sql, db, timeout_s=timeout_s, max_rows=max_rows)
    except SQLError as e:
        return MatchResult(0.0, str(e))
    same = pred == gold if ordered else Counter(pred) == Counter(gold)
    return MatchResult(1.0 if same else 0.0, None, len(pred))


def sql_reward(prompt: str, completion: str, **info: Any) -> float:
    """A per-sample reward in the notebook's shape: ``info`` carries the example's fields.

    The database is ``info["db_path"]`` when given and there, else rebuilt from ``info["db_id"]``
    and ``info["seed"]`` (default 0): a detached run gets it back from the seed, not the kernel's file. The sqlite error of a failed query is printed, so it lands in the
    run's log.
    """
    from openrl_jupyter.sql.cache import database_path

    for key in ("sql", "db_id"):
        if key not in info and not (key == "db_id" and "db_path" in info):
            raise KeyError(f"sql_reward needs info[{key!r}] (the example's fields)")
    db = info.get("db_path")
    if not db or ("db_id" in info and not os.path.exists(db)):  # e.g. a kernel's path, in a job
        db = database_path(info["db_id"], int(info.get("seed", 0)))
    result = execution_match(
        extract_sql(completion),
        info["sql"],
        db,
        ordered=info.get("ordered"),
        timeout_s=float(info.get("timeout_s", DEFAULT_TIMEOUT_S)),
        max_rows=int(info.get("max_rows", DEFAULT_MAX_ROWS)),
    )
    if result.error:
        print(f"sql error: {result.error}")
    return result.score
