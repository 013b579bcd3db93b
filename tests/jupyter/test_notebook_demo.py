"""examples/notebook_demo.py's kernel, as `make demo` starts it: it greets no one with warnings."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from notebook_demo import execute  # noqa: E402


def test_the_demo_kernel_runs_without_the_tcp_encryption_warning(tmp_path, capfd):
    src = tmp_path / "hello.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('hello from the kernel')")])
    nbformat.write(nb, src)
    done = execute(src, tmp_path / "out", {})
    assert done.cells[0].outputs[0]["text"] == "hello from the kernel\n"
    err = capfd.readouterr().err  # the kernel inherits this process's stderr, as under `make demo`
    assert "without encryption" not in err
