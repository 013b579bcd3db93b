"""The SQL sandbox: how one untrusted query runs against a text-to-SQL database (standard library only).

A scored query is text a model wrote (or a prompt a user wrote): it may try to write, to read files,
to allocate gigabytes in one step, or to run for ever. It gets exactly this:

- **Read-only by construction.** The database is opened by URI with ``mode=ro&immutable=1`` and
  ``PRAGMA query_only``; no other file can be attached (``SQLITE_LIMIT_ATTACHED`` = 0).
- **An allow-list, not a deny-list.** The authorizer allows four actions: ``SELECT``, reading a column
  of one of the database's own tables (or ``sqlite_schema``, which a prompt shows anyway; or rows the
  query's own CTEs and subqueries made), calling a
  function in :data:`ALLOWED_FUNCTIONS`, and a recursive CTE. Everything else is refused and the
  reason names what was refused: writes, ``PRAGMA``, ``ATTACH``, and table-valued functions
  (``json_each``, ``pragma_*``). The functions are SQLite's ordinary scalar, aggregate, date, math and
  window functions, which a text-to-SQL answer uses, minus the ones whose point is to allocate or to
  reach outside the query: ``zeroblob`` and ``randomblob`` (a blob of any size in one step),
  ``printf``/``format`` (``'%.*c'`` pads to any width in one step), ``load_extension``, the CLI's
  ``readfile``/``writefile``/``edit``, ``fts3_tokenizer``, the ``sqlite_*`` introspection functions
  and ``changes``-style connection state, and the JSON, FTS and R-tree families (nothing in these
  schemas needs them). A function that SQLite does not have is harmless on the list.
- **SQLite's own limits** (:data:`LIMITS`, ``Connection.setlimit``; Python 3.11+): 1 MB per string or
  blob, 100 result columns, 100 KB of SQL, expression depth 200, 50 compound SELECT terms, 25,000
  VDBE instructions per statement, 16 function arguments, LIKE/GLOB patterns of 200 bytes, no bound
  parameters. They hold on their own, on a platform that ignores address-space limits too: no value
  can pass 1 MB, no row 100 MB, and the rows fetched stop at ``max_rows`` or :data:`MAX_RESULT_BYTES`
  (the query scores 0 with "result too large").
- **A time limit** from a progress handler (every 1,000 VDBE instructions): a query past
  ``timeout_s`` stops with "time limit". One instruction can still be long (``instr`` over two
  near-1 MB strings takes seconds, and nothing inside SQLite can stop it): so queries run in a
  process of their own, watched from outside and killed past the limit (``openrl_jupyter.sql.reward``).

Run as a program (``python -I -S sandbox.py``: no site-packages, no environment, nothing but the
standard library), this module is that process (:func:`main`): it answers length-prefixed JSON
requests on its stdin with length-prefixed JSON replies on its stdout, one at a time, until its stdin
closes or its parent is gone. In it, SQLite's heap is capped (``PRAGMA hard_heap_limit``,
:data:`HEAP_LIMIT_BYTES`: process-wide, which is why only this process sets it), and so is the
address space (``RLIMIT_AS``, :data:`ADDRESS_SPACE_BYTES`) where the platform honours it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

FLOAT_DIGITS = 4
# a result's size as counted while it is fetched: characters of text, bytes of blobs, 8 per number
MAX_RESULT_BYTES = 16 * 2**20
# the scorer process: SQLite's heap, and the whole address space where the platform honours RLIMIT_AS
HEAP_LIMIT_BYTES = 256 * 2**20
ADDRESS_SPACE_BYTES = 2**30


def _words(*groups: str) -> tuple[str, ...]:
    return tuple(" ".join(groups).split())


# Functions a scored query may call (lower case): what text-to-SQL answers use.
ALLOWED_FUNCTIONS = frozenset(
    _words(
        # scalar
        "abs char coalesce concat concat_ws glob hex if ifnull iif instr length like likelihood likely lower "
        "ltrim max min nullif octet_length quote random replace round rtrim sign soundex substr substring "
        "trim typeof unhex unicode unlikely upper "
        # aggregate
        "avg count group_concat string_agg sum total "
        # date and time
        "date time datetime julianday unixepoch strftime timediff "
        # math (when SQLite is built with them)
        "acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln log log10 log2 mod "
        "pi pow power radians sin sinh sqrt tan tanh trunc "
        # window
        "row_number rank dense_rank percent_rank cume_dist ntile lag lead first_value last_value nth_value",
    )
)

# (name, value): SQLite's run-time limits on every sandboxed connection
LIMITS = (
    ("SQLITE_LIMIT_LENGTH", 1_000_000),
    ("SQLITE_LIMIT_SQL_LENGTH", 100_000),
    ("SQLITE_LIMIT_COLUMN", 100),
    ("SQLITE_LIMIT_EXPR_DEPTH", 200),
    ("SQLITE_LIMIT_COMPOUND_SELECT", 50),
    ("SQLITE_LIMIT_VDBE_OP", 25_000),
    ("SQLITE_LIMIT_FUNCTION_ARG", 16),
    ("SQLITE_LIMIT_ATTACHED", 0),
    ("SQLITE_LIMIT_LIKE_PATTERN_LENGTH", 200),
    ("SQLITE_LIMIT_VARIABLE_NUMBER", 0),
    ("SQLITE_LIMIT_TRIGGER_DEPTH", 1),
    ("SQLITE_LIMIT_WORKER_THREADS", 0),
)
_LIMIT = dict(LIMITS)
_SCHEMA_TABLES = frozenset({"sqlite_schema", "sqlite_master"})
_ACTIONS = {
    getattr(sqlite3, f"SQLITE_{n}"): n.replace("_", " ")
    for n in _words(
        "CREATE_INDEX CREATE_TABLE CREATE_TEMP_INDEX CREATE_TEMP_TABLE CREATE_TEMP_TRIGGER CREATE_TEMP_VIEW "
        "CREATE_TRIGGER CREATE_VIEW DELETE DROP_INDEX DROP_TABLE DROP_TEMP_INDEX DROP_TEMP_TABLE "
        "DROP_TEMP_TRIGGER DROP_TEMP_VIEW DROP_TRIGGER DROP_VIEW INSERT PRAGMA READ SELECT TRANSACTION "
        "UPDATE ATTACH DETACH ALTER_TABLE REINDEX ANALYZE CREATE_VTABLE DROP_VTABLE FUNCTION SAVEPOINT "
        "RECURSIVE"
    )
    if hasattr(sqlite3, f"SQLITE_{n}")
}


class SQLError(Exception):
    """A query that failed: the sqlite message, or the limit it hit."""


class Authorizer:
    """The allow-list as an sqlite3 authorizer; ``refused`` keeps why the last statement was refused."""

    def __init__(self, tables: frozenset[str]) -> None:
        self.readable = tables | _SCHEMA_TABLES  # the database's own tables and views, lower case
        self.refused: str | None = None

    def __call__(self, action: int, arg1: Any, arg2: Any, db: Any, trigger: Any) -> int:
        if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_RECURSIVE):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_READ:
            # no schema name: a CTE's or subquery's rows (or a count of a table's rows)
            if db is None or str(arg1).lower() in self.readable:
                return sqlite3.SQLITE_OK
            return self._deny(
                f"reading table {arg1} is not allowed: only this database's own tables can be read"
            )
        if action == sqlite3.SQLITE_FUNCTION:
            if str(arg2).lower() in ALLOWED_FUNCTIONS:
                return sqlite3.SQLITE_OK
            return self._deny(
                f"function {arg2}() is not allowed in a scored query "
                "(the allow-list is openrl_jupyter.sql.sandbox.ALLOWED_FUNCTIONS)"
            )
        what = _ACTIONS.get(action, f"action {action}")
        if action == sqlite3.SQLITE_PRAGMA:
            what = f"PRAGMA {arg1}"
        return self._deny(f"{what} is not allowed: a scored query may only read (SELECT)")

    def _deny(self, why: str) -> int:
        self.refused = self.refused or why
        return sqlite3.SQLITE_DENY


def connect(db: str | os.PathLike[str]) -> tuple[sqlite3.Connection, Authorizer]:
    """``db`` opened read-only, with the limits and the allow-list authorizer in place."""
    path = Path(db)
    if not path.is_file():
        raise FileNotFoundError(f"database not found: {path}")
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True, check_same_thread=False)
    try:
        if hasattr(con, "setlimit"):  # Python 3.11+; before it, the size and time checks below still hold
            for name, value in LIMITS:
                if hasattr(sqlite3, name):
                    con.setlimit(getattr(sqlite3, name), value)
        con.execute("PRAGMA query_only = 1")
        con.execute("PRAGMA temp_store = MEMORY")  # a big sort stays in the memory the process may use
        tables = frozenset(
            r[0].lower()
            for r in con.execute("SELECT name FROM sqlite_schema WHERE type IN ('table', 'view')")
        )
    except BaseException:
        con.close()
        raise
    auth = Authorizer(tables)
    con.set_authorizer(auth)
    return con, auth


def _norm(v: Any) -> Any:
    if isinstance(v, float):
        r = round(v, FLOAT_DIGITS)
        return int(r) if r.is_integer() else r
    return v


def _size(row: tuple[Any, ...]) -> int:
    return sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in row)


def _explain(e: BaseException) -> str:
    """The sqlite error, with the sandbox's limit when one was hit."""
    msg = f"{type(e).__name__}: {e}"
    if "too big" in str(e):
        msg += f" (the sandbox allows {_LIMIT['SQLITE_LIMIT_LENGTH']:,} bytes per string or blob)"
    elif "too many columns" in str(e):
        msg += f" (the sandbox allows {_LIMIT['SQLITE_LIMIT_COLUMN']} columns)"
    return msg


