"""Question templates: each takes (schema, connection, rng) and returns (question, sql, difficulty),
filled with values that exist in the data, or None when the schema has nothing it can ask about."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable
from typing import Any

from openrl_jupyter.sql.schemas import Link, Schema, Table

# ---------------------------------------------------------------------------------------------
# Question templates. Each takes (schema, connection, rng) and returns (question, sql, difficulty)
# or None when the schema has nothing it can ask about.


def _q(v: Any) -> str:
    return "'" + str(v).replace("'", "''") + "'" if isinstance(v, str) else repr(v)


def _pick_table(s: Schema, rng: random.Random, need: str = "") -> Table | None:
    ts = [t for t in s.tables if (need != "cat" or t.cats) and (need != "num" or t.nums)]
    if need == "both":
        ts = [t for t in s.tables if t.cats and t.nums]
    return rng.choice(ts) if ts else None


def _values(con: sqlite3.Connection, table: str, col: str) -> list[Any]:
    return [r[0] for r in con.execute(f"SELECT DISTINCT {col} FROM {table} ORDER BY {col}")]


def _aggs(col: str, choices: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Aggregates that make sense for ``col``: a total of years is not a question anyone asks."""
    if "year" in col or col == "founded":
        return [c for c in choices if c[0] != "SUM"]
    return choices


Template = Callable[[Schema, sqlite3.Connection, random.Random], "tuple[str, str, str] | None"]
_TEMPLATES: list[Template] = []


def _template(fn: Template) -> Template:
    _TEMPLATES.append(fn)
    return fn


@_template
def _t_list(s, con, rng):
    t = rng.choice(s.tables)
    return f"List the {t.label} of every {t.one}.", f"SELECT {t.label} FROM {t.name}", "easy"


@_template
def _t_count(s, con, rng):
    t = rng.choice(s.tables)
    return f"How many {t.noun} are there?", f"SELECT COUNT(*) FROM {t.name}", "easy"


@_template
def _t_filter_eq(s, con, rng):
    t = _pick_table(s, rng, "cat")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    v = rng.choice(_values(con, t.name, c))
    return (
        f"Which {t.noun} have {cn} {v}? Give their {t.label}.",
        f"SELECT {t.label} FROM {t.name} WHERE {c} = {_q(v)}",
        "easy",
    )


@_template
def _t_count_eq(s, con, rng):
    t = _pick_table(s, rng, "cat")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    v = rng.choice(_values(con, t.name, c))
    return f"How many {t.noun} have {cn} {v}?", f"SELECT COUNT(*) FROM {t.name} WHERE {c} = {_q(v)}", "easy"


@_template
def _t_filter_gt(s, con, rng):
    t = _pick_table(s, rng, "num")
    if t is None:
        return None
    c, cn = rng.choice(t.nums)
    v = rng.choice(_values(con, t.name, c)[:-1])
    return (
        f"List the {t.label} of {t.noun} whose {cn} is greater than {v}.",
        f"SELECT {t.label} FROM {t.name} WHERE {c} > {_q(v)}",
        "easy",
    )


@_template
def _t_distinct(s, con, rng):
    t = _pick_table(s, rng, "cat")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    return (
        f"What are the different values of {cn} among {t.noun}?",
        f"SELECT DISTINCT {c} FROM {t.name}",
        "easy",
    )


@_template
def _t_count_distinct(s, con, rng):
    t = _pick_table(s, rng, "cat")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    return (
        f"How many different {cn} values do {t.noun} have?",
        f"SELECT COUNT(DISTINCT {c}) FROM {t.name}",
        "easy",
    )


@_template
def _t_between(s, con, rng):
    t = _pick_table(s, rng, "num")
    if t is None:
        return None
    c, cn = rng.choice(t.nums)
    a, b = sorted(rng.sample(_values(con, t.name, c), 2))
    return (
        f"Which {t.noun} have a {cn} between {a} and {b}? Give their {t.label} and {cn}.",
        f"SELECT {t.label}, {c} FROM {t.name} WHERE {c} BETWEEN {_q(a)} AND {_q(b)}",
        "medium",
    )


