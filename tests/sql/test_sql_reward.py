"""The execution-match reward: correct, wrong, malformed, writes refused, slow queries stopped, huge results capped."""

from __future__ import annotations

import hashlib
import time

import pytest

from openrl_jupyter.sql import execution_match, extract_sql, generate, sql_reward
from openrl_jupyter.sql.reward import SQLError, run_query


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return generate(0, directory=tmp_path_factory.mktemp("sqlr"), per_template=1).db_path("shop")


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


GOLD = "SELECT name FROM customers WHERE city = 'Oslo'"


def test_correct_equivalent_query_scores_1(db):
    assert execution_match(GOLD, GOLD, db).score == 1.0
    # a different query with the same result set (order does not matter without ORDER BY)
    r = execution_match(
        "SELECT c.name FROM customers c WHERE c.city IN ('Oslo') ORDER BY c.name DESC", GOLD, db
    )
    assert r.score == 1.0 and r.error is None and r.rows >= 1


def test_wrong_query_scores_0(db):
    r = execution_match("SELECT name FROM customers WHERE city = 'Lisbon'", GOLD, db)
    assert r.score == 0.0 and r.error is None
    # duplicates matter: a multiset, not a set
    gold = "SELECT city FROM customers"
    assert execution_match("SELECT DISTINCT city FROM customers", gold, db).score == 0.0


def test_order_matters_only_when_gold_orders(db):
    gold = "SELECT name, price FROM products ORDER BY price DESC LIMIT 5"
    assert (
        execution_match("SELECT name, price FROM products ORDER BY price DESC LIMIT 5", gold, db).score == 1.0
    )
    rev = "SELECT * FROM (SELECT name, price FROM products ORDER BY price DESC LIMIT 5) ORDER BY price"
    assert execution_match(rev, gold, db).score == 0.0
    assert execution_match(rev, gold, db, ordered=False).score == 1.0


def test_floats_compared_rounded(db):
    gold = "SELECT AVG(price) FROM products"
    assert execution_match("SELECT SUM(price) / COUNT(*) FROM products", gold, db).score == 1.0


def test_malformed_sql_scores_0_with_sqlite_error(db):
    r = execution_match("SELEC name FROM customers", GOLD, db)
    assert r.score == 0.0 and "syntax error" in r.error
    r = execution_match("SELECT nme FROM customers", GOLD, db)
    assert r.score == 0.0 and "no such column: nme" in r.error
    assert execution_match("", GOLD, db).error == "empty query"


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO customers VALUES (999, 'Eve', 'Oslo', 2020)",
        "UPDATE customers SET city = 'Oslo'",
        "DELETE FROM orders",
        "DROP TABLE customers",
        "CREATE TABLE x (a)",
        "ATTACH DATABASE '/tmp/openrl-sql-attack.db' AS evil",
        "PRAGMA journal_mode = DELETE",
        "PRAGMA user_version = 7",
        "SELECT load_extension('/tmp/x.so')",
        "SELECT name FROM customers; DROP TABLE customers",
    ],
)
def test_a_write_attempt_never_changes_the_db(db, sql, tmp_path):
    before = digest(db)
    r = execution_match(sql, GOLD, db)
    assert r.score == 0.0 and r.error
    assert digest(db) == before
    assert not (tmp_path / "openrl-sql-attack.db").exists()
    assert execution_match(GOLD, GOLD, db).score == 1.0  # still intact and usable


def test_a_slow_query_is_stopped_within_the_limit(db):
    slow = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000000) SELECT COUNT(*) FROM c"
    t = time.monotonic()
    r = execution_match(slow, GOLD, db, timeout_s=0.3)
    elapsed = time.monotonic() - t
    assert r.score == 0.0 and r.error.startswith("time limit")
    assert elapsed < 30  # counting to 10^9 in sqlite takes minutes; only a stopped query returns at all


def test_a_huge_result_is_capped(db):
    huge = "SELECT * FROM orders a, orders b, customers c"  # 120 * 120 * 40 = 576,000 rows
    r = execution_match(huge, GOLD, db, max_rows=10_000)
    assert r.score == 0.0 and r.error == "result too large: more than 10000 rows"
    # the same query fits under a bigger cap ... and a gold query over the cap is a data error
    assert len(run_query("SELECT * FROM orders a, customers c", db, max_rows=10_000)) == 4800
    with pytest.raises(SQLError, match="result too large"):
        execution_match(GOLD, huge, db, max_rows=100)


@pytest.mark.parametrize(
    ("completion", "sql"),
    [
        ("```sql\nSELECT a FROM t;\n```", "SELECT a FROM t"),
        ("Here is the query:\n```\nSELECT a\nFROM t\n```\nDone.", "SELECT a\nFROM t"),
        (
            "The answer is SELECT a FROM t WHERE b = 'x;y'; -- and more text",
            "SELECT a FROM t WHERE b = 'x;y'",
        ),
        ("SELECT COUNT(*) FROM t;;", "SELECT COUNT(*) FROM t"),
        ("To select the names we use SELECT name FROM t", "SELECT name FROM t"),
        ("Answer:\nselect name from t;", "select name from t"),
        ("with x as (select 1) select * from x", "with x as (select 1) select * from x"),
    ],
)
def test_extract_sql(completion, sql):
    assert extract_sql(completion) == sql


