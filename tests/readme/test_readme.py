"""README.md and the docs site, executed as a reader meets them: every shell, Python and ``%openrl``
block, README first, then the site's pages in the order of mkdocs.yml's nav.

A newcomer copies the blocks top to bottom; this test does the same, so neither the README nor the site
can drift from the code. How a block runs (tests/_support/readme.py has the markers):

- shell blocks run in bash (``set -e``) from the checkout, with ``.venv/bin`` first on PATH; what a
  block ``export``s stays set for the blocks after it, on later pages too, as in the reader's shell. A
  block marked ``background`` (a server) runs beside the later blocks until its page ends (``keep``:
  until the last page); it must answer ``/readyz`` first, and the ``export`` lines it prints are run,
  as the page tells the reader to.
- Python and ``%openrl`` blocks run in a real kernel, one per page (a fresh one where the block is
  marked ``new-kernel``), started in an empty notebook folder with the environment so far.
- Blocks marked ``needs gpu|cluster|files`` or ``covered-by`` are skipped with their reason (and a
  ``covered-by`` path must exist); every other code block runs, so CI's strict mode sees no silent skip.

What differs from a reader's machine, on purpose: ``127.0.0.1:8000`` is a free port (the first server
a block starts takes it; a later one gets its own port and data folder), ``/tmp/`` is this test's
folder, ``make TARGET`` runs as ``make -n TARGET`` (CI already runs the long targets: ``make test``
itself, ``make demo`` in tests/jupyter/test_notebook_demo.py), and ``pip install`` runs with
``--dry-run`` (this venv is what ``make venv`` built; the dry run still resolves our package from the
checkout). Data, caches and Jupyter's folders are this test's own (XDG_DATA_HOME, HF_HOME).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from openrl_jupyter.local import free_port
from tests._support.kernel import Kernel
from tests._support.readme import ROOT, Block, MarkerError, blocks, docs_pages

README = ROOT / "README.md"
K8S_README = ROOT / "k8s" / "README.md"
PAGES = [README, *docs_pages()]  # what a reader goes through, in order
BLOCK_TIMEOUT_S = 300  # a hang guard, not a speed check: each block takes under a minute on an idle machine
READY_TIMEOUT_S = 120
# What the reader's environment does not have: the test's own service and keys come from the README.
CLEARED_PREFIXES = ("OPENRL_", "TINKER_", "HF_", "JUPYTER_", "XDG_DATA_HOME", "HF_HOME")
KEPT = {"TINKER_TELEMETRY", "OPENRL_CI_STRICT"}
COMMAND = r"^(\$ )?(pip|make|openrl-service|python|export|kubectl|helm|gcloud|import|from|%)\b"


def _shell(code: str, port: int, tmp: Path) -> str:
    out = []
    for line in _common(code, port, tmp).splitlines():
        line = re.sub(r"^(\s*)make (?!-n)", r"\1make -n ", line)
        line = re.sub(r"\bpip install (?!--dry-run)", "pip install --dry-run ", line)
        out.append(line)
    return "\n".join(out) + "\n"


def _tag(block: Block) -> str:
    """A name for the block's files, unique across pages (``docs_service_openai.md-12``)."""
    return f"{block.path.relative_to(ROOT).as_posix().replace('/', '_')}-{block.line}"


def _common(code: str, port: int, tmp: Path) -> str:
    code = re.sub(r"(127\.0\.0\.1|localhost):8000\b", rf"\g<1>:{port}", code)
    return re.sub(r"(?<![\w.])/tmp/", f"{tmp}/", code)


@dataclass
class Server:
    block: Block
    proc: subprocess.Popen
    log: Path
    port: int