@_template
def _t_and(s, con, rng):
    t = _pick_table(s, rng, "both")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    n, nn = rng.choice(t.nums)
    v = rng.choice(_values(con, t.name, c))
    x = rng.choice(_values(con, t.name, n))
    return (
        f"List the {t.label} of {t.noun} with {cn} {v} and a {nn} below {x}.",
        f"SELECT {t.label} FROM {t.name} WHERE {c} = {_q(v)} AND {n} < {_q(x)}",
        "medium",
    )


@_template
def _t_or(s, con, rng):
    t = _pick_table(s, rng, "cat")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    vals = _values(con, t.name, c)
    if len(vals) < 2:
        return None
    v, w = rng.sample(vals, 2)
    return (
        f"List the {t.label} of {t.noun} whose {cn} is {v} or {w}.",
        f"SELECT {t.label} FROM {t.name} WHERE {c} = {_q(v)} OR {c} = {_q(w)}",
        "medium",
    )


@_template
def _t_in_list(s, con, rng):
    t = _pick_table(s, rng, "cat")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    vals = _values(con, t.name, c)
    if len(vals) < 4:
        return None
    vs = sorted(rng.sample(vals, 3), key=str)
    return (
        f"How many {t.noun} have a {cn} that is not {', '.join(map(str, vs[:2]))} or {vs[2]}?",
        f"SELECT COUNT(*) FROM {t.name} WHERE {c} NOT IN ({', '.join(_q(v) for v in vs)})",
        "medium",
    )


@_template
def _t_like(s, con, rng):
    t = rng.choice(s.tables)
    letters = sorted({str(v)[0] for v in _values(con, t.name, t.label) if str(v)[:1].isalpha()})
    if not letters:
        return None
    ch = rng.choice(letters)
    return (
        f"Which {t.noun} have a {t.label} starting with {ch}?",
        f"SELECT {t.label} FROM {t.name} WHERE {t.label} LIKE '{ch}%'",
        "medium",
    )


@_template
def _t_agg(s, con, rng):
    t = _pick_table(s, rng, "num")
    if t is None:
        return None
    c, cn = rng.choice(t.nums)
    fn, word = rng.choice(
        _aggs(c, [("AVG", "average"), ("MAX", "highest"), ("MIN", "lowest"), ("SUM", "total")])
    )
    return f"What is the {word} {cn} of all {t.noun}?", f"SELECT {fn}({c}) FROM {t.name}", "medium"


@_template
def _t_agg_where(s, con, rng):
    t = _pick_table(s, rng, "both")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    n, nn = rng.choice(t.nums)
    v = rng.choice(_values(con, t.name, c))
    fn, word = rng.choice([("AVG", "average"), ("MAX", "highest"), ("MIN", "lowest")])
    return (
        f"What is the {word} {nn} of {t.noun} with {cn} {v}?",
        f"SELECT {fn}({n}) FROM {t.name} WHERE {c} = {_q(v)}",
        "medium",
    )


@_template
def _t_top_k(s, con, rng):
    t = _pick_table(s, rng, "num")
    if t is None:
        return None
    c, cn = rng.choice(t.nums)
    k = rng.randint(1, 5)
    desc = rng.random() < 0.6
    word, order = ("highest", "DESC") if desc else ("lowest", "ASC")
    return (
        f"Which {k} {t.noun} have the {word} {cn}? Give {t.label} and {cn}.",
        f"SELECT {t.label}, {c} FROM {t.name} ORDER BY {c} {order} LIMIT {k}",
        "medium",
    )


@_template
def _t_sorted_filter(s, con, rng):
    t = _pick_table(s, rng, "cat")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    v = rng.choice(_values(con, t.name, c))
    return (
        f"List the {t.label} of {t.noun} with {cn} {v} in alphabetical order.",
        f"SELECT {t.label} FROM {t.name} WHERE {c} = {_q(v)} ORDER BY {t.label}",
        "medium",
    )


@_template
def _t_group_count(s, con, rng):
    t = _pick_table(s, rng, "cat")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    return (
        f"For each {cn}, how many {t.noun} are there?",
        f"SELECT {c}, COUNT(*) FROM {t.name} GROUP BY {c}",
        "medium",
    )