def test_reward_in_the_notebook_shape(db, capsys, tmp_path):
    ds = generate(0, directory=tmp_path, per_template=1)
    e = next(x for x in ds.test if " JOIN " in x["sql"])
    info = {**e, "db_path": str(ds.db_path(e["db_id"]))}
    assert sql_reward("q", f"```sql\n{e['sql']};\n```", **info) == 1.0
    assert sql_reward("q", "SELECT 1", **info) == 0.0
    assert sql_reward("q", "I don't know", **info) == 0.0
    assert "sql error:" in capsys.readouterr().out  # the sqlite error lands in the run's log
    # without db_path the database is rebuilt from db_id and seed
    no_path = {k: v for k, v in e.items()}
    assert sql_reward("q", e["sql"], **no_path) == 1.0
    with pytest.raises(KeyError, match="sql"):
        sql_reward("q", "SELECT 1", db_id="shop")


def test_each_guard_holds_on_its_own(db, tmp_path):
    """The authorizer refuses writes even on a writable copy; read-only mode refuses them without it."""
    import shutil
    import sqlite3

    from openrl_jupyter.sql.sandbox import Authorizer

    copy = tmp_path / "copy.db"
    shutil.copy(db, copy)
    con = sqlite3.connect(copy)
    con.set_authorizer(Authorizer(frozenset({"customers", "products", "orders"})))
    with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
        con.execute("DELETE FROM orders")
    con.close()
    con = sqlite3.connect(f"file:{copy}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        con.execute("DELETE FROM orders")
    con.close()
    assert digest(copy) == digest(db)


def test_the_functions_a_model_writes_are_allowed(db):
    """The sandbox's allow-list keeps the scalar, aggregate, date and window functions of ordinary
    text-to-SQL answers."""
    sql = (
        "SELECT upper(name), lower(city), length(name), substr(name, 1, 3), trim(' x '), "
        "replace(city, 'o', '0'), instr(name, 'a'), abs(-2), round(avg(joined_year), 2), "
        "coalesce(NULL, 1), ifnull(NULL, 2), nullif(1, 1), typeof(name), cast(joined_year AS TEXT), "
        "iif(joined_year > 2020, 'new', 'old'), count(DISTINCT city), sum(id), total(id), min(id), max(id), "
        "group_concat(city), date('2024-01-31', '+1 day'), strftime('%Y', '2024-05-01'), "
        "julianday('2024-01-02') - julianday('2024-01-01'), ltrim('  a'), rtrim('a  '), hex('a'), "
        "quote(name), sign(-3), unicode('A'), char(65), like('%a%', name), glob('*a*', name) "
        "FROM customers GROUP BY city ORDER BY city LIMIT 1"
    )
    assert len(run_query(sql, db)) == 1
    window = (
        "SELECT name, row_number() OVER (ORDER BY id), rank() OVER (PARTITION BY city ORDER BY joined_year), "
        "dense_rank() OVER (ORDER BY city), lag(name) OVER (ORDER BY id), lead(name, 1, '') OVER (ORDER BY id), "
        "first_value(name) OVER (PARTITION BY city ORDER BY id), ntile(4) OVER (ORDER BY id) FROM customers"
    )
    assert len(run_query(window, db)) == 40
    r = execution_match("SELECT name FROM customers WHERE city LIKE 'os%' AND name GLOB '*'", GOLD, db)
    assert r.score == 1.0, r


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_gold_query_of_every_schema_runs_in_the_sandbox(seed, tmp_path):
    """Every template's gold query, on all four schemas (train and test split alike), returns through
    the sandbox exactly the rows sqlite gives it directly."""
    import sqlite3

    ds = generate(seed, directory=tmp_path)
    examples = ds.train + ds.test
    assert {e["db_id"] for e in examples} == {"shop", "school", "flights", "library"}
    cons = {}
    try:
        for e in examples:
            path = ds.db_path(e["db_id"])
            con = cons.setdefault(e["db_id"], sqlite3.connect(f"file:{path}?mode=ro", uri=True))
            direct = [tuple(_norm(v) for v in r) for r in con.execute(e["sql"]).fetchall()]
            assert run_query(e["sql"], path) == direct, e["sql"]
            assert execution_match(e["sql"], e["sql"], path, ordered=e["ordered"]).score == 1.0
    finally:
        for con in cons.values():
            con.close()


def _norm(v):
    if isinstance(v, float):
        r = round(v, 4)
        return int(r) if r.is_integer() else r
    return v