@dataclass
class Reader:
    """One reader going through the README: their shell's environment, servers, current kernel."""

    tmp: Path
    port: int
    env: dict[str, str]
    servers: list[Server] = field(default_factory=list)
    kernel: Kernel | None = None
    notebook_dir: Path | None = None
    timings: list[tuple[str, str, float]] = field(default_factory=list)

    # -- shell -------------------------------------------------------------------------------------

    def shell(self, block: Block) -> None:
        script = self.tmp / f"block-{_tag(block)}.sh"
        env_out = self.tmp / f"block-{_tag(block)}.env"
        body = _shell(block.code, self.port, self.tmp)
        script.write_text(f"set -eo pipefail\n{body}\nenv -0 > {env_out}\n")
        r = subprocess.run(
            ["bash", str(script)],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        assert r.returncode == 0, (
            f"{block.where} failed (exit {r.returncode}):\n{block.code}\nstdout:\n{r.stdout[-4000:]}\n"
            f"stderr:\n{r.stderr[-4000:]}"
        )
        for item in env_out.read_bytes().split(b"\0"):
            name, eq, value = item.decode().partition("=")
            if eq and name not in ("_", "SHLVL", "PWD", "OLDPWD"):
                self.env[name] = value

    def background(self, block: Block) -> None:
        first = not self.servers
        port = self.port if first else free_port()
        env = dict(self.env, OPENRL_PORT=str(port))
        if not first:  # a second service beside the first: its own data folder (the first holds its lock)
            env["XDG_DATA_HOME"] = str(self.tmp / f"data-{_tag(block)}")
        script = self.tmp / f"block-{_tag(block)}.sh"
        script.write_text("set -eo pipefail\n" + _shell(block.code, self.port, self.tmp))
        log = self.tmp / f"block-{_tag(block)}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                ["bash", str(script)],
                cwd=ROOT,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        server = Server(block, proc, log, port)
        self.servers.append(server)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"{block.where}: the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
                )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{block.where}: no /readyz in {READY_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        if first:  # run the export lines serve printed in the reader's shell, as the page says
            self.run_exports(log.read_text())

    def run_exports(self, output: str) -> None:
        """Run each ``export NAME=...`` command in ``output`` (from its ``export`` to the line's end) in
        bash, and keep what it set: serve prints them for the reader to paste."""
        lines = [
            line[m.start() :] for line in output.splitlines() if (m := re.search(r"\bexport \w+=", line))
        ]
        if not lines:
            return
        r = subprocess.run(
            ["bash", "-c", "set -e\n" + "\n".join(lines) + "\nenv -0"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0, f"the export lines serve printed fail in bash: {lines}\n{r.stderr}"
        for item in r.stdout.split("\0"):
            name, eq, value = item.partition("=")
            if eq and any(line.startswith(f"export {name}=") or f" {name}=" in line for line in lines):
                self.env[name] = value

    def stop_servers(self, page: Path | None) -> None:
        """Stop the servers started on ``page`` (None: all), as the reader's Ctrl-C would."""
        for s in [s for s in self.servers if page is None or (s.block.path == page and not s.block.keep)]:
            if s.proc.poll() is None:
                os.killpg(s.proc.pid, signal.SIGINT)
                try:
                    s.proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(s.proc.pid, signal.SIGKILL)
                    s.proc.wait(10)
            self.servers.remove(s)

    # -- notebook ----------------------------------------------------------------------------------

    def cell(self, block: Block) -> None:
        if self.kernel is None or block.new_kernel:
            self.end_kernel()
            self.notebook_dir = self.tmp / f"notebook-{_tag(block)}"
            self.notebook_dir.mkdir()
            self.kernel = Kernel(env=self.env, cwd=self.notebook_dir, startup_timeout=60).start()
        r = self.kernel.execute(
            _common(block.code, self.port, self.tmp), timeout=BLOCK_TIMEOUT_S, check=False
        )
        assert r.status == "ok", f"{block.where} failed in the kernel:\n{r.describe()}"

    def end_kernel(self) -> None:
        if self.kernel is not None:
            self.kernel.shutdown()
            self.kernel = None

    def run(self, block: Block) -> None:
        t0 = time.monotonic()
        if block.kind == "shell" and block.background:
            self.background(block)
        elif block.kind == "shell":
            self.shell(block)
        else:
            self.cell(block)
        self.timings.append((block.where, block.kind, time.monotonic() - t0))


def _clean_env(monkeypatch, tmp: Path) -> dict[str, str]:
    for name in list(os.environ):
        if name.startswith(CLEARED_PREFIXES) and name not in KEPT:
            monkeypatch.delenv(name)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["XDG_DATA_HOME"] = str(tmp / "data")
    env["HF_HOME"] = str(tmp / "hf")
    env["TINKER_TELEMETRY"] = "0"
    return env


def _stray_processes(tmp: Path) -> list[str]:
    """What the README's blocks left running in sessions of their own (detached-run workers, an embedded
    service that outlives its kernel): found by the data folder this test gave them, ended with it."""
    import psutil

    ended = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            if (p.info["environ"] or {}).get("XDG_DATA_HOME", "").startswith(str(tmp)):
                ended.append(" ".join(p.info["cmdline"] or [])[:120])
                p.kill()
        except (psutil.Error, TypeError):
            pass
    return ended


def test_the_readme_and_the_docs_run_as_written(tmp_path, monkeypatch):
    env = _clean_env(monkeypatch, tmp_path)
    reader = Reader(tmp_path, free_port(), env)
    page = None
    ran, skipped = [], []
    try:
        for block in (b for path in PAGES for b in blocks(path)):
            if block.path != page:
                if page is not None:
                    reader.end_kernel()
                    reader.stop_servers(page)
                page = block.path
            if block.kind == "text":
                continue
            if not block.runs:
                skipped.append(f"{block.where}: {block.skip_reason}")
                continue
            reader.run(block)
            ran.append(block.where)
    finally:
        reader.end_kernel()
        reader.stop_servers(None)
        left = _stray_processes(tmp_path)
    print(
        f"README and {len(PAGES) - 1} pages: {len(ran)} blocks ran, {len(skipped)} skipped; "
        f"left running, now ended: {left or 'nothing'}"
    )
    for where, kind, seconds in reader.timings:
        print(f"  {seconds:6.1f} s  {kind:8}  {where}")
    for line in skipped:
        print(f"  skipped  {line}")
    assert any(w.startswith("README.md:") for w in ran), "no README block ran"
    assert any(not w.startswith("README.md:") for w in ran), "no docs page's block ran"


@pytest.mark.parametrize(
    "path", [*PAGES, K8S_README], ids=lambda p: p.relative_to(ROOT).as_posix() if isinstance(p, Path) else p
)
def test_every_code_block_runs_or_says_why_not(path):
    """A block that is not run carries its reason (and a covered-by path that exists); the markers parse."""
    found = blocks(path)
    code = [b for b in found if b.kind != "text"]
    if path in (README, K8S_README):
        assert code, f"no code blocks found in {path}"
    for b in code:
        if b.covered_by:
            assert (ROOT / b.covered_by).exists(), f"{b.where}: covered-by {b.covered_by} does not exist"
    # a command in a fence without a language would be taken for text and never run: name its language
    for b in found:
        first = b.code.lstrip().split("\n", 1)[0]
        if b.kind == "text":
            assert not re.match(COMMAND, first), f"{b.where}: looks like code; fence it as bash or python"


def test_a_marker_must_say_what_it_means(tmp_path):
    md = tmp_path / "X.md"
    for marker in ("skip", "needs gpu", "needs time: slow", "covered-by tests/x.py", "background forever"):
        md.write_text(f"## A\n<!-- readme-test: {marker} -->\n```bash\necho hi\n```\n")
        with pytest.raises(MarkerError, match="X.md:3"):
            blocks(md)
    md.write_text("## A\n<!-- readme-test: needs gpu: CUDA -->\n```bash\nnvidia-smi\n```\n")
    (b,) = blocks(md)
    assert not b.runs and b.skip_reason == "needs gpu: CUDA"


def test_k8s_readme_blocks_that_need_no_cluster_run(tmp_path, monkeypatch):
    """k8s/README.md's blocks run where they can here (rendering, checks); cluster steps are marked."""
    env = _clean_env(monkeypatch, tmp_path)
    reader = Reader(tmp_path, free_port(), env)
    try:
        for block in blocks(K8S_README):
            if block.runs:
                reader.run(block)
    finally:
        reader.end_kernel()
        reader.stop_servers(None)
