"""Crash recovery: `kill -9` at five points, restart on the same data dir, and nothing acknowledged is lost.

Two clients train at once against a real `openrl-service serve` (fusion off, journal on): the
unmodified Tinker SDK running an SFT-then-RL loop (tests/_support/recovery_loop.py, a subprocess)
and a notebook ``Run`` (openrl_jupyter, in this process). The service is killed with SIGKILL five
times, each time by a crash hook at a different point (mid forward_backward, between a
forward_backward and its optim_step, mid sampling, right after an acknowledged reply, mid checkpoint
save); the hook writes a marker before it fires, so the test knows each point was reached, and each
restart on the same port and data dir arms the next one. Both clients ride through on their own
retries (the SDK's with more tries than its default ten: one request may span several restarts a
few seconds apart), and the Run starts once the SDK loop has its training client. Then: both loops finished, every run took exactly its number of optimizer steps, and the
final adapters are bit-identical to those of the same two loops against a service never killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from safetensors.numpy import load_file

from openrl_jupyter import session as sess
from openrl_jupyter.run import RunState
from openrl_service import crashpoints
from tests._support.serve import Served, finish, start, wait_ready
from tests.conftest import ALICE_KEY, free_port

HANG_GUARD_S = 300
ROOT = Path(__file__).resolve().parents[2]
# The order the loops reach them in: each restart arms the next (the n-th hit in that process).
CRASHES = [
    ("forward_backward", 3),
    ("before_optim_step", 3),
    ("sample", 4),
    ("after_ack", 6),  # early enough that both loops still have work on a slow machine
    ("checkpoint_save", 1),  # the SDK loop's final save_state comes whatever else happened
]
SDK_RL_STEPS = 6
RUN_STEPS = 6
ENV = {"OPENRL_API_KEYS": f"alice:{ALICE_KEY}", "OPENRL_FUSION": "off", "OPENRL_LONG_POLL_S": "2"}


def reward(prompt, completion, **info):
    """Deterministic and not constant within a group: every step trains."""
    return sum(c.isalpha() for c in completion) / max(1, len(completion))


class Clients:
    """The SDK loop (a subprocess) and a notebook Run (here), against ``url``."""

    def __init__(self, url: str, workdir: Path, name: str):
        self.out = workdir / "sdk.json"
        self.log = open(workdir / "sdk.log", "w")  # noqa: SIM115 - closed in finish()
        env = {**os.environ, "TINKER_API_KEY": ALICE_KEY, "TINKER_TELEMETRY": "0", "PYTHONPATH": str(ROOT)}
        self.sdk = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests/_support/recovery_loop.py"),
                url,
                str(self.out),
                "--rl",
                str(SDK_RL_STEPS),
                "--checkpoint-at",
                "2",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        # The Run starts once the SDK loop has its training client: the Run alone reaches the first
        # crash points within a second, and an SDK loop still starting would meet only restarts.
        deadline = time.monotonic() + HANG_GUARD_S
        try:
            while "ready " not in (workdir / "sdk.log").read_text():
                assert self.sdk.poll() is None, (workdir / "sdk.log").read_text()
                assert time.monotonic() < deadline, "the SDK loop did not create its training client"
                time.sleep(0.05)
        except BaseException:
            self.sdk.kill()
            self.log.close()
            raise
        self.name = name
        self.session = sess.connect(url, token=ALICE_KEY, name=name)
        self.run = self.session.train(
            reward=reward,
            prompts=["Name a colour:", "Say hello:", "Write a word:", "A city you like:"],
            steps=RUN_STEPS,
            batch=2,
            group=4,
            max_tokens=8,
            seed=11,
            overlap=0,
        )

    def running(self) -> bool:
        return self.sdk.poll() is None or not self.run.done

    def report(self) -> str:
        """Where both loops stand, for a failure message: the SDK's exit code and log, the Run's state."""
        self.log.flush()
        tail = (ROOT / self.log.name).read_text()[-3000:]
        return (
            f"SDK loop exit code {self.sdk.poll()}, Run {self.run.state} after {len(self.run.history)} steps"
            f" ({self.run!r}; stop reason: {self.run.stop_reason!r})\n--- SDK log (tail) ---\n{tail}"
        )

    def finish(self) -> dict:
        """Wait for both loops; what they trained: the SDK's output, the Run's history and run id."""
        try:
            assert self.sdk.wait(HANG_GUARD_S) == 0, (ROOT / self.log.name).read_text()
            self.run.wait(HANG_GUARD_S)
            assert self.run.state == RunState.FINISHED, (self.run.state, self.run.history)
            path = self.run.save("final")
            return {
                "sdk": json.loads(self.out.read_text()),
                "run_steps": [r["step"] for r in self.run.history],
                "run_trained": all(r["trained"] for r in self.run.history),
                "run_id": self.run.run_id,
                "run_server_step": self.session.client.get_run(self.run.run_id)["step"],
                "run_final": path,
            }
        finally:
            self.close()

    def close(self) -> None:
        """Stop what still runs (after a failure: no SDK loop outlives the test) and disconnect; once."""
        if self.log.closed:
            return
        if self.sdk.poll() is None:
            self.sdk.kill()
            self.sdk.wait(30)
        self.log.close()
        with contextlib.suppress(Exception):  # after a failure the service may be gone
            sess.disconnect(self.name)


def adapter(data_dir: Path, tinker_path: str) -> tuple[dict, dict]:
    """The tensors and the manifest of a saved ``weights`` checkpoint, from the data dir."""
    run_id, _, rest = tinker_path.removeprefix("tinker://").partition("/")
    folder = next(data_dir.glob(f"tenants/*/runs/{run_id.replace(':', '~')}/{rest}"))
    return load_file(folder / "adapter_model.safetensors"), json.loads((folder / "manifest.json").read_text())


def stand(clients: Clients, served: Served) -> str:
    """Where the loops and the service stand, for a failure message."""
    return (
        clients.report()
        + f"\n--- service (exit code {served.proc.poll()}), stderr tail ---\n{served.stderr[-6000:]}"
    )


def train(workdir: Path, tiny_model_dir: Path, crashes: list[tuple[str, int]]) -> tuple[dict, list[str]]:
    """Both loops against one service, killed at each of ``crashes`` in turn; returns their outcome
    and the points whose hooks fired."""
    data = workdir / "data"
    data.mkdir(parents=True)
    port = free_port()
    fired = []

    def serve(k: int) -> Served:
        env = dict(ENV)
        if k < len(crashes):
            point, nth = crashes[k]
            env |= {"OPENRL_CRASH_AT": f"{point}:{nth}", "OPENRL_CRASH_MARKER": str(workdir / f"crash-{k}")}
        return start(data, tiny_model_dir, env=env, port=port)

    served = serve(0)
    clients = None
    try:
        wait_ready(served)
        clients = Clients(served.url, workdir, name=f"recovery-{workdir.name}")
        for k, (point, _) in enumerate(crashes):
            marker = workdir / f"crash-{k}"
            deadline = time.monotonic() + HANG_GUARD_S
            while not marker.exists():
                where = f"the crash point {point!r} (fired so far: {fired})"
                assert clients.running(), f"both loops ended before {where}\n" + stand(clients, served)
                assert time.monotonic() < deadline, f"no {where} in {HANG_GUARD_S} s\n" + stand(
                    clients, served
                )
                time.sleep(0.05)
            assert finish(served, 30) == -9, served.stderr  # SIGKILL: no drain, no snapshot
            fired.append(marker.read_text())
            served = serve(k + 1)
        outcome = clients.finish()
        status = httpx.get(f"{served.url}/readyz", timeout=30).json()
        assert status["state"] == "ready", status
        outcome["data_dir"] = data
        return outcome, fired
    finally:
        if clients is not None:
            clients.close()
        if served.proc.poll() is None:
            served.proc.terminate()
            finish(served, 30)


@pytest.mark.slow
def test_kill_9_at_five_points_loses_nothing_and_the_adapters_match_an_uninterrupted_run(
    tmp_path, tiny_model_dir
):
    # spill_write and snapshot_write: tests/service/test_memory_turns.py (they need full runs taking turns)
    points = [p for p in crashpoints.POINTS if p not in ("spill_write", "snapshot_write")]
    assert [p for p, _ in CRASHES] == sorted(points, key=[p for p, _ in CRASHES].index)
    crashed, fired = train(tmp_path / "crashed", tiny_model_dir, CRASHES)
    assert fired == [p for p, _ in CRASHES]  # every hook fired, in turn: no point was skipped
    reference, _ = train(tmp_path / "reference", tiny_model_dir, [])

    # Both loops finished with exactly their steps: none lost, none applied twice.
    sft, rl = len(crashed["sdk"]["sft_losses"]), len(crashed["sdk"]["means"])
    assert (sft, rl) == (2, SDK_RL_STEPS)
    assert crashed["run_steps"] == list(range(1, RUN_STEPS + 1)) and crashed["run_trained"]
    assert crashed["run_server_step"] == RUN_STEPS
    sdk_weights, sdk_manifest = adapter(crashed["data_dir"], crashed["sdk"]["final_path"])
    run_weights, run_manifest = adapter(crashed["data_dir"], crashed["run_final"])
    assert sdk_manifest["steps"] == sft + rl and run_manifest["steps"] == RUN_STEPS

    # What the clients saw and what they trained equal the uninterrupted run's, bit for bit.
    assert crashed["sdk"]["sft_losses"] == reference["sdk"]["sft_losses"]
    assert crashed["sdk"]["means"] == reference["sdk"]["means"]
    for mine, theirs in [
        (sdk_weights, adapter(reference["data_dir"], reference["sdk"]["final_path"])[0]),
        (run_weights, adapter(reference["data_dir"], reference["run_final"])[0]),
    ]:
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert mine[name].tobytes() == theirs[name].tobytes(), name


def test_an_outage_longer_than_the_idle_timeout_reaps_no_session(tmp_path, tiny_model_dir):
    """Idle clocks restart with the service: clients that were waiting through the outage are not
    'idle', so their sessions and runs are still there. Housekeeping runs every 0.5 s here (a 2 s
    result TTL), so without the restart of the clocks the session, silent for longer than its 6 s
    timeout, would be finished by the rounds that run before the client speaks again."""
    from tests._support.raw import RawTinker, fb_body, sft_datum

    data, port = tmp_path / "data", free_port()
    data.mkdir()
    env = {
        "OPENRL_API_KEYS": f"alice:{ALICE_KEY}",
        "OPENRL_SESSION_IDLE_TIMEOUT_S": "6",
        "OPENRL_FUTURE_TTL_S": "2",  # housekeeping every 0.5 s
    }
    served = start(data, tiny_model_dir, env=env, port=port)
    wait_ready(served)
    with httpx.Client(base_url=served.url, headers={"X-API-Key": ALICE_KEY}, timeout=HANG_GUARD_S) as http:
        raw = RawTinker(http)
        session = raw.session()
        model_id = raw.create_model(session)
        r = http.post(
            "/api/v1/forward_backward",
            content=fb_body(model_id, 1, [sft_datum([10, 11, 12], [13, 14])]),
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert r.status_code == 200
        sampling = raw.session()  # a client that only samples: no run keeps its session busy
        r = raw.post(
            "create_sampling_session",
            session_id=sampling,
            sampling_session_seq_id=0,
            base_model="openrl/tiny",
        )
        assert r.status_code == 200, r.text
    served.proc.kill()
    assert finish(served, 30) == -9
    time.sleep(8)  # the outage itself: longer than the 6 s idle timeout
    served = start(data, tiny_model_dir, env=env, port=port)
    try:
        wait_ready(served)
        time.sleep(2)  # four housekeeping rounds while the client is still away (the scenario, not a wait)
        with httpx.Client(
            base_url=served.url, headers={"X-API-Key": ALICE_KEY}, timeout=HANG_GUARD_S
        ) as http:
            raw = RawTinker(http)
            for sid in (session, sampling):
                beat = raw.post("session_heartbeat", session_id=sid)
                assert (beat.status_code, beat.json()) == (200, {"type": "session_heartbeat"}), beat.text
            # The run is there, with the replayed forward_backward's gradient waiting for its step.
            assert raw.result(raw.submit_optim(model_id, 2))["metrics"]["grad_norm:mean"] > 0
    finally:
        served.proc.terminate()
        finish(served, 30)
