"""Text-to-SQL data, generated offline and deterministically from a seed.

Four schemas (shop, school, flights, library), each a small SQLite database with foreign keys and
realistic values drawn from built-in word lists. Questions come from templates (selection, filters,
joins, aggregates, GROUP BY/HAVING, ORDER BY/LIMIT, nested subqueries) filled with values that exist
in the data; every gold query is executed at generation time and kept only if it returns rows (and,
for LIMIT queries, only if no tie makes the answer ambiguous). Train and test are split **by
schema**: test questions are about databases never seen in training.

    ds = generate(seed=0)              # train on shop + school, test on flights + library
    ds.test[0]["question"], ds.test[0]["sql"]
    ds.db_path("flights")              # a SQLite file built from the seed (cached per seed, per user)
    prompt = render_prompt(ds.test[0])
"""

from __future__ import annotations

import os
import random
import re
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openrl_jupyter.sql.cache import database_path
from openrl_jupyter.sql.questions import _TEMPLATES
from openrl_jupyter.sql.schemas import _SCHEMAS, DEFAULT_TEST_SCHEMAS, SCHEMAS

# ---------------------------------------------------------------------------------------------


@dataclass
class SQLDataset:
    seed: int
    train: list[dict[str, Any]]
    test: list[dict[str, Any]]
    train_schemas: tuple[str, ...]
    test_schemas: tuple[str, ...]
    directory: Path | None = field(default=None)

    def db_path(self, db_id: str) -> Path:
        return database_path(db_id, self.seed, self.directory)


def schema_text(db_id: str) -> str:
    """The CREATE statements of ``db_id``, as shown in a prompt."""
    if db_id not in _SCHEMAS:
        raise ValueError(f"db_id must be one of {', '.join(SCHEMAS)}, got {db_id!r}")
    return _SCHEMAS[db_id].ddl


def _ambiguous_limit(con: sqlite3.Connection, sql: str) -> bool:
    """True when a LIMIT k query has a tie on the ORDER BY key among its first k + 1 rows (so the
    answer, or its order, would depend on how sqlite breaks ties)."""
    m = re.search(r"ORDER BY (.+?) (?:DESC|ASC) LIMIT (\d+)$", sql)
    if not m:
        return False
    k = int(m.group(2))
    probe = sql[: m.start(2)].replace("SELECT ", f"SELECT {m.group(1)} AS _k, ", 1) + str(k + 1)
    rows = con.execute(probe).fetchall()
    keys = [r[0] for r in rows]
    return len(set(keys)) < len(keys)


def _examples_for(db_id: str, seed: int, per_template: int, directory: Path | None) -> list[dict[str, Any]]:
    schema = _SCHEMAS[db_id]
    path = database_path(db_id, seed, directory)
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    rng = random.Random(f"{seed}:{db_id}:questions")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    try:
        for template in _TEMPLATES:
            for _ in range(per_template * 3):
                if sum(1 for e in out if e["_t"] == template.__name__) >= per_template:
                    break
                made = template(schema, con, rng)
                if made is None:  # this draw (a table or link) does not fit the template
                    continue
                question, sql, difficulty = made
                if sql in seen:
                    continue
                rows = con.execute(sql).fetchall()
                if not rows or all(v is None for r in rows for v in r) or _ambiguous_limit(con, sql):
                    continue
                seen.add(sql)
                out.append(
                    {
                        "db_id": db_id,
                        "schema": schema.ddl,
                        "question": question,
                        "sql": sql,
                        "ordered": " ORDER BY " in sql,
                        "difficulty": difficulty,
                        "seed": seed,
                        "_t": template.__name__,
                    }
                )
    finally:
        con.close()
    for e in out:
        del e["_t"]
    return out


def generate(
    seed: int = 0,
    *,
    test_schemas: Sequence[str] = DEFAULT_TEST_SCHEMAS,
    per_template: int = 8,
    directory: str | os.PathLike[str] | None = None,
) -> SQLDataset:
    """Build the databases and questions for ``seed``; test = questions about ``test_schemas`` only."""
    unknown = [s for s in test_schemas if s not in _SCHEMAS]
    if unknown:
        raise ValueError(f"test_schemas must be drawn from {', '.join(SCHEMAS)}, got {unknown}")
    if not test_schemas or set(test_schemas) == set(SCHEMAS):
        raise ValueError("test_schemas must hold at least one schema and leave at least one for training")
    if per_template < 1:
        raise ValueError(f"per_template must be >= 1, got {per_template}")
    d = Path(directory) if directory is not None else None
    train_ids = tuple(s for s in SCHEMAS if s not in test_schemas)
    test_ids = tuple(s for s in SCHEMAS if s in test_schemas)
    train = [e for s in train_ids for e in _examples_for(s, seed, per_template, d)]
    test = [e for s in test_ids for e in _examples_for(s, seed, per_template, d)]
    return SQLDataset(seed, train, test, train_ids, test_ids, d)


_KEYWORDS = frozenset(
    [
        "select",
        "from",
        "where",
        "and",
        "or",
        "not",
        "in",
        "is",
        "null",
        "like",
        "between",
        "group",
        "by",
        "having",
        "order",
        "asc",
        "desc",
        "limit",
        "join",
        "on",
        "as",
        "distinct",
        "count",
        "avg",
        "sum",
        "min",
        "max",
        "exists",
        "union",
        "case",
        "when",
        "then",
        "else",
        "end",
        "inner",
        "left",
    ]
)


def skeleton(sql: str) -> str:
    """``sql`` with literals and identifiers replaced by placeholders (the query's shape)."""
    s = re.sub(r"'(?:[^']|'')*'", "?", sql)
    s = re.sub(r"\b\d+(?:\.\d+)?\b", "?", s)
    tokens = re.findall(r"[A-Za-z_][A-Za-z0-9_.]*|\?|\S", s)
    out = []
    for t in tokens:
        if t.lower() in _KEYWORDS:
            out.append(t.upper())
        elif t[0].isalpha() or t[0] == "_":
            out.append("x")
        else:
            out.append(t)
    return " ".join(out)


def render_prompt(example: dict[str, Any]) -> str:
    """A compact prompt for a small model: the schema, the question, and what to answer with."""
    ddl = re.sub(r" INTEGER PRIMARY KEY", " INT PK", example["schema"])
    ddl = re.sub(r"INTEGER REFERENCES (\w+)\((\w+)\)", r"INT -> \1.\2", ddl)
    ddl = ddl.replace("CREATE TABLE ", "").replace(";", "")
    return f"SQLite tables:\n{ddl}\nQuestion: {example['question']}\nAnswer with one SQLite query.\nSQL:"
