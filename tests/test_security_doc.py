"""docs/security.md holds each promise with a test: every test it names exists (a renamed or deleted test
would leave a promise unheld), and every test module of tests/security/ is named there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "security.md"


def _named() -> tuple[set[tuple[str, str]], set[str]]:
    """(file, test) pairs and whole files the doc names; a bare ``::test`` continues the last file."""
    pairs, files, last = set(), set(), None
    for m in re.finditer(r"`(tests/[\w/]+\.py)?(?:::(\w+))?[^`]*`", DOC.read_text()):
        path, test = m.group(1), m.group(2)
        if path:
            last = path
            if test is None:
                files.add(path)
        if test and last:
            pairs.add((last, test))
    return pairs, files


def test_every_test_the_security_page_names_exists():
    pairs, files = _named()
    assert len(pairs) > 50
    missing = []
    for path, test in sorted(pairs):
        source = ROOT / path
        if not source.is_file() or not re.search(rf"^(async )?def {test}\(", source.read_text(), re.M):
            missing.append(f"{path}::{test}")
    missing += [f for f in sorted(files) if not (ROOT / f).is_file()]
    assert not missing, f"docs/security.md names tests that do not exist: {missing}"


def test_every_security_test_module_is_on_the_security_page():
    pairs, files = _named()
    named = files | {p for p, _ in pairs}
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "security").glob("test_*.py")}
    assert modules <= named, (
        f"tests/security modules docs/security.md does not name: {sorted(modules - named)}"
    )
