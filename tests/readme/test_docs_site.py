"""The docs site without building it: every page is in the nav, every link and anchor resolves (what
`mkdocs build --strict` checks too, here for README.md as well), and the reference `make docs` generates
names every setting, flag, magic option and route the code has."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from tests._support.readme import DOCS, ROOT, anchors, docs_pages, generated, links, nav_pages

README = ROOT / "README.md"
K8S_README = ROOT / "k8s" / "README.md"


def test_every_page_is_in_the_nav_once():
    nav = nav_pages()
    assert len(nav) == len(set(nav)), f"a page is twice in mkdocs.yml's nav: {nav}"
    written = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "_gen" not in p.parts}
    missing = written - set(nav) - set(generated())
    assert not missing, f"pages under docs/ that mkdocs.yml's nav does not list: {sorted(missing)}"
    assert not set(nav) - written - set(generated()), "mkdocs.yml's nav lists pages that do not exist"


@pytest.mark.parametrize(
    "page", [README, K8S_README, *docs_pages()], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_links_point_at_files_and_anchors_that_exist(page):
    """k8s/README.md too: the site shows it as a page (its links into the repository become paths)."""
    made = {DOCS / p for p in generated()}
    broken = []
    for line, target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{line} -> {target}"
        if page.is_relative_to(DOCS) and not dest.is_relative_to(DOCS):
            broken.append(f"{where}: outside docs/, so not on the site (write the path as `code`)")
        elif dest in made:
            continue  # written by make docs; mkdocs --strict checks its anchors
        elif not dest.exists():
            broken.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where}: no heading makes the anchor #{anchor}")
    assert not broken, "\n".join(broken)


def _generator():
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "_gen" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_generated_reference_names_everything_the_code_has(tmp_path):
    from openrl_common.protocol import LIMIT_SETTINGS
    from openrl_jupyter.magic_args import parsers
    from openrl_service import config

    gen = _generator()
    assert gen.main([str(tmp_path)]) == 0
    pages = {name: (tmp_path / name).read_text() for name in gen.GENERATED}

    settings = pages["reference/settings.md"]
    for cls in (config.Settings, config.Limits):
        for f in dataclasses.fields(cls):
            if f.name != "limits":
                assert f"| `{f.name}` |" in settings, f"reference/settings.md has no row for {f.name}"
    for var in config.env_variables():
        assert f"`{var}`" in settings, f"reference/settings.md does not name {var}"
    for limit, var in LIMIT_SETTINGS.items():
        assert f"| `{limit}` | `{var}` |" in settings

    cli = pages["reference/cli.md"]
    for dest, flags in gen.serve_flags().items():
        if dest != "help":
            assert all(f"`{flag}`" in cli for flag in flags), f"reference/cli.md lacks {flags}"
    for command in ("serve", "export", "make-tiny-model", "stop", "admin tenants", "admin remove"):
        assert f"## `openrl-service {command}`" in cli

    magics = pages["reference/magics.md"]
    for verb, parser in parsers().items():
        assert f"## `%openrl {verb}`" in magics
        for action in parser._actions:
            for flag in action.option_strings if action.dest != "help" else ():
                assert f"`{flag}`" in magics, f"reference/magics.md lacks %openrl {verb} {flag}"

    http = pages["reference/http-api.md"]
    spec = __import__("json").loads(pages["reference/openapi.json"])
    for path, methods in spec["paths"].items():
        for method in methods:
            assert f"| `{method.upper()}` | `{path}` |" in http, (
                f"reference/http-api.md lacks {method} {path}"
            )
    assert "/openrl/v1/runs" in spec["paths"] and "/api/v1/forward_backward" in spec["paths"]

    kube = pages["cluster/kubernetes.md"]
    k8s = (ROOT / "k8s" / "README.md").read_text()
    headings = [line for line in k8s.splitlines() if line.startswith("## ")]
    assert headings and all(h in kube for h in headings), (
        "cluster/kubernetes.md lost a section of k8s/README.md"
    )


def test_a_link_out_of_the_site_becomes_a_path(tmp_path, monkeypatch):
    """k8s/README.md links into the repository; on the site such a link shows the path (no broken link)."""
    gen = _generator()
    fake = tmp_path / "k8s"
    fake.mkdir(parents=True)
    (fake / "README.md").write_text(
        "See [the overlay](overlays/cpu/kustomization.yaml), [security](../docs/security.md#assets), "
        "[LWS](https://lws.sigs.k8s.io) and [below](#images).\n"
    )
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen, "DOCS", tmp_path / "docs")
    page = gen.kubernetes_page()
    assert "the overlay (`k8s/overlays/cpu/kustomization.yaml`)" in page
    assert "[security](../security.md#assets)" in page
    assert "[LWS](https://lws.sigs.k8s.io)" in page and "[below](#images)" in page


def test_the_readme_stays_short():
    """The README is the first screen and the ten-minute path; the reference lives on the site."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move reference material to docs/"
    assert any("make demo" in line for line in lines) and any("make test" in line for line in lines)
    assert Path(ROOT / "mkdocs.yml").exists()


def test_every_pip_install_line_names_a_source_that_exists():
    """The package is on no index until a release is published: a line that installs it does so from
    the clone (``-e ".[extra]"``, with extras pyproject.toml defines); any other package is pinned, so
    the line means the same tomorrow; files it names (``-c``, ``-r``) exist."""
    import re
    import shlex

    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    bad = []
    for page in [README, K8S_README, *docs_pages()]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for m in re.finditer(r"pip install ([^`#|]*)", line):
                where = f"{page.relative_to(ROOT)}:{n}: pip install {m.group(1).strip()}"
                args = shlex.split(m.group(1))
                while args:
                    arg = args.pop(0)
                    if arg in ("-c", "-r"):
                        name = args.pop(0) if args else ""
                        if not (ROOT / name).is_file():
                            bad.append(f"{where}: no file {name!r} in the repository")
                    elif arg.startswith("-"):
                        continue
                    elif re.fullmatch(r"\.(\[[\w,-]+\])?", arg):
                        unknown = set(arg[2:-1].split(",")) - extras if "[" in arg else set()
                        if unknown:
                            bad.append(f"{where}: pyproject.toml defines no extra {sorted(unknown)}")
                    elif re.match(r"openrl[-_]jupyter\b", arg):
                        bad.append(
                            f'{where}: openrl-jupyter is on no index; from a clone: pip install -e ".[…]"'
                        )
                    elif "==" not in arg:
                        bad.append(f"{where}: {arg} is not pinned (name==version)")
    assert not bad, "\n".join(bad)