@_template
def _t_group_avg(s, con, rng):
    t = _pick_table(s, rng, "both")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    n, nn = rng.choice(t.nums)
    fn, word = rng.choice(_aggs(n, [("AVG", "average"), ("MAX", "highest"), ("SUM", "total")]))
    return (
        f"What is the {word} {nn} of {t.noun} for each {cn}?",
        f"SELECT {c}, {fn}({n}) FROM {t.name} GROUP BY {c}",
        "medium",
    )


@_template
def _t_having(s, con, rng):
    t = _pick_table(s, rng, "cat")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    counts = [r[0] for r in con.execute(f"SELECT COUNT(*) FROM {t.name} GROUP BY {c}")]
    k = rng.choice([c for c in sorted(set(counts)) if c > 1] or [1])
    return (
        f"Which {cn} values are shared by at least {k} {t.noun}?",
        f"SELECT {c} FROM {t.name} GROUP BY {c} HAVING COUNT(*) >= {k}",
        "hard",
    )


@_template
def _t_having_avg(s, con, rng):
    t = _pick_table(s, rng, "both")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    n, nn = rng.choice(t.nums)
    avgs = sorted(r[0] for r in con.execute(f"SELECT AVG({n}) FROM {t.name} GROUP BY {c}"))
    x = round(avgs[rng.randrange(len(avgs))] - 0.5, 1)
    return (
        f"For which {cn} values is the average {nn} of {t.noun} above {x}? Give the {cn} and the average.",
        f"SELECT {c}, AVG({n}) FROM {t.name} GROUP BY {c} HAVING AVG({n}) > {x}",
        "hard",
    )


@_template
def _t_most_common(s, con, rng):
    t = _pick_table(s, rng, "cat")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    return (
        f"Which {cn} is the most common among {t.noun}?",
        f"SELECT {c} FROM {t.name} GROUP BY {c} ORDER BY COUNT(*) DESC LIMIT 1",
        "hard",
    )


def _link_parts(s: Schema, rng: random.Random) -> tuple[Link, Table, Table | None] | None:
    if not s.links:
        return None
    lk = rng.choice(s.links)
    child = next((t for t in s.tables if t.name == lk.child), None)
    return lk, s.table(lk.parent), child


@_template
def _t_join_parent_name(s, con, rng):
    parts = _link_parts(s, rng)
    if parts is None or parts[2] is None:
        return None
    lk, p, ch = parts
    v = rng.choice(_values(con, p.name, p.label))
    return (
        f"List the {ch.label} of {ch.noun} {lk.verb} the {p.one} {v}.",
        f"SELECT T1.{ch.label} FROM {ch.name} AS T1 JOIN {p.name} AS T2 ON T1.{lk.fk} = T2.id "
        f"WHERE T2.{p.label} = {_q(v)}",
        "hard",
    )


@_template
def _t_join_parent_cat(s, con, rng):
    parts = _link_parts(s, rng)
    if parts is None or not parts[1].cats:
        return None
    lk, p, ch = parts
    c, cn = rng.choice(p.cats)
    v = rng.choice(_values(con, p.name, c))
    return (
        f"How many {lk.child} are {lk.verb} a {p.one} with {cn} {v}?",
        f"SELECT COUNT(*) FROM {lk.child} AS T1 JOIN {p.name} AS T2 ON T1.{lk.fk} = T2.id WHERE T2.{c} = {_q(v)}",
        "hard",
    )


@_template
def _t_join_group(s, con, rng):
    parts = _link_parts(s, rng)
    if parts is None:
        return None
    lk, p, _ = parts
    return (
        f"For each {p.one}, give its {p.label} and the number of {lk.child} {lk.verb} it.",
        f"SELECT T2.{p.label}, COUNT(*) FROM {lk.child} AS T1 JOIN {p.name} AS T2 ON T1.{lk.fk} = T2.id "
        f"GROUP BY T2.id",
        "hard",
    )


@_template
def _t_join_having(s, con, rng):
    parts = _link_parts(s, rng)
    if parts is None:
        return None
    lk, p, _ = parts
    counts = sorted({r[0] for r in con.execute(f"SELECT COUNT(*) FROM {lk.child} GROUP BY {lk.fk}")})
    k = rng.choice([c for c in counts if c > 1] or [1])
    return (
        f"Which {p.noun} have at least {k} {lk.child} {lk.verb} them? Give their {p.label}.",
        f"SELECT T2.{p.label} FROM {lk.child} AS T1 JOIN {p.name} AS T2 ON T1.{lk.fk} = T2.id "
        f"GROUP BY T2.id HAVING COUNT(*) >= {k}",
        "hard",
    )


