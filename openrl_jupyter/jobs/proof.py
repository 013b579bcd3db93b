"""The proof at submit time: a payload unpickled and its rewards called in a clean Python."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from openrl_jupyter._exceptions import UsageError
from openrl_jupyter.jobs.common import (
    PROOF_TIMEOUT_S,
)

# -- the proof: unpickle and call in a clean Python ---------------------------------------------------
PROOF_CHILD = r"""
import asyncio, inspect, json, sys, traceback
out_path = sys.argv[1]

def done(**kw):
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(kw, f)

try:
    import cloudpickle
    body = cloudpickle.loads(sys.stdin.buffer.read())
except BaseException as exc:
    done(stage="unpickle", error=f"{type(exc).__name__}: {exc}", kind=type(exc).__name__,
         tb=traceback.format_exc(limit=8))
    raise SystemExit(0)
probe = body["probe"]
results = []
for entry in body["rewards"]:
    fn = entry["fn"]
    try:
        if entry["per_group"]:
            value = fn([probe["prompt"]], [probe["completion"]], [dict(probe["info"])])
        else:
            value = fn(probe["prompt"], probe["completion"], **dict(probe["info"]))
        if inspect.isawaitable(value):
            value = asyncio.run(value)
        results.append({"name": entry["name"], "ok": True, "value": repr(value)[:200]})
    except BaseException as exc:
        results.append({"name": entry["name"], "ok": False, "kind": type(exc).__name__,
                        "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc(limit=8)})
done(stage="call", results=results)
"""

TRAVEL_HINTS = {
    "ModuleNotFoundError": "a module it uses is importable only here (from the notebook's folder or "
    "this kernel's sys.path): import it at the top of a cell (not inside the function) so it "
    "travels by value, or install it where the job runs",
    "ImportError": "a module it uses is importable only here: import it at the top of a cell so it "
    "travels by value, or install it where the job runs",
    "NameError": "a name it uses is defined nowhere that travels: define it in the reward's cell (or "
    "pass the value through the prompts' info)",
    "FileNotFoundError": "a file it reads is not there in the job (which does not run in the notebook's "
    "folder): put the data in the prompts' info, rebuild it from a seed in the reward (as "
    "openrl_jupyter.sql.database_path does), or read it from an absolute path the job can see",
}


def _call_here(entry: dict, probe: dict) -> dict:
    """The proof's call, in this process (a thread of its own, prints captured, a time limit)."""
    from openrl_jupyter.rewards import _capture

    def call() -> Any:
        with _capture():
            fn = entry["fn"]
            if entry["per_group"]:
                value = fn([probe["prompt"]], [probe["completion"]], [dict(probe["info"])])
            else:
                value = fn(probe["prompt"], probe["completion"], **dict(probe["info"]))
            if asyncio.iscoroutine(value):
                value = asyncio.run(value)
            return value

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="openrl-proof")
    try:
        return {"ok": True, "value": repr(pool.submit(call).result(PROOF_TIMEOUT_S))[:200]}
    except concurrent.futures.TimeoutError:
        return {"ok": False, "kind": "TimeoutError", "error": f"no answer in {PROOF_TIMEOUT_S:g} s"}
    except Exception as exc:  # noqa: BLE001 - the user's reward
        return {"ok": False, "kind": type(exc).__name__, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        pool.shutdown(wait=False)


def prove(data: bytes, body: dict, what: str, where: str = "k8s") -> list[dict]:
    """Unpickle ``data`` in a clean Python and call its rewards on the probe; compare with the same
    calls here. Raises a UsageError when something works here but could not travel.

    The clean Python runs in a fresh temporary folder with none of the kernel's ``sys.path``; for
    ``where="k8s"`` it is isolated (``-I``: no PYTHONPATH, no user site-packages — a pod has none of
    them); for ``"local"`` it gets the environment the local worker gets (which keeps both)."""
    flags = ["-I"] if where != "local" else []
    with tempfile.TemporaryDirectory(prefix="openrl-proof-") as tmp:
        out = os.path.join(tmp, "result.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENRL_", "JUPYTERHUB_", "JPY_"))}
        try:
            proc = subprocess.run(
                [sys.executable, *flags, "-c", PROOF_CHILD, out],
                input=data,
                cwd=tmp,
                env=env,
                capture_output=True,
                timeout=PROOF_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise UsageError(
                f"{what}: proving the payload in a clean Python took more than {PROOF_TIMEOUT_S:g} s "
                "(the reward hangs on the first prompt?); nothing was submitted"
            ) from None
        try:
            with open(out, encoding="utf-8") as f:
                result = json.load(f)
        except (OSError, ValueError):
            tail = proc.stderr.decode("utf-8", "replace")[-1500:]
            raise UsageError(
                f"{what}: the clean Python that proves the payload exited with code {proc.returncode} "
                f"before answering; nothing was submitted:\n{tail}"
            ) from None
    if result["stage"] == "unpickle":
        hint = TRAVEL_HINTS.get(result["kind"], "it refers to something only this kernel has")
        raise UsageError(
            f"{what} cannot travel to a detached run: loading it in a clean Python failed with "
            f"{result['error']} — {hint}. Nothing was submitted."
        )
    report = []
    for entry, there in zip(body["rewards"], result["results"], strict=True):
        here = _call_here(entry, body["probe"])
        report.append({"name": entry["name"], "here": here, "there": there})
        if there["ok"]:
            continue
        if here["ok"] or here.get("kind") != there.get("kind"):
            hint = TRAVEL_HINTS.get(there["kind"], "it works in this kernel, not in a clean Python")
            raise UsageError(
                f"reward {entry['name']!r} cannot travel to a detached run: in a clean Python (as the "
                f"job runs it) it raised {there['error']}"
                + ("" if here["ok"] else f" (here: {here['error']})")
                + f" — {hint}. Nothing was submitted."
            )
    return report
