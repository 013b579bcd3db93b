"""bench/packing.py --short runs end to end: a service, concurrent client processes, the JSON and the line.

Speed is never asserted here (CI machines are shared); the numbers are printed for the log.
"""

from __future__ import annotations

import re

import pytest

from tests._support.scripts import failure, short_mode

LINE = re.compile(
    r"^packing: runs=\d+ duty=\d+\.\d\d speedup=\d+\.\d\d bound=\d+\.\d\d slowdown=\d+\.\d\d "
    r"fairness=\d+\.\d\d fused=\d+\.\d$"
)
ROW_KEYS = {"n", "duty", "steps_per_s", "tokens_per_s", "speedup", "tokens_speedup", "bound", "slowdown"}
ROW_KEYS |= {"fairness", "batching_gain", "window_s", "runs"}


@pytest.mark.timeout(900)  # ~1 min on an idle 2-core machine; CI machines may be shared
def test_packing_bench_short_mode(tmp_path):
    proc, result = short_mode("packing.py", tmp_path / "packing.json", timeout_s=840)
    assert proc.returncode == 0, failure(proc)
    last = proc.stdout.strip().splitlines()[-1]
    assert LINE.match(last), last

    assert set(result["by_n"]) == {"1", "3"}
    for n, row in result["by_n"].items():
        assert set(row) >= ROW_KEYS, (n, sorted(ROW_KEYS - set(row)))
        assert len(row["runs"]) == int(n)
        params = result["params"]
        assert all(r["steps"] == params["steps"] for r in row["runs"])
        assert all(r["measured_steps"] == params["steps"] - params["ramp"] for r in row["runs"])
    seq = result["sequential"]
    assert seq["sequential"] and set(seq) >= ROW_KEYS and len(seq["runs"]) == 3
    assert result["headline"]["runs"] == 3
    assert {"speedup", "per_run_s", "fused_s"} <= set(result["fused"])
    assert {"cpu_count", "torch_threads"} <= set(result["machine"])
    assert result["params"]["reward_s"] > 0
