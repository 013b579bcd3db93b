"""bench/sweep.py --short runs end to end: a 6-run sweep and the same 6 runs one after another on one
embedded service, with the text-to-SQL execution reward, the JSON and the summary line.

Speed is never asserted here (CI machines are shared); the ratio is printed for the log.
"""

from __future__ import annotations

import re

import pytest

from tests._support.scripts import failure, short_mode

LINE = re.compile(r"^sweep: runs=6 ratio=\d+\.\d\d duty_sweep=\d+\.\d\d duty_seq=\d+\.\d\d$")


@pytest.mark.timeout(600)  # ~25 s on an idle 2-core machine
def test_sweep_bench_short_mode(tmp_path):
    proc, result = short_mode("sweep.py", tmp_path / "sweep.json", timeout_s=540)
    assert proc.returncode == 0, failure(proc)
    assert LINE.match(proc.stdout.strip().splitlines()[-1]), proc.stdout[-2000:]
    steps = result["args"]["steps"]
    by_mode = {r["mode"]: r for r in result["results"]}
    assert set(by_mode) == {"sweep", "sequential"}
    for mode, r in by_mode.items():
        # both modes did the same work: 6 runs x steps, every run finished, and training happened
        assert r["steps"] == 6 * steps, (mode, r)
        assert r["states"] == ["finished"], (mode, r)
        assert r["trained_steps"] > 0, (mode, r)
        assert 0 < r["duty"] <= 1.05, (mode, r)
        assert r["split"]["score"] is not None and r["split"]["score"] > 0, (mode, r)
    assert result["ratio"] > 0
