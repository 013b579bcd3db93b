"""The text-to-SQL reward's cost per call: ``sql_reward`` on one RL step's worth of samples.

Method: ``generate(seed=0)``'s first 64 training questions (shop and school), each scored once per
round with a completion a model might write, cycling through four kinds: the gold query in a ```sql
fence (scores 1), a wrong query (``SELECT 1``), a malformed one (``SELEC name FROM customers``) and
prose with no SQL. A round is 64 ``sql_reward`` calls in one thread, as a run's scoring step makes
them; ``--threads N`` rounds run at once (N runs of a sweep scoring at the same time). The first call
is timed apart (it pays for whatever is set up once per process); the median and p90 of the other
calls' wall time per call are printed in ms, and the calls per second all threads made together.

    python bench/sql_reward.py [--calls 64] [--rounds 5] [--threads 1]

Not a test: compare two checkouts by running it with each on PYTHONPATH. Ends with one line
``sql_reward: calls=64 median_ms=… p90_ms=… first_ms=… calls_per_s=… threads=…``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not os.environ.get("PYTHONPATH"):  # a checkout on PYTHONPATH is the one measured, else this one
    sys.path.insert(0, str(ROOT))

import openrl_jupyter.sql as sql_module  # noqa: E402
from openrl_jupyter.sql import generate, sql_reward  # noqa: E402


def completions(examples: list[dict]) -> list[str]:
    kinds = [
        lambda e: f"```sql\n{e['sql']};\n```",
        lambda e: "SELECT 1",
        lambda e: "SELEC name FROM customers",
        lambda e: "I do not know the answer.",
    ]
    return [kinds[i % len(kinds)](e) for i, e in enumerate(examples)]


def one_round(examples: list[dict], texts: list[str]) -> list[float]:
    out = []
    for e, text in zip(examples, texts, strict=True):
        t = time.perf_counter()
        sql_reward("q", text, **e)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=64, help="sql_reward calls per round (one RL step)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="rounds scored at once, one thread each")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-sql-") as tmp:
        data = generate(0, directory=tmp)
        examples = [{**e, "db_path": str(data.db_path(e["db_id"]))} for e in data.train[: args.calls]]
        texts = completions(examples)
        times: list[float] = []
        # sql_reward prints each query's error: kept out of the table (one redirect for all threads)
        with (
            contextlib.redirect_stdout(io.StringIO()),
            concurrent.futures.ThreadPoolExecutor(args.threads) as pool,
        ):
            t = time.perf_counter()
            sql_reward("q", texts[0], **examples[0])
            first_ms = (time.perf_counter() - t) * 1000
            t = time.perf_counter()
            for _ in range(args.rounds):
                for f in [pool.submit(one_round, examples, texts) for _ in range(args.threads)]:
                    times.extend(f.result())
            wall_s = time.perf_counter() - t
    print(f"openrl_jupyter.sql from {Path(sql_module.__file__).parent}")
    ms = sorted(x * 1000 for x in times)
    median, p90 = statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]
    print(f"{len(ms)} calls ({args.rounds} rounds x {args.threads} thread(s) x {args.calls}): per call")
    print(
        f"  median {median:.3f} ms  p90 {p90:.3f} ms  first call {first_ms:.1f} ms  {len(ms) / wall_s:.0f} calls/s"
    )
    print(
        f"sql_reward: calls={args.calls} median_ms={median:.3f} p90_ms={p90:.3f} "
        f"first_ms={first_ms:.1f} calls_per_s={len(ms) / wall_s:.0f} threads={args.threads}"
    )


if __name__ == "__main__":
    main()