def run(
    sql: str,
    db: str | os.PathLike[str],
    *,
    timeout_s: float,
    max_rows: int,
    max_bytes: int = MAX_RESULT_BYTES,
    reuse: bool = False,
) -> list[tuple[Any, ...]]:
    """Run one query in the sandbox; its rows (floats rounded), or SQLError with the reason.

    ``reuse``: keep the connection open for the next query on the same file (the scorer process,
    which runs one query at a time; opening one costs more than most queries)."""
    if not sql.strip():
        raise SQLError("empty query")
    if len(sql.encode("utf-8", "replace")) > _LIMIT["SQLITE_LIMIT_SQL_LENGTH"]:
        raise SQLError(f"query too long: more than {_LIMIT['SQLITE_LIMIT_SQL_LENGTH']:,} bytes of SQL")
    con, auth = _reused(db) if reuse else connect(db)
    auth.refused = None
    deadline = time.monotonic() + timeout_s
    timed_out = False

    def progress() -> int:
        nonlocal timed_out
        if time.monotonic() > deadline:
            timed_out = True
            return 1
        return 0

    con.set_progress_handler(progress, 1000)
    cur = None
    try:
        cur = con.execute(sql)
        rows: list[tuple[Any, ...]] = []
        size = 0
        for row in cur:  # one row at a time: the size is checked before the next is made
            rows.append(tuple(_norm(v) for v in row))
            size += _size(row)
            if len(rows) > max_rows:
                raise SQLError(f"result too large: more than {max_rows} rows")
            if size > max_bytes:
                raise SQLError(f"result too large: more than {max_bytes // 2**20} MiB")
        return rows
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError) as e:
        if timed_out:
            raise SQLError(f"time limit: stopped after {timeout_s:g} s") from None
        vtab = re.match(r"vtable constructor failed: (\w+)", str(e))
        if vtab:  # refused while SQLite built it (by the first refusal, which names something internal)
            raise SQLError(
                f"table-valued function {vtab.group(1)} is not allowed: only this database's own tables can be read"
            ) from None
        if auth.refused:
            raise SQLError(auth.refused) from None
        if isinstance(e, MemoryError):
            raise SQLError("out of memory: the query needed more memory than the sandbox allows") from None
        raise SQLError(_explain(e)) from None
    finally:
        if cur is not None:
            cur.close()
        if not reuse:
            con.close()


