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

import atexit
import hashlib
import os
import random
import re
import shutil
import sqlite3
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMAS = ("shop", "school", "flights", "library")
DEFAULT_TEST_SCHEMAS = ("flights", "library")
# Bump when the schemas or the row builders change, so a cached database file is never stale.
GENERATOR_VERSION = 1

_FIRST = [
    "Alice",
    "Bruno",
    "Chloe",
    "Daniel",
    "Elena",
    "Farid",
    "Grace",
    "Hugo",
    "Ines",
    "Jonas",
    "Keiko",
    "Liam",
    "Maya",
    "Nikolai",
    "Olga",
    "Pedro",
    "Quinn",
    "Rosa",
    "Samir",
    "Tara",
    "Umar",
    "Vera",
    "Wen",
    "Ximena",
    "Yusuf",
    "Zoe",
    "Aaron",
    "Bianca",
    "Carlos",
    "Dana",
]
_LAST = [
    "Adams",
    "Baker",
    "Costa",
    "Dubois",
    "Evans",
    "Fischer",
    "Garcia",
    "Hansen",
    "Ito",
    "Jensen",
    "Kowalski",
    "Lopez",
    "Moreau",
    "Nakamura",
    "Okafor",
    "Petrov",
    "Quinn",
    "Rossi",
    "Schmidt",
    "Tanaka",
]
_CITIES = ["Lisbon", "Oslo", "Denver", "Kyoto", "Lagos", "Austin", "Porto", "Dublin", "Seoul", "Lima"]
_COUNTRIES = ["Portugal", "Norway", "USA", "Japan", "Nigeria", "Ireland", "Korea", "Peru", "France", "Brazil"]


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


# ---------------------------------------------------------------------------------------------
# Schemas: DDL, row builders, and the metadata the templates need.


@dataclass(frozen=True)
class Table:
    name: str
    noun: str  # plural noun for questions: "customers"
    one: str  # singular: "customer"
    label: str  # the column that names a row
    cats: tuple[tuple[str, str], ...]  # (column, how a question says it)
    nums: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Link:
    child: str
    fk: str
    parent: str
    verb: str  # "customer X has orders": "{parent} with the most {child}"


@dataclass(frozen=True)
class Schema:
    db_id: str
    ddl: str
    tables: tuple[Table, ...]
    links: tuple[Link, ...]
    fill: Callable[[sqlite3.Connection, random.Random], None]

    def table(self, name: str) -> Table:
        return next(t for t in self.tables if t.name == name)


def _fill_shop(con: sqlite3.Connection, rng: random.Random) -> None:
    cats = ["books", "games", "garden", "kitchen", "toys", "sports"]
    adjectives = ["Classic", "Smart", "Mini", "Deluxe", "Eco", "Pro", "Travel", "Family"]
    things = ["Lamp", "Kettle", "Chess", "Ball", "Planter", "Novel", "Puzzle", "Racket", "Knife", "Kite"]
    for i in range(1, 41):
        con.execute(
            "INSERT INTO customers VALUES (?,?,?,?)",
            (i, _person(rng), rng.choice(_CITIES), rng.randint(2015, 2024)),
        )
    names = rng.sample([f"{a} {t}" for a in adjectives for t in things], 30)
    for i, n in enumerate(names, 1):
        con.execute(
            "INSERT INTO products VALUES (?,?,?,?,?)",
            (i, n, rng.choice(cats), round(rng.uniform(3, 250), 2), rng.randint(0, 120)),
        )
    for i in range(1, 121):
        con.execute(
            "INSERT INTO orders VALUES (?,?,?,?,?,?,?)",
            (
                i,
                f"ORD-{1000 + i}",
                rng.randint(1, 34),  # customers 35-40 never order
                rng.randint(1, 30),
                rng.randint(1, 6),
                rng.choice(["paid", "shipped", "returned", "pending"]),
                rng.randint(2019, 2024),
            ),
        )


