"""The text-to-SQL generator: deterministic by seed, split by schema, varied, and every gold query runs."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys

import pytest

from openrl_jupyter.sql import SCHEMAS, generate, render_prompt, schema_text, skeleton
from openrl_jupyter.sql.schemas import build_database

MIN_SKELETONS = 25
MIN_HELD_OUT = 300


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return generate(0, directory=tmp_path_factory.mktemp("sql0"))


def test_same_seed_same_questions_and_data(ds, tmp_path):
    again = generate(0, directory=tmp_path / "a")
    assert again.train == ds.train and again.test == ds.test

    def dump(p):
        con = sqlite3.connect(p)
        try:
            return "\n".join(con.iterdump())
        finally:
            con.close()

    for db_id in SCHEMAS:
        assert dump(again.db_path(db_id)) == dump(ds.db_path(db_id))


def test_other_seed_other_data(ds, tmp_path):
    other = generate(1, directory=tmp_path)
    assert [e["sql"] for e in other.test] != [e["sql"] for e in ds.test]
    a = hashlib.sha256(build_database("shop", 0, tmp_path / "s0.db").read_bytes()).hexdigest()
    b = hashlib.sha256(build_database("shop", 1, tmp_path / "s1.db").read_bytes()).hexdigest()
    assert a != b


def test_split_is_by_schema(ds):
    assert set(ds.test_schemas) == {"flights", "library"}
    assert {e["db_id"] for e in ds.train} == {"shop", "school"}
    assert {e["db_id"] for e in ds.test} == {"flights", "library"}
    # nothing in training mentions a held-out table
    held_out_tables = {"airports", "airlines", "flights", "bookings", "authors", "books", "members", "loans"}
    for e in ds.train:
        assert not held_out_tables & set(e["sql"].replace(",", " ").split()), e["sql"]


def test_split_is_a_parameter(tmp_path):
    d = generate(0, test_schemas=("shop",), directory=tmp_path, per_template=1)
    assert {e["db_id"] for e in d.test} == {"shop"}
    assert {e["db_id"] for e in d.train} == {"school", "flights", "library"}
    with pytest.raises(ValueError, match="test_schemas"):
        generate(0, test_schemas=("cinema",), directory=tmp_path)
    with pytest.raises(ValueError, match="test_schemas"):
        generate(0, test_schemas=SCHEMAS, directory=tmp_path)


def test_enough_variety_and_held_out_questions(ds):
    assert len(ds.test) >= MIN_HELD_OUT
    assert len({skeleton(e["sql"]) for e in ds.test}) >= MIN_SKELETONS
    assert len({skeleton(e["sql"]) for e in ds.train}) >= MIN_SKELETONS
    assert {e["difficulty"] for e in ds.test} == {"easy", "medium", "hard", "extra"}
    sqls = " ".join(e["sql"] for e in ds.test)
    for construct in (" JOIN ", " GROUP BY ", " HAVING ", " ORDER BY ", " LIMIT ", "(SELECT ", " WHERE "):
        assert construct in sqls, construct
    assert len({e["sql"] for e in ds.test}) == len(ds.test)  # no duplicates


def test_skeleton_replaces_literals_and_names():
    a = skeleton("SELECT name FROM customers WHERE city = 'Oslo' AND joined_year > 2019")
    b = skeleton("SELECT title FROM books WHERE genre = 'it''s' AND pages > 12.5")
    assert a == b == "SELECT x FROM x WHERE x = ? AND x > ?"
    assert skeleton("SELECT COUNT(*) FROM t") != skeleton("SELECT AVG(x) FROM t")


def test_every_gold_query_executes_and_returns_rows(ds):
    for e in ds.train + ds.test:
        con = sqlite3.connect(f"file:{ds.db_path(e['db_id'])}?mode=ro", uri=True)
        try:
            rows = con.execute(e["sql"]).fetchall()
        finally:
            con.close()
        assert rows, e
        assert any(v is not None for r in rows for v in r), e
        assert e["ordered"] == (" ORDER BY " in e["sql"])
        assert e["schema"] == schema_text(e["db_id"])
        assert set(e) >= {"db_id", "schema", "question", "sql", "ordered", "difficulty"}


def test_schemas_have_foreign_keys_and_realistic_values(ds):
    for db_id in SCHEMAS:
        con = sqlite3.connect(ds.db_path(db_id))
        try:
            tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            fks = sum(len(con.execute(f"PRAGMA foreign_key_list({t})").fetchall()) for t in tables)
            assert len(tables) >= 3 and fks >= 2, db_id
            con.execute("PRAGMA foreign_keys = ON")
            assert con.execute("PRAGMA foreign_key_check").fetchall() == [], db_id
        finally:
            con.close()
    con = sqlite3.connect(ds.db_path("library"))
    try:
        name = con.execute("SELECT name FROM authors WHERE id = 1").fetchone()[0]
    finally:
        con.close()
    assert len(name.split()) == 2 and name.istitle()


def test_prompt_is_compact_and_has_schema_and_question(ds):
    e = next(x for x in ds.test if " JOIN " in x["sql"])
    p = render_prompt(e)
    assert e["question"] in p
    for table in (
        ("airports", "airlines", "flights", "bookings") if e["db_id"] == "flights" else ("authors", "books")
    ):
        assert table in p
    assert "CREATE TABLE" not in p and len(p) < len(e["schema"]) + len(e["question"]) + 80


def test_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None\nimport openrl_jupyter.sql as s; print(len(s.SCHEMAS))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "4"


def test_same_questions_in_another_process(ds, tmp_path):
    """A detached job rebuilds the data from the seed: string hashing must not leak into it."""
    import json
    import os

    code = (
        "import json, sys\n"
        "from openrl_jupyter.sql import generate\n"
        "d = generate(0, directory=sys.argv[1])\n"
        "print(json.dumps([d.train, d.test]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [ds.train, ds.test]


def test_the_database_cache_is_private_to_its_user(tmp_path, monkeypatch):
    """Under $XDG_CACHE_HOME (else ~/.cache)/openrl-jupyter/sql: the folder 0700, each file 0600,
    both this user's; a relative $XDG_CACHE_HOME is ignored (as the XDG spec says)."""
    import os
    import stat
    import tempfile

    from openrl_jupyter.sql.cache import database_path

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = database_path("shop", 0)
    assert path.parent == tmp_path / "xdg" / "openrl-jupyter" / "sql"
    for p, mode in ((path.parent, 0o700), (path, 0o600)):
        st = os.lstat(p)
        assert stat.S_IMODE(st.st_mode) == mode and st.st_uid == os.getuid(), (p, oct(st.st_mode))
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for xdg in (None, "relative/cache"):
        if xdg is None:
            monkeypatch.delenv("XDG_CACHE_HOME")
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert database_path("school", 1).parent == home / ".cache" / "openrl-jupyter" / "sql"


def test_a_home_without_a_usable_cache_falls_back_to_a_private_temporary_folder(tmp_path, monkeypatch):
    """A job whose home cannot hold a cache (read-only, missing) still gets its databases: in a
    folder of its own, made with an unpredictable name and mode 0700."""
    import os
    import stat
    import tempfile

    from openrl_jupyter.sql.cache import database_path

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir(mode=0o1777)
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder"))
    path = database_path("shop", 0)
    assert path.parent.parent == tmp_path / "tmp" and path.parent.name != "openrl-sql"
    assert stat.S_IMODE(os.lstat(path.parent).st_mode) == 0o700
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert con.execute("SELECT COUNT(*) FROM customers").fetchone()[0] == 40
    finally:
        con.close()
