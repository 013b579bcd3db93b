"""bench/load.py --short: 16 Tinker SDK users × 5 steps against one service lose nothing and see no 5xx.

What a user would notice, read from the bench's JSON: every future a submit handed out got exactly
one result (counted on the wire, so the SDK's silent retries cannot hide a loss), no request was
answered 5xx, every op returned, each training run's optim_step counts read 1..5 in order, and a
fresh client is still served afterwards. The service, its data dir (every run the load created) and
the clients are gone when the script returns. Speed and memory are printed, never asserted.
"""

from __future__ import annotations

import re

import pytest

from tests._support.scripts import short_mode

LINE = re.compile(
    r"^load: clients=16 steps=5 ops=\d+ ops_per_s=[\d.]+ .* lost=0 duplicated=0 order_ok=True fresh_ok=True$"
)


@pytest.mark.timeout(600)  # ~50 s on an idle 2-core machine
def test_load_short_mode_loses_nothing(tmp_path):
    proc, result = short_mode("load.py", tmp_path / "load.json", timeout_s=540)
    f = result["futures"]

    assert result["kinds"] == {"sft": 6, "rl": 6, "sample": 4}
    # sft: 2 ops/step; rl: save + 2 samples + 2 ops; sample: 2 samples
    assert result["ops"] == 5 * (6 * 2 + 6 * 5 + 4 * 2)
    assert result["failed_ops"] == 0
    assert f["submitted"] >= result["ops"]  # plus the clients' create_model / create_session futures
    assert f["lost"] == 0, f["lost_ids"]
    assert f["duplicated"] == 0, f["duplicated_ids"]
    assert f["unknown"] == 0
    assert f["results"] == f["submitted"]
    assert f["http_5xx"] == 0, f["http_statuses"]
    assert len(result["runs"]) == 12
    for run in result["runs"]:
        assert run["steps"] == [1, 2, 3, 4, 5], run
    assert result["fresh_client_ok"]
    assert result["memory"]["peak_rss_mb"] > 0 and result["memory"]["samples"] > 0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert LINE.match(proc.stdout.strip().splitlines()[-1])
