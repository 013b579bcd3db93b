"""Write a data dir as a crash leaves it, for the journal's migration and upgrade tests.

    python -m tests._support.datadir_fixture OUT_DIR

Starts a service (tiny model, journal on, fusion off, no automatic snapshots), and through the Tinker
API and a notebook ``Run``: trains a LoRA run two steps, saves its state and a sampler snapshot,
makes a base-model sampler, trains a notebook run two steps; then takes one snapshot; then, after
it, trains the LoRA run one more step, creates one session and finishes another. It copies the data
dir as it is (what ``kill -9`` leaves: a snapshot and the journal after it), without the lock and the
base model, into OUT_DIR, and writes OUT_DIR/expected.json: the ids a recovery must bring back, the
run's adapter digest at the crash, and the loss of the next forward_backward (computed by the service
that wrote the data dir, after the copy), which a recovered service must match bit for bit.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

from tests._support.raw import RawTinker, sft_datum

DATUMS = [sft_datum(list(range(10, 40)), list(range(40, 56))), sft_datum([5, 6, 7, 8], [9, 10, 11, 12])]
NEXT = [sft_datum(list(range(60, 80)), list(range(80, 90)))]
LR = 1e-2
SKIP = ("openrl-service.lock", "models", "stderr.log")


def adapter_digest(svc, model_id: str) -> str:
    """sha256 of a live run's adapter tensors, in module order (bit-exact comparison)."""
    h = hashlib.sha256()
    weights = svc.runs[model_id].state.adapter.weights
    for name in sorted(weights):
        for t in weights[name]:
            h.update(name.encode())
            h.update(t.detach().to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()


def loss_of(raw: RawTinker, model_id: str, seq_id: int) -> float:
    result = raw.result(raw.submit_fb(model_id, seq_id, NEXT))
    return result["metrics"]["loss:sum"]


def train_step(raw: RawTinker, model_id: str, seq: int) -> int:
    raw.result(raw.submit_fb(model_id, seq, DATUMS))
    raw.result(raw.submit_optim(model_id, seq + 1, lr=LR))
    return seq + 2


def reward(prompt, completion, **info):
    return sum(c.isalpha() for c in completion) / max(1, len(completion))


def write(out: Path, tiny_model_dir: Path) -> dict:
    from openrl_jupyter import session as nb
    from tests.conftest import ALICE_KEY, start_server

    work = Path(tempfile.mkdtemp(prefix="datadir-fixture-"))
    live = start_server(work / "data", tiny_model_dir, snapshot_interval_s=0, fusion=False, torch_threads=1)
    svc = live.service
    try:
        with live.client() as http:
            raw = RawTinker(http)
            main = raw.session()
            model_id = raw.create_model(main, rank=4, seed=7)
            seq = train_step(raw, model_id, 1)
            seq = train_step(raw, model_id, seq)
            saved = raw.result(
                raw.post("save_weights", model_id=model_id, seq_id=seq, path="fixture-state").json()[
                    "request_id"
                ]
            )["path"]
            seq += 1
            snap = raw.result(
                raw.post(
                    "save_weights_for_sampler", model_id=model_id, seq_id=seq, sampling_session_seq_id=1
                ).json()["request_id"]
            )["sampling_session_id"]
            seq += 1
            base_sampler = raw.post(
                "create_sampling_session",
                session_id=main,
                sampling_session_seq_id=2,
                base_model="openrl/tiny",
            ).json()["sampling_session_id"]
            finished = raw.session()

            name = "fixture-notebook"
            nb_session = nb.connect(live.url, token=ALICE_KEY, name=name)
            try:
                run = nb_session.train(
                    reward=reward, prompts=["Say hello:", "A word:"], steps=2, batch=2, group=2,
                    max_tokens=6, seed=3, overlap=0, rank=2,
                )  # fmt: skip
                run.wait(300)
                notebook_run = {"run_id": run.run_id, "steps": len(run.history)}
            finally:
                nb.disconnect(name)

            taken = asyncio.run_coroutine_threadsafe(svc.durability.snapshot("fixture"), svc.futures.loop)
            assert taken.result(120), "the snapshot was not taken"

            seq = train_step(raw, model_id, seq)  # after the snapshot: journal records only
            later = raw.session()
            assert http.post(f"/api/v1/sessions/{finished}/finish", json={}).status_code == 200

            out.mkdir(parents=True, exist_ok=True)
            shutil.copytree(live.data_dir, out / "data", ignore=shutil.ignore_patterns(*SKIP))  # the crash
            expected = {
                "tenant_key": ALICE_KEY,
                "base_model": "openrl/tiny",
                "model_id": model_id,
                "next_seq_id": seq,
                "adapter_sha256": adapter_digest(svc, model_id),
                "next_loss": loss_of(raw, model_id, seq),
                "live_sessions": sorted([main, later]),
                "finished_sessions": [finished],
                "samplers": sorted([snap, base_sampler]),
                "checkpoint": saved,
                "notebook_run": notebook_run,
            }
        (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
        return expected
    finally:
        live.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    from openrl_service.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(write(Path(sys.argv[1]), build_tiny_model(Path(tmp) / "openrl-tiny")), indent=1))
