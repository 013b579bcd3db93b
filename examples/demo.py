"""`make demo`: serve the tiny model on loopback, run RL through the Tinker SDK, report the reward change.

It starts `openrl-service serve` as a child process on a free port with a fresh data folder (so the
service generates its own API key), trains the letter-fraction task of tinker_rl_letters.py for a
few dozen steps, prints ``demo: mean reward A -> B over N steps``, stops the service, and exits
non-zero unless the reward rose by at least 0.1.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tinker_rl_letters import run  # noqa: E402

MIN_GAIN = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"demo: the service exited early (code {proc.returncode})")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"demo: the service was not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="openrl-demo-") as data:
        log_path = Path(data) / "service.log"
        with open(log_path, "w") as log:
            cmd = [
                sys.executable,
                "-m",
                "openrl_service.cli",
                "serve",
                "--port",
                str(port),
                "--data-dir",
                data,
            ]
            print(f"demo: starting {' '.join(cmd[2:])}", flush=True)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_ready(url, proc)
                key = (Path(data) / "api-key").read_text().strip()
                os.environ["TINKER_API_KEY"] = key
                os.environ.setdefault("TINKER_TELEMETRY", "0")
                print(
                    f"demo: service ready at {url}; training openrl/tiny for {args.steps} steps", flush=True
                )
                means = run(url, steps=args.steps, seed=args.seed)
            except BaseException:
                stop(proc)
                print(log_path.read_text()[-4000:], file=sys.stderr)
                raise
            stop(proc)
    k = min(5, len(means))
    a, b = statistics.fmean(means[:k]), statistics.fmean(means[-k:])
    print(f"demo: mean reward {a:.2f} -> {b:.2f} over {len(means)} steps")
    if b - a < MIN_GAIN:
        print(f"demo: FAILED: the reward rose by {b - a:.2f} (< {MIN_GAIN})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