def _fill_school(con: sqlite3.Connection, rng: random.Random) -> None:
    subjects = ["math", "physics", "history", "biology", "art", "music"]
    for i in range(1, 13):
        con.execute(
            "INSERT INTO teachers VALUES (?,?,?,?)",
            (i, _person(rng), rng.choice(subjects), rng.randint(1, 30)),
        )
    topics = [
        "Algebra",
        "Optics",
        "Rome",
        "Genetics",
        "Painting",
        "Jazz",
        "Calculus",
        "Mechanics",
        "Empires",
        "Ecology",
    ]
    levels = ["I", "II", "Advanced"]
    titles = rng.sample([f"{t} {lv}" for t in topics for lv in levels], 24)
    for i, t in enumerate(titles, 1):
        con.execute(
            "INSERT INTO courses VALUES (?,?,?,?,?)",
            (i, t, rng.randint(1, 10), rng.choice([2, 3, 4, 5]), rng.choice(["fall", "spring"])),
        )
    for i in range(1, 51):
        con.execute(
            "INSERT INTO students VALUES (?,?,?,?,?)",
            (i, _person(rng), rng.randint(9, 12), rng.choice(_CITIES), rng.randint(2006, 2010)),
        )
    for i in range(1, 161):
        con.execute(
            "INSERT INTO enrollments VALUES (?,?,?,?)",
            (i, rng.randint(1, 45), rng.randint(1, 24), rng.randint(40, 100)),
        )


def _fill_flights(con: sqlite3.Connection, rng: random.Random) -> None:
    codes = rng.sample(["LIS", "OSL", "DEN", "KIX", "LOS", "AUS", "OPO", "DUB", "ICN", "LIM"], 10)
    for i, (code, city, country) in enumerate(zip(codes, _CITIES, _COUNTRIES, strict=True), 1):
        con.execute(
            "INSERT INTO airports VALUES (?,?,?,?,?)",
            (i, code, f"{city} International", city, country),
        )
    carriers = ["Aurora", "Bluebird", "Condor", "Delta", "Echo", "Falcon", "Gull", "Heron"]
    for i, c in enumerate(carriers, 1):
        con.execute(
            "INSERT INTO airlines VALUES (?,?,?,?)",
            (i, f"{c} Air", rng.choice(_COUNTRIES), rng.randint(1950, 2015)),
        )
    for i in range(1, 61):
        o, d = rng.sample(range(1, 11), 2)
        con.execute(
            "INSERT INTO flights VALUES (?,?,?,?,?,?,?)",
            (i, f"FL{100 + i}", rng.randint(1, 7), o, d, rng.randint(300, 9000), rng.randint(50, 400)),
        )
    for i in range(1, 151):
        con.execute(
            "INSERT INTO bookings VALUES (?,?,?,?,?)",
            (
                i,
                rng.randint(1, 55),
                _person(rng),
                rng.choice(["economy", "business", "first"]),
                round(rng.uniform(60, 2500), 2),
            ),
        )


def _fill_library(con: sqlite3.Connection, rng: random.Random) -> None:
    for i in range(1, 21):
        con.execute(
            "INSERT INTO authors VALUES (?,?,?,?)",
            (i, _person(rng), rng.choice(_COUNTRIES), rng.randint(1900, 1990)),
        )
    genres = ["mystery", "fantasy", "poetry", "history", "science", "romance"]
    words = [
        "Silent",
        "River",
        "Glass",
        "Garden",
        "Last",
        "Winter",
        "Hidden",
        "Empire",
        "Paper",
        "Moon",
        "Iron",
        "Coast",
    ]
    titles = rng.sample([f"The {a} {b}" for a in words for b in words if a != b], 45)
    for i, t in enumerate(titles, 1):
        con.execute(
            "INSERT INTO books VALUES (?,?,?,?,?,?)",
            (i, t, rng.randint(1, 17), rng.choice(genres), rng.randint(1950, 2023), rng.randint(90, 900)),
        )
    for i in range(1, 36):
        con.execute(
            "INSERT INTO members VALUES (?,?,?,?)",
            (i, _person(rng), rng.choice(_CITIES), rng.randint(2010, 2024)),
        )
    for i in range(1, 141):
        con.execute(
            "INSERT INTO loans VALUES (?,?,?,?,?)",
            (i, rng.randint(1, 40), rng.randint(1, 30), rng.randint(2018, 2024), rng.randint(1, 60)),
        )


