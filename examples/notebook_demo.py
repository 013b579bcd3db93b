"""`make demo`: execute notebooks/01-quickstart.ipynb headless and report what the model learned.

The notebook starts its own embedded service (`%openrl connect --local`, tiny model, CPU), warms the
model up on the 100 single-digit sums, then trains it with RL on an exact-match reward in the
background, tightens the reward mid-run, pauses, saves and resumes, and quizzes it. This script runs
it with nbclient in a real kernel, saves the executed notebook and the reward-curve PNG under --out,
prints the notebook's ``demo:`` lines and exits non-zero unless the final greedy accuracy on all 100
sums is at least --min-accuracy.

    python examples/notebook_demo.py --out build/demo
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "01-quickstart.ipynb"


def execute(notebook: Path, out: Path, env: dict[str, str], timeout_s: int = 1800):
    """Run every cell of ``notebook`` in a fresh kernel (cwd = out); returns the executed notebook."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    out.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(notebook, as_version=4)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    sockets = tempfile.TemporaryDirectory(prefix="openrl-demo-kernel-")
    try:
        # IPC sockets in a private folder: no TCP ports on this machine, and no "running over TCP
        # without encryption" warning from the kernel.
        km = KernelManager(
            kernel_name="python3", transport="ipc", connection_file=os.path.join(sockets.name, "kernel.json")
        )
        client = NotebookClient(nb, km=km, timeout=timeout_s, resources={"metadata": {"path": str(out)}})
        try:
            client.execute(cleanup_kc=True)  # a kernel manager given to nbclient is not shut down otherwise
        finally:
            nbformat.write(nb, out / notebook.name)
    finally:
        sockets.cleanup()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the notebook's)")
    p.add_argument("--out", default=str(ROOT / "build" / "demo"))
    p.add_argument("--min-accuracy", type=float, default=0.8)
    args = p.parse_args()
    out = Path(args.out).resolve()
    env = {"OPENRL_DEMO_OUT": str(out)}
    if args.steps is not None:
        env["OPENRL_DEMO_STEPS"] = str(args.steps)
    print(f"demo: executing {NOTEBOOK.relative_to(ROOT)} in a fresh kernel ...", flush=True)
    t0 = time.monotonic()
    try:
        nb = execute(NOTEBOOK, out, env)
    except Exception as exc:  # nbclient's CellExecutionError carries the cell's traceback
        print(f"demo: the notebook failed: {exc}", file=sys.stderr)
        return 1
    for cell in nb.cells:  # the notebook's own summary lines, and its quiz
        for o in cell.get("outputs", []):
            for line in o.get("text", "").splitlines():
                if line.startswith(("demo:", "quiz:")) or line.endswith(("right", "WRONG")):
                    print(line)
    result = json.loads((out / "quickstart-history.json").read_text())
    evals = [h["eval_reward"] for h in result["rl"] if h.get("eval_reward") is not None]
    print(f"demo: executed notebook {out / NOTEBOOK.name}")
    print(f"demo: reward curve {out / 'quickstart-reward.png'} ({time.monotonic() - t0:.0f} s in all)")
    if not evals or evals[-1] < args.min_accuracy:
        print(
            f"demo: the final greedy accuracy {evals[-1:]} < {args.min_accuracy}: something is wrong",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
