"""Execution-match reward for text-to-SQL: run predicted and gold SQL read-only and compare results.

    r = execution_match("SELECT name FROM customers", gold_sql, db_path)
    r.score   # 1.0 or 0.0
    r.error   # the sqlite error (or "result too large", "time limit"), None when the query ran

A query runs in the sandbox of ``openrl_jupyter.sql.sandbox``: read-only, an allow-list of
actions, tables and functions, SQLite's own size limits, a time limit, and at most ``max_rows`` rows
(more scores 0 with "result too large"). Results are compared as multisets of row tuples (floats
rounded), or as ordered lists when the gold query has ORDER BY.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections import Counter
from dataclasses import dataclass
from typing import Any

from openrl_jupyter.sql import sandbox
from openrl_jupyter.sql.sandbox import SQLError

DEFAULT_TIMEOUT_S = 1.0
DEFAULT_MAX_ROWS = 10_000
FLOAT_DIGITS = sandbox.FLOAT_DIGITS


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


def run_query(
    sql: str,
    db: str | os.PathLike[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_rows: int = DEFAULT_MAX_ROWS,
) -> list[tuple[Any, ...]]:
    """Run one read-only query with a time limit and a row cap; raise SQLError on any failure."""
    return sandbox.run(sql, db, timeout_s=timeout_s, max_rows=max_rows)


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
    SQLError (that is a data bug, not the model's fault).
    """
    gold = run_query(gold_sql, db, timeout_s=max(timeout_s, 5.0), max_rows=max_rows)
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
    from openrl_jupyter.sql.data import database_path

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