@_template
def _t_join_top(s, con, rng):
    parts = _link_parts(s, rng)
    if parts is None:
        return None
    lk, p, _ = parts
    return (
        f"Which {p.one} has the most {lk.child} {lk.verb} it? Give its {p.label}.",
        f"SELECT T2.{p.label} FROM {lk.child} AS T1 JOIN {p.name} AS T2 ON T1.{lk.fk} = T2.id "
        f"GROUP BY T2.id ORDER BY COUNT(*) DESC LIMIT 1",
        "hard",
    )


@_template
def _t_join_agg(s, con, rng):
    parts = _link_parts(s, rng)
    if parts is None or parts[2] is None or not parts[2].nums:
        return None
    lk, p, ch = parts
    n, nn = rng.choice(ch.nums)
    v = rng.choice(_values(con, p.name, p.label))
    fn, word = rng.choice(_aggs(n, [("AVG", "average"), ("MAX", "highest"), ("SUM", "total")]))
    return (
        f"What is the {word} {nn} of {ch.noun} {lk.verb} the {p.one} {v}?",
        f"SELECT {fn}(T1.{n}) FROM {ch.name} AS T1 JOIN {p.name} AS T2 ON T1.{lk.fk} = T2.id "
        f"WHERE T2.{p.label} = {_q(v)}",
        "hard",
    )


@_template
def _t_above_avg(s, con, rng):
    t = _pick_table(s, rng, "num")
    if t is None:
        return None
    c, cn = rng.choice(t.nums)
    return (
        f"Which {t.noun} have a {cn} above the average? Give their {t.label}.",
        f"SELECT {t.label} FROM {t.name} WHERE {c} > (SELECT AVG({c}) FROM {t.name})",
        "extra",
    )


@_template
def _t_argmax(s, con, rng):
    t = _pick_table(s, rng, "num")
    if t is None:
        return None
    c, cn = rng.choice(t.nums)
    fn, word = rng.choice([("MAX", "highest"), ("MIN", "lowest")])
    return (
        f"Which {t.one} has the {word} {cn}? Give its {t.label}.",
        f"SELECT {t.label} FROM {t.name} WHERE {c} = (SELECT {fn}({c}) FROM {t.name})",
        "extra",
    )


@_template
def _t_in_sub(s, con, rng):
    parts = _link_parts(s, rng)
    if parts is None or parts[2] is None or not parts[2].nums:
        return None
    lk, p, ch = parts
    n, nn = rng.choice(ch.nums)
    x = rng.choice(_values(con, ch.name, n)[:-1])
    return (
        f"Which {p.noun} have {ch.noun} {lk.verb} them with a {nn} above {x}? Give their {p.label}.",
        f"SELECT {p.label} FROM {p.name} WHERE id IN (SELECT {lk.fk} FROM {ch.name} WHERE {n} > {_q(x)})",
        "extra",
    )


@_template
def _t_not_in_sub(s, con, rng):
    parts = _link_parts(s, rng)
    if parts is None:
        return None
    lk, p, _ = parts
    return (
        f"Which {p.noun} have no {lk.child} {lk.verb} them? Give their {p.label}.",
        f"SELECT {p.label} FROM {p.name} WHERE id NOT IN (SELECT {lk.fk} FROM {lk.child})",
        "extra",
    )


@_template
def _t_count_above_group_avg(s, con, rng):
    t = _pick_table(s, rng, "both")
    if t is None:
        return None
    c, cn = rng.choice(t.cats)
    n, nn = rng.choice(t.nums)
    return (
        f"How many {t.noun} have a {nn} above the average {nn} of their own {cn}?",
        f"SELECT COUNT(*) FROM {t.name} AS T1 WHERE T1.{n} > "
        f"(SELECT AVG(T2.{n}) FROM {t.name} AS T2 WHERE T2.{c} = T1.{c})",
        "extra",
    )