_SCHEMAS: dict[str, Schema] = {
    "shop": Schema(
        "shop",
        """CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT, joined_year INTEGER);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL, stock INTEGER);
CREATE TABLE orders (id INTEGER PRIMARY KEY, code TEXT, customer_id INTEGER REFERENCES customers(id), product_id INTEGER REFERENCES products(id), quantity INTEGER, status TEXT, year INTEGER);""",
        (
            Table(
                "customers",
                "customers",
                "customer",
                "name",
                (("city", "city"),),
                (("joined_year", "joining year"),),
            ),
            Table(
                "products",
                "products",
                "product",
                "name",
                (("category", "category"),),
                (("price", "price"), ("stock", "stock")),
            ),
            Table(
                "orders",
                "orders",
                "order",
                "code",
                (("status", "status"),),
                (("quantity", "quantity"), ("year", "year")),
            ),
        ),
        (
            Link("orders", "customer_id", "customers", "placed"),
            Link("orders", "product_id", "products", "for"),
        ),
        _fill_shop,
    ),
    "school": Schema(
        "school",
        """CREATE TABLE teachers (id INTEGER PRIMARY KEY, name TEXT, subject TEXT, years_experience INTEGER);
CREATE TABLE courses (id INTEGER PRIMARY KEY, title TEXT, teacher_id INTEGER REFERENCES teachers(id), credits INTEGER, term TEXT);
CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT, grade INTEGER, city TEXT, birth_year INTEGER);
CREATE TABLE enrollments (id INTEGER PRIMARY KEY, student_id INTEGER REFERENCES students(id), course_id INTEGER REFERENCES courses(id), score INTEGER);""",
        (
            Table(
                "teachers",
                "teachers",
                "teacher",
                "name",
                (("subject", "subject"),),
                (("years_experience", "years of experience"),),
            ),
            Table("courses", "courses", "course", "title", (("term", "term"),), (("credits", "credits"),)),
            Table(
                "students",
                "students",
                "student",
                "name",
                (("city", "city"), ("grade", "grade")),
                (("birth_year", "birth year"),),
            ),
        ),
        (Link("courses", "teacher_id", "teachers", "taught by"),),
        _fill_school,
    ),
    "flights": Schema(
        "flights",
        """CREATE TABLE airports (id INTEGER PRIMARY KEY, code TEXT, name TEXT, city TEXT, country TEXT);
CREATE TABLE airlines (id INTEGER PRIMARY KEY, name TEXT, country TEXT, founded INTEGER);
CREATE TABLE flights (id INTEGER PRIMARY KEY, number TEXT, airline_id INTEGER REFERENCES airlines(id), origin_id INTEGER REFERENCES airports(id), destination_id INTEGER REFERENCES airports(id), distance INTEGER, duration INTEGER);
CREATE TABLE bookings (id INTEGER PRIMARY KEY, flight_id INTEGER REFERENCES flights(id), passenger TEXT, class TEXT, fare REAL);""",
        (
            Table(
                "airlines",
                "airlines",
                "airline",
                "name",
                (("country", "country"),),
                (("founded", "founding year"),),
            ),
            Table(
                "flights",
                "flights",
                "flight",
                "number",
                (),
                (("distance", "distance"), ("duration", "duration in minutes")),
            ),
            Table("bookings", "bookings", "booking", "passenger", (("class", "class"),), (("fare", "fare"),)),
            Table("airports", "airports", "airport", "name", (("country", "country"),), ()),
        ),
        (
            Link("flights", "airline_id", "airlines", "operated by"),
            Link("bookings", "flight_id", "flights", "on"),
            Link("flights", "origin_id", "airports", "departing from"),
        ),
        _fill_flights,
    ),
    "library": Schema(
        "library",
        """CREATE TABLE authors (id INTEGER PRIMARY KEY, name TEXT, country TEXT, birth_year INTEGER);
CREATE TABLE books (id INTEGER PRIMARY KEY, title TEXT, author_id INTEGER REFERENCES authors(id), genre TEXT, year INTEGER, pages INTEGER);
CREATE TABLE members (id INTEGER PRIMARY KEY, name TEXT, city TEXT, joined_year INTEGER);
CREATE TABLE loans (id INTEGER PRIMARY KEY, book_id INTEGER REFERENCES books(id), member_id INTEGER REFERENCES members(id), year INTEGER, days INTEGER);""",
        (
            Table(
                "authors",
                "authors",
                "author",
                "name",
                (("country", "country"),),
                (("birth_year", "birth year"),),
            ),
            Table(
                "books",
                "books",
                "book",
                "title",
                (("genre", "genre"),),
                (("year", "publication year"), ("pages", "number of pages")),
            ),
            Table(
                "members",
                "members",
                "member",
                "name",
                (("city", "city"),),
                (("joined_year", "joining year"),),
            ),
        ),
        (Link("books", "author_id", "authors", "written by"), Link("loans", "member_id", "members", "by")),
        _fill_library,
    ),
}


