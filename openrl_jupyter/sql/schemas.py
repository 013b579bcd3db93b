"""The text-to-SQL schemas (shop, school, flights, library): DDL, the rows drawn from a seed with
built-in word lists, the metadata the question templates need, and building a database file."""

from __future__ import annotations

import os
import random
import sqlite3
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
