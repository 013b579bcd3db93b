"""`make demo`: serve the tiny model on loopback, run RL through the Tinker SDK, report the reward change.

It starts `openrl-service serve` as a child process on a free port with a fresh data folder
(``openrl_jupyter.local.start_service``; the service generates its own API key), trains the letter-fraction task of tinker_rl_letters.py for a
few dozen steps, prints ``demo: mean reward A -> B over N steps``, stops the service, and exits
non-zero unless the reward rose by at least 0.1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tinker_rl_letters import run  # noqa: E402

from openrl_jupyter.local import start_service  # noqa: E402

MIN_GAIN = 0.1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="openrl-demo-") as data:
        print("demo: starting openrl-service serve (the tiny model, a key of its own)", flush=True)
        service = start_service(data_dir=data, timeout_s=180)
        try:
            os.environ["TINKER_API_KEY"] = service.key
            os.environ.setdefault("TINKER_TELEMETRY", "0")
            print(
                f"demo: service ready at {service.url}; training openrl/tiny for {args.steps} steps",
                flush=True,
            )
            means = run(service.url, steps=args.steps, seed=args.seed)
        except BaseException:
            print(service.log_tail(), file=sys.stderr)
            raise
        finally:
            service.stop()
    k = min(5, len(means))
    a, b = statistics.fmean(means[:k]), statistics.fmean(means[-k:])
    print(f"demo: mean reward {a:.2f} -> {b:.2f} over {len(means)} steps")
    if b - a < MIN_GAIN:
        print(f"demo: FAILED: the reward rose by {b - a:.2f} (< {MIN_GAIN})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
