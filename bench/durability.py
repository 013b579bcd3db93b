"""What the recovery journal costs, and how fast a killed service is back.

1. **Overhead**: one RL step through the Tinker SDK (snapshot the weights, sample 8 prompts × 8
   completions of ``--tokens`` tokens, one importance-sampling forward/backward on the 64
   sequences, one AdamW step) against a service with ``--durability none``, with the journal as
   shipped (snapshots every 30 s), and with a snapshot after every step (the worst case). The
   target: the journal slows the 64 × 256-token step by ≤ 5 %.
2. **Restart**: the journaled service is killed with SIGKILL and started again on the same data dir:
   seconds until ``/readyz`` answers ready (process start, model load, snapshot restore, replay),
   the records replayed, the snapshot and journal sizes. The Tinker SDK retries a training request
   for about a minute and keeps polling a future through connection errors; a restart within that
   window is invisible to an SDK loop except as a pause.

Not a test: prints tables.

    python bench/durability.py [--tokens 256] [--steps 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from api_overhead import sdk_steps  # noqa: E402

from openrl_jupyter.local import start_service  # noqa: E402


def folder_bytes(path: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in path.glob(pattern))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-bench")
    os.environ.setdefault("TINKER_TELEMETRY", "0")

    variants = [
        ("none", {"OPENRL_DURABILITY": "none"}),
        ("journal (default)", {"OPENRL_DURABILITY": "journal"}),
        ("journal, snapshot/1 s", {"OPENRL_DURABILITY": "journal", "OPENRL_SNAPSHOT_INTERVAL_S": "1"}),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    restart = None
    for round_ in range(args.rounds):  # variants in turn, so a drifting machine load hits each alike
        for name, env in variants:
            with tempfile.TemporaryDirectory(prefix="openrl-durability-") as data:
                service = start_service(data_dir=data, auth=False, env=env, timeout_s=300)
                try:
                    times[name] += sdk_steps(service.url, args.tokens, args.steps)
                    if name == "journal, snapshot/1 s" and round_ == args.rounds - 1:
                        restart = measure_restart(service, Path(data))
                finally:
                    service.stop()
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["none"]
    print(
        f"one RL step, openrl/tiny, 64 sequences x {args.tokens} sampled tokens, SDK over HTTP, "
        f"median of {args.rounds} x {args.steps} steps (s/step)"
    )
    print(f"{'durability':>24} {'s/step':>8} {'vs none':>8}")
    for name, m in medians.items():
        print(f"{name:>24} {m:>8.3f} {100 * (m / base - 1):>7.1f}%")
    if restart:
        print()
        print("kill -9, then serve again on the same data dir (tiny model, CPU)")
        for k, v in restart.items():
            print(f"{k:>36} {v}")


def measure_restart(service, data: Path) -> dict:
    """SIGKILL the service, start it again on ``data``; seconds to ready and what it replayed."""
    journal = data / "journal"
    sizes = {
        "snapshot bytes": folder_bytes(journal, "snap-*.bin"),
        "journal bytes since it": folder_bytes(journal, "seg-*.log"),
    }
    os.kill(service.process.pid, signal.SIGKILL)
    service.process.wait()
    t0 = time.perf_counter()
    again = start_service(data_dir=data, auth=False, timeout_s=300)
    ready_s = time.perf_counter() - t0
    try:
        log = (data / "service.log").read_text()
        recovered = [line for line in log.splitlines() if "recovered:" in line]
        httpx.get(f"{again.url}/readyz", timeout=10).raise_for_status()
    finally:
        again.stop()
    return {
        **sizes,
        "process start to /readyz ready (s)": f"{ready_s:.2f}",
        "recovery": recovered[-1].split("recovered: ", 1)[1] if recovered else "(nothing to recover)",
    }


if __name__ == "__main__":
    main()
