"""bench/fuzz.py --short: a fixed-seed fuzz of the live service answers no 5xx, reaches the core and
leaves the service serving the unmodified Tinker SDK.

What a user would notice, read from the script's JSON: no request was answered 5xx and no accepted
forward_backward failed on the server; sessions, runs, samplers, checkpoints and training were
reached (those operations answered 2xx, so generated requests got past validation into the engine,
as the schema's exact bodies and links let them); and afterwards the Tinker SDK conformance script
and a notebook-API round (create, sample, train_step, checkpoint) still pass.
"""

from __future__ import annotations

import re

import pytest

from tests._support.scripts import short_mode

LINE = re.compile(
    r"^fuzz: requests=\d+ ok_2xx=\d+ http_5xx=0 server_errors=0 ops_with_2xx=\d+/\d+ good_client=True wall_s=\d+$"
)
# Operations that create or use state; a 2xx on each means the fuzzer got past validation to the engine.
CORE = {
    "tinker_create_session",
    "tinker_create_model",
    "tinker_forward_backward",  # the protobuf bodies
    "tinker_retrieve_future",
    "native_create_run",
    "native_sample",
    "native_save",
    "native_add_metrics",
    "native_checkpoints",
    "rest_get_session",
    "rest_get_training_run",
}
MIN_OPERATIONS_WITH_2XX = 30  # of 60 (the hub mirror's 9 routes need the served model's name)


@pytest.mark.timeout(600)  # ~40 s on an idle 2-core machine
def test_fuzz_short_mode_finds_no_server_error_and_reaches_the_core(tmp_path):
    proc, result = short_mode("fuzz.py", tmp_path / "fuzz.json", timeout_s=540)

    fives = {op: c for op, c in result["operations"].items() if c.get("5xx")}
    assert result["http_5xx"] == 0, fives
    assert result["server_errors"] == 0, result["protobuf"]["futures"]
    assert result["service_tracebacks"] == 0
    reached = set(result["operations_with_2xx"])
    assert reached >= CORE, sorted(CORE - reached)
    assert len(reached) >= MIN_OPERATIONS_WITH_2XX, sorted(reached)
    assert result["protobuf"]["futures"].get("result", 0) >= 1  # a generated body trained
    assert result["requests"] >= 500
    g = result["good_client"]
    assert g["sdk_ok"], g["sdk_tail"]
    assert g["native_ok"], g["native_error"]
    assert result["alive_after"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert LINE.match(proc.stdout.strip().splitlines()[-1])