def _build(db_id: str, seed: int, folder: Path) -> Path:
    """The SQLite file for ``db_id`` built from ``seed`` into a new file of ``folder`` (an unpredictable
    name, mode 0600); the caller renames or removes it."""
    if db_id not in _SCHEMAS:
        raise ValueError(f"db_id must be one of {', '.join(SCHEMAS)}, got {db_id!r}")
    schema = _SCHEMAS[db_id]
    fd, name = tempfile.mkstemp(prefix=f".{db_id}-", suffix=".tmp", dir=folder)
    os.close(fd)
    tmp = Path(name)
    try:
        con = sqlite3.connect(tmp)
        try:
            con.executescript(schema.ddl)
            schema.fill(con, random.Random(f"{seed}:{db_id}"))
            con.commit()
        finally:
            con.close()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def build_database(db_id: str, seed: int, path: str | os.PathLike[str]) -> Path:
    """Write the SQLite file for ``db_id`` built from ``seed`` (same seed, same bytes), atomically."""
    path = Path(path)
    os.replace(_build(db_id, seed, path.parent), path)
    return path


# -- the private cache of built databases ----------------------------------------------------------


class UnsafeCacheError(PermissionError):
    """A cache folder or file that someone else could have written: refused, never read."""


def cache_dir() -> Path:
    """Where the databases are cached by default: ``$XDG_CACHE_HOME`` (when absolute, as the XDG spec
    says) or ``~/.cache``, then ``openrl-jupyter/sql``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return root / "openrl-jupyter" / "sql"


def _refuse(path: Path, why: str) -> UnsafeCacheError:
    return UnsafeCacheError(
        f"refusing {path} for the text-to-SQL databases: {why}. Another account could plant a database "
        "there and change every reward computed from it; remove it, or use a folder only you can write "
        "(directory=...)"
    )


def _check_owner(path: Path, st: os.stat_result, *, root_ok: bool) -> None:
    uid = os.getuid()
    if st.st_uid != uid and not (root_ok and st.st_uid == 0):
        raise _refuse(path, f"it is owned by uid {st.st_uid}, not by this user (uid {uid})")


def _check_private(path: Path, st: os.stat_result) -> None:
    _check_owner(path, st, root_ok=False)
    if st.st_mode & 0o022:
        raise _refuse(path, f"it is writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o})")


_folders: dict[tuple[Path, int], tuple[Path, tuple[int, int, int, int]]] = {}  # checked: real path, stat


def _private_folder(folder: Path, made_here: int) -> Path:
    """``folder`` created (mode 0700) and checked: it and the ``made_here - 1`` folders above it (the
    ones this cache makes) are this user's and writable by no one else; every folder above them is
    this user's or root's. Its real path (symbolic links resolved: their targets are what is checked).
    Checked once per process while the folder stays the same one (only its owner or root can swap a
    folder above it, and those were checked)."""
    folder = Path(os.path.abspath(folder))
    known = _folders.get((folder, made_here))
    if known is not None:
        try:
            st = os.stat(known[0])
            if (st.st_dev, st.st_ino, st.st_uid, st.st_mode) == known[1] and os.path.realpath(folder) == str(
                known[0]
            ):
                return known[0]
        except OSError:
            pass
    for level in reversed([folder, *folder.parents][:made_here]):
        try:
            level.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except FileNotFoundError:
            level.mkdir(mode=0o700, parents=True, exist_ok=True)
    real = Path(os.path.realpath(folder))
    chain = [real, *real.parents]
    for i, level in enumerate(chain):
        st = os.stat(level)
        if i < made_here:
            if not stat.S_ISDIR(st.st_mode):
                raise _refuse(level, "it is not a folder")
            _check_private(level, st)
        else:
            _check_owner(level, st, root_ok=True)
    st = os.stat(real)
    _folders[folder, made_here] = (real, (st.st_dev, st.st_ino, st.st_uid, st.st_mode))
    return real


_cache_lock = threading.Lock()
_fallback: list[Path] = []  # this process's private temporary folder, when the cache folder cannot be made
_digests: dict[tuple[str, int], str] = {}  # (db_id, seed) -> SHA-256 of what this process builds
_verified: dict[Path, tuple[int, int, int, int]] = {}  # file -> (dev, inode, size, mtime) when last checked


def _default_folder() -> Path:
    try:
        return _private_folder(cache_dir(), made_here=2)
    except UnsafeCacheError:
        raise
    except (OSError, RuntimeError, KeyError):  # no usable home (read-only, missing, no passwd entry)
        if not _fallback:
            folder = Path(tempfile.mkdtemp(prefix="openrl-sql-"))  # 0700, a name no one can predict
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            _fallback.append(folder)
        return _fallback[0]


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def database_path(db_id: str, seed: int = 0, directory: str | os.PathLike[str] | None = None) -> Path:
    """The database file for (``db_id``, ``seed``), built on first use and cached on disk.

    This is how a job (or a detached run) gets the databases back: rebuilt from the seed, not shipped.
    The cache is this user's: ``directory``, by default :func:`cache_dir` (``~/.cache/openrl-jupyter/sql``;
    a private temporary folder of this process when that cannot be made). Its folder is created mode
    0700 and files are written mode 0600 and atomically. A folder or file that another account owns or
    could write, or a file that is a symbolic link, is refused (:class:`UnsafeCacheError`, naming the
    path and why). A cached file is used only when its SHA-256 is that of the database this process
    builds from the seed (checked on first use, and again whenever the file changes); anything else,
    e.g. a file of an older generator, is rebuilt in its place.
    """
    if db_id not in _SCHEMAS:
        raise ValueError(f"db_id must be one of {', '.join(SCHEMAS)}, got {db_id!r}")
    seed = int(seed)
    with _cache_lock:
        folder = _default_folder() if directory is None else _private_folder(Path(directory), made_here=1)
        path = folder / f"{db_id}-v{GENERATOR_VERSION}-seed{seed}.sqlite"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat.S_ISLNK(st.st_mode):
                raise _refuse(path, f"it is a symbolic link (to {os.readlink(path)})")
            if not stat.S_ISREG(st.st_mode):
                raise _refuse(path, "it is not a regular file")
            _check_private(path, st)
            if _verified.get(path) == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns):
                return path
        fresh = None
        if (db_id, seed) not in _digests:
            fresh = _build(db_id, seed, folder)
            _digests[db_id, seed] = _sha256(fresh)
        try:
            if st is None or _sha256(path) != _digests[db_id, seed]:
                os.replace(fresh or _build(db_id, seed, folder), path)
                fresh = None
        finally:
            if fresh is not None:
                fresh.unlink(missing_ok=True)
        st = os.lstat(path)
        _verified[path] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return path


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
