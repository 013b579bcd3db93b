"""What one big or long request costs everyone else: the service's peak memory for one /v1 call of many
long prompts at several OPENRL_SAMPLE_BATCH_BYTES, and how much a tenant sending 1 MB and 8 MB prompts
delays another tenant's small request.

Same service (`openrl-service serve`, the tiny model, on loopback) for each part, started fresh:

- memory: one ``/v1/completions`` call of ``--prompts`` prompts of ``--width`` tokens (max_tokens 1); the
  service's peak resident memory (VmHWM, reset just before) above what it held, and the wall time;
- latency: ``--reps`` times, alice's one-token completion alone, then the same while bob posts a prompt
  of 1 MB or 8 MB at the same moment (refused with a 413 before any encoding: it cannot fit the
  context), and while bob posts 200 prompts of 100 tokens (encoded and sampled: real work beside her).

Not a test: it prints a table. Speeds here are of a shared 2-core machine; run it idle.

    python bench/bounded_requests.py [--prompts 2048] [--width 160] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import httpx

KEY = "tml-bench-bounded-0123456789"
TINY = "openrl/tiny"


def status(pid: int, key: str) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) * 1024


def memory(prompts: int, width: int, budget_mib: int | None) -> tuple[float, float, int]:
    """(peak growth MiB, seconds, status) of one call on a fresh service with that budget."""
    from openrl_jupyter.local import start_service

    env = {"OMP_NUM_THREADS": "1"}
    if budget_mib is not None:
        env["OPENRL_SAMPLE_BATCH_BYTES"] = str(budget_mib << 20)
    svc = start_service(api_key=KEY, env=env)
    try:
        pid = svc.process.pid
        with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=3600) as http:
            http.post("/v1/completions", json={"model": TINY, "prompt": "warm", "max_tokens": 2})
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            before = status(pid, "VmRSS:")
            body = {
                "model": TINY,
                "prompt": [[(i * 7 + k) % 250 for k in range(width)] for i in range(prompts)],
            }
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json={**body, "max_tokens": 1})
            took = time.perf_counter() - t0
            return (status(pid, "VmHWM:") - before) / 2**20, took, r.status_code
    finally:
        svc.stop()


def latency(reps: int) -> dict[str, list[float]]:
    """alice's small request's seconds: alone, and with bob's request sent at the same moment."""
    from openrl_jupyter.local import start_service

    svc = start_service(api_key=KEY, env={"OMP_NUM_THREADS": "1"})
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        small = {"model": TINY, "prompt": "hi", "max_tokens": 1}
        loads = {
            "alone": None,
            "beside a 1 MB prompt": {"model": TINY, "prompt": "a" * (1 << 20), "max_tokens": 1},
            "beside an 8 MB prompt": {"model": TINY, "prompt": "a" * (8 << 20), "max_tokens": 1},
            "beside 200 x 100-token prompts": {
                "model": TINY,
                "prompt": ["word " * 20] * 200,
                "max_tokens": 4,
            },
        }
        out: dict[str, list[float]] = {}
        with httpx.Client(base_url=svc.url, headers=headers, timeout=600) as alice:
            alice.post("/v1/completions", json=small)
            for name, load in loads.items():
                times = []
                for _ in range(reps):
                    other = None
                    if load is not None:
                        other = threading.Thread(
                            target=lambda body=load: httpx.post(
                                svc.url + "/v1/completions", json=body, headers=headers, timeout=600
                            )
                        )
                        other.start()
                        time.sleep(0.005)  # bob's request is on its way first
                    t0 = time.perf_counter()
                    assert alice.post("/v1/completions", json=small).status_code == 200
                    times.append(time.perf_counter() - t0)
                    if other is not None:
                        other.join()
                out[name] = times
        return out
    finally:
        svc.stop()


def p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20)[-1] if len(xs) >= 2 else xs[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=2048)
    p.add_argument("--width", type=int, default=160)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()

    print(f"## one /v1/completions call of {a.prompts} prompts x {a.width} tokens (tiny model)\n")
    print("| OPENRL_SAMPLE_BATCH_BYTES | peak growth | wall | status |")
    print("|---|---|---|---|")
    for budget in (64, 128, 512, None):
        grown, took, code = memory(a.prompts, a.width, budget)
        label = f"{budget} MiB" if budget is not None else "default (1/8 of available RAM)"
        print(f"| {label} | {grown:.0f} MiB | {took:.1f} s | {code} |", flush=True)

    print(f"\n## alice's one-token completion, {a.reps} tries each\n")
    print("| beside | p50 | p95 | p95 - alone |")
    print("|---|---|---|---|")
    got = latency(a.reps)
    alone = p95(got["alone"])
    for name, xs in got.items():
        print(
            f"| {name} | {statistics.median(xs) * 1000:.0f} ms | {p95(xs) * 1000:.0f} ms | "
            f"{(p95(xs) - alone) * 1000:+.0f} ms |"
        )


if __name__ == "__main__":
    main()
