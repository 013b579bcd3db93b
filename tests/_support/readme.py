"""The fenced blocks of a Markdown file, in reading order, with the marker that says how to check them;
the docs site's pages in the order of its nav, and the links of a page.

``tests/readme/test_readme.py`` executes README.md and the site's pages through this. A block is code
when its fence names
``bash``/``sh``/``shell``/``python``, or has no language and starts with ``%`` (a notebook cell); any
other block (a diagram, sample output) is text and never runs. An HTML comment on the line before the
fence — invisible on GitHub — changes what the test does with the block:

    <!-- readme-test: background -->              a shell block that starts a server: it runs in the
                                                  background until its page ends
    <!-- readme-test: background keep -->         ... until the reader's last page
    <!-- readme-test: new-kernel -->              a notebook block that starts in a fresh kernel
    <!-- readme-test: needs gpu: REASON -->       not run here; ``gpu``, ``cluster`` or ``files`` (the
    <!-- readme-test: needs cluster: REASON -->   reader's own model folder or data), with the reason
    <!-- readme-test: covered-by PATH: REASON -->  not run here because PATH (a test or a make target's
                                                  script, which must exist) runs it; REASON says why
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CODE_LANGS = {"bash": "shell", "sh": "shell", "shell": "shell", "console": "shell", "python": "python"}
NEEDS = ("gpu", "cluster", "files")
_MARKER = re.compile(r"^<!--\s*readme-test:\s*(?P<body>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>```+)\s*(?P<lang>[\w+-]*)\s*$")


class MarkerError(ValueError):
    """A readme-test marker that does not parse (the README must say exactly what a skip is)."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the opening fence's line, 1-based
    kind: str  # "shell", "python", "notebook" (a %-cell) or "text"
    code: str
    headings: tuple[str, ...]  # the heading path, e.g. ("## In a notebook", "### Options")
    marker: str = ""  # the marker's body, "" when none

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line} ({self.headings[-1] if self.headings else 'top'})"

    @property
    def runs(self) -> bool:
        return self.kind != "text" and self.skip_reason is None

    @property
    def words(self) -> list[str]:
        return self.marker.split()

    @property
    def skip_reason(self) -> str | None:
        """Why this block is not run here, from its marker; None when it runs."""
        w = self.words
        if not w:
            return None
        if w[0] == "needs":
            return f"needs {self.marker[len('needs') :].strip()}"
        if w[0] == "covered-by":
            return f"covered by {self.marker[len('covered-by') :].strip()}"
        return None

    @property
    def covered_by(self) -> str | None:
        w = self.words
        return w[1].rstrip(":") if w and w[0] == "covered-by" else None

    @property
    def background(self) -> bool:
        return bool(self.words) and self.words[0] == "background"

    @property
    def keep(self) -> bool:
        return self.background and "keep" in self.words[1:]

    @property
    def new_kernel(self) -> bool:
        return self.words == ["new-kernel"]


def _check_marker(body: str, where: str, kind: str) -> None:
    w = body.split()
    ok = False
    if w and w[0] == "needs":
        ok = len(w) >= 3 and w[1].rstrip(":") in NEEDS and w[1].endswith(":")
    elif w and w[0] == "covered-by":
        ok = len(w) >= 3 and w[1].endswith(":")
    elif w and w[0] == "background":
        ok = w[1:] in ([], ["keep"]) and kind == "shell"
    elif w == ["new-kernel"]:
        ok = kind in ("python", "notebook")
    if not ok:
        raise MarkerError(
            f"{where}: readme-test marker {body!r} on a {kind} block: use 'background [keep]' (shell), "
            "'new-kernel' (python/%), 'needs gpu|cluster|files: REASON' or 'covered-by PATH: REASON'"
        )


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` in order, classified, with its heading path and marker."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    headings: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        heading = re.match(r"^(#{1,6}) \S", line)
        if heading:
            level = len(heading.group(1))
            headings = [h for h in headings if len(h.split(" ", 1)[0]) < level] + [line.strip()]
            i += 1
            continue
        fence = _FENCE.match(line)
        if not fence:
            i += 1
            continue
        ticks, lang = fence.group("fence"), fence.group("lang").lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(ticks):
            end += 1
        body = "\n".join(lines[i + 1 : end]) + "\n"
        if lang in CODE_LANGS:
            kind = CODE_LANGS[lang]
        elif not lang and body.lstrip().startswith("%"):
            kind = "notebook"
        else:
            kind = "text"
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        m = _MARKER.match(prev.strip())
        marker = m.group("body") if m else ""
        where = f"{path.name}:{i + 1}"
        if marker:
            _check_marker(marker, where, kind)
        out.append(Block(path, i + 1, kind, body, tuple(headings), marker))
        i = end + 1
    return out


# -- the docs site ------------------------------------------------------------------------------------


def generated() -> tuple[str, ...]:
    """The pages ``make docs`` writes from the code (docs/_gen/reference.py; git-ignored, not read here)."""
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "_gen" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.GENERATED


def nav_pages() -> list[str]:
    """Every page of mkdocs.yml's nav, in order, relative to docs/."""
    found: list[str] = []

    def walk(item) -> None:
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                walk(value)
        elif isinstance(item, list):
            for value in item:
                walk(value)

    class Loader(yaml.SafeLoader):
        """mkdocs.yml's ``!!python/...`` tags (a slugify function) are mkdocs's; the nav needs none."""

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    walk(yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)["nav"])
    return found


def docs_pages() -> list[Path]:
    """The hand-written pages a reader goes through, in nav order."""
    made = set(generated())
    return [DOCS / p for p in nav_pages() if p not in made]


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path):
    """``(line number, line)`` of a Markdown file outside its fenced blocks, inline code removed."""
    fence = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            fence = not fence
        elif not fence:
            yield n, re.sub(r"`[^`]*`", "", line)


def links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of each relative link and image outside code (URLs with a scheme left out)."""
    found = [(n, target) for n, line in _prose(path) for target in _LINK.findall(line)]
    return [(n, t) for n, t in found if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def anchors(path: Path) -> set[str]:
    """The heading anchors of a Markdown file as GitHub makes them (mkdocs.yml has the site do the same)."""
    found = set()
    text = path.read_text(encoding="utf-8").splitlines()
    for n, _ in _prose(path):
        heading = re.match(r"^#{1,6} (.*)", text[n - 1])
        if heading:
            words = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", words).replace(" ", "-"))
    return found