_open: dict[tuple[str, int, int, int, int], tuple[sqlite3.Connection, Authorizer]] = {}
MAX_OPEN = 8


def _reused(db: str | os.PathLike[str]) -> tuple[sqlite3.Connection, Authorizer]:
    """A connection kept open per database file; a new one when the file changed (it is opened
    ``immutable``: an old connection would not see the change)."""
    path = os.path.realpath(db)
    try:
        st = os.stat(path)
    except OSError:
        raise FileNotFoundError(f"database not found: {path}") from None
    key = (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _open:
        for old in [k for k in _open if k[0] == path] or (
            [next(iter(_open))] if len(_open) >= MAX_OPEN else []
        ):
            _open.pop(old)[0].close()
        _open[key] = connect(path)
    return _open[key]


# -- the scorer process ------------------------------------------------------------------------------
HEADER = struct.Struct(">I")  # every message: its length, then that many bytes of UTF-8 JSON


def read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd``; None at end of file."""
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_message(fd: int, message: dict[str, Any]) -> None:
    data = json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def encode_value(v: Any) -> Any:
    """A result value as JSON: blobs as ``{"b": hex}`` (nothing else in a row is an object)."""
    return {"b": v.hex()} if isinstance(v, bytes) else v


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """One request's reply: ``{"rows": [...]}``, ``{"error": why}`` or ``{"missing": why}``."""
    try:
        rows = run(
            request["sql"],
            request["db"],
            timeout_s=float(request["timeout_s"]),
            max_rows=int(request["max_rows"]),
            reuse=True,
        )
        return {"rows": [[encode_value(v) for v in row] for row in rows]}
    except SQLError as e:
        return {"error": str(e)}
    except FileNotFoundError as e:
        return {"missing": str(e)}
    except MemoryError:
        return {"error": "out of memory: the query needed more memory than the sandbox allows"}
    except Exception as e:  # noqa: BLE001 - whatever a query does, the process answers and goes on
        return {"error": f"{type(e).__name__}: {e}"}


def _limit_process() -> None:
    with sqlite3.connect(":memory:") as con:  # process-wide: every connection of this process
        con.execute(f"PRAGMA hard_heap_limit = {HEAP_LIMIT_BYTES}")
    try:
        import resource

        for which, cap in ((resource.RLIMIT_AS, ADDRESS_SPACE_BYTES), (resource.RLIMIT_CORE, 0)):
            soft, hard = resource.getrlimit(which)
            if soft == resource.RLIM_INFINITY or soft > cap:
                resource.setrlimit(which, (cap, hard))
    except (ImportError, ValueError, OSError):  # not honoured everywhere: SQLite's limits still hold
        pass


def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone even while a query runs (its end of the pipe closing wakes an idle
    process at once). Polled, not PR_SET_PDEATHSIG: that fires when the parent *thread* that started
    this process ends, and scoring threads come and go."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a kernel interrupt goes to its process group: not for us
    requests, replies = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    try:
        os.dup2(2, 1)  # a stray print goes to stderr, never into the replies
    except OSError:  # no stderr
        os.dup2(devnull, 1)
    _limit_process()
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    write_message(replies, {"ready": os.getpid(), "sqlite": sqlite3.sqlite_version})
    while True:
        header = read_exact(requests, HEADER.size)
        body = read_exact(requests, HEADER.unpack(header)[0]) if header else None
        if body is None:  # the parent closed the pipe or is gone
            return
        try:
            reply = answer(json.loads(body))
            write_message(replies, reply)
        except MemoryError:
            write_message(
                replies, {"error": "out of memory: the result needed more memory than the sandbox allows"}
            )


if __name__ == "__main__":
    sys.exit(main())
