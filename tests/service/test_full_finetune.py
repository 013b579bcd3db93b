"""Full fine-tuning (``rank=0``) through the unmodified Tinker SDK: a full run trains its own copy of the
model, saves and loads exactly, stays isolated from LoRA runs and from other full runs, takes turns
on a device with room for one, is refused with the numbers when it cannot fit at all, and its
checkpoints are Hugging Face folders that transformers loads."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from tests.conftest import ALICE_KEY, LiveServer, start_server

TEXT = [list(b"the cat sat on the mat. "), list(b"a dog ran in the sun! "), list(b"one two three four ")]
PROMPT = list(b"the ca")
SPEC = {"base_model": "openrl/tiny", "rank": 0, "seed": 0}


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def step(tc, k: int, lr: float = 3e-3) -> float:
    fb = tc.forward_backward([datum(TEXT[k % len(TEXT)])], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()
    return float(fb.result().metrics["loss:sum"])


def folder(live: LiveServer, tinker_path: str) -> Path:
    run_id, _, rest = tinker_path.removeprefix("tinker://").partition("/")
    return next(live.data_dir.glob(f"tenants/*/runs/{run_id.replace(':', '~')}/{rest}"))


def weights(live: LiveServer, tinker_path: str) -> dict[str, torch.Tensor]:
    return load_file(folder(live, tinker_path) / "model.safetensors")


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def solo(tmp_path_factory, tiny_model_dir) -> LiveServer:
    """Fusion off, no memory pressure: the reference every full run is compared with."""
    live = start_server(tmp_path_factory.mktemp("full-solo"), tiny_model_dir, fusion=False)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def busy(tmp_path_factory, tiny_model_dir) -> LiveServer:
    """Fusion on, and full runs' device share (OPENRL_FULL_RUN_BUDGET_BYTES) room for one run only."""
    one = footprint(tiny_model_dir)
    live = start_server(
        tmp_path_factory.mktemp("full-busy"),
        tiny_model_dir,
        fusion=True,
        full_run_budget_bytes=int(one * 1.5),
    )
    yield live
    live.stop()


def footprint(tiny_model_dir: Path) -> int:
    """Float32 weights + gradients + AdamW's two moments of every tiny-model parameter."""
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    return n * 4 * 4


def client(live: LiveServer) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)


def solo_run(live: LiveServer, steps: int, offset: int = 0) -> tuple[list[float], str]:
    sc = client(live)
    tc = sc.create_lora_training_client(**SPEC)
    losses = [step(tc, offset + k) for k in range(steps)]
    path = tc.save_state("end").result().path
    sc.close("success").result()
    return losses, path


def test_a_full_run_trains_every_weight_and_its_checkpoint_loads_in_transformers(solo):
    sc = client(solo)
    tc = sc.create_lora_training_client(**SPEC)
    info = tc.get_info()
    assert info.is_lora is False and not info.lora_rank
    base_sampler = sc.create_sampling_client(base_model="openrl/tiny")
    losses = [step(tc, 0, lr=1e-2) for _ in range(6)]
    assert losses[-1] < 0.7 * losses[0], losses
    path = tc.save_state("trained").result().path
    sampler = tc.save_weights_and_get_sampling_client()
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    tuned = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0].tokens
    base = base_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0].tokens
    assert tuned != base  # the run's own weights, not the base's
    # the base model others share is untouched: a fresh full run starts from it
    fresh = sc.create_lora_training_client(**SPEC)
    assert step(fresh, 0, lr=0.0) == pytest.approx(losses[0], rel=1e-6)

    # the checkpoint is a Hugging Face folder: transformers loads it and gives the service's logprobs
    from transformers import AutoModelForCausalLM

    ckpt = folder(solo, path)
    assert {"model.safetensors", "config.json"} <= {p.name for p in ckpt.iterdir()}
    tensors = weights(solo, path)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    sd = model.state_dict()
    assert all(torch.equal(tensors[n], sd[n]) for n in tensors)
    seq = TEXT[0]
    lp = sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result()[1:]
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1].float()
    mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)
    np.testing.assert_allclose(np.array(lp), mine.numpy(), atol=1e-4)
    # every kind of layer moved: attention, MLP, norms, the (tied) embedding
    base_sd = AutoModelForCausalLM.from_pretrained(
        Path(solo.data_dir) / "models" / "openrl-tiny"
    ).state_dict()
    moved = {n for n in tensors if not torch.equal(tensors[n], base_sd[n])}
    for part in ("self_attn.q_proj", "mlp.", "norm", "embed_tokens"):
        assert any(part in n for n in moved), (part, sorted(moved)[:8])
    sc.close("success").result()


def test_save_and_load_state_resume_a_full_run_bit_for_bit(solo):
    sc = client(solo)
    tc = sc.create_lora_training_client(**SPEC)
    for k in range(2):
        step(tc, k)
    mid = tc.save_state("mid").result().path
    after = [step(tc, k) for k in (2, 3)]
    end = tc.save_state("end").result().path

    resumed = sc.create_training_client_from_state_with_optimizer(mid)
    assert [step(resumed, k) for k in (2, 3)] == after
    assert_same(weights(solo, resumed.save_state("end").result().path), weights(solo, end))

    # load_state_with_optimizer into a run that went elsewhere: back to the same point
    other = sc.create_lora_training_client(**SPEC)
    step(other, 1, lr=5e-2)
    other.load_state_with_optimizer(mid).result()
    assert [step(other, k) for k in (2, 3)] == after
    # a full checkpoint cannot load into a LoRA run, nor a LoRA one into a full run
    lora = sc.create_lora_training_client(base_model="openrl/tiny", rank=4)
    with pytest.raises(Exception, match="full fine-tune"):
        lora.load_state(mid).result()
    sc.close("success").result()


def test_full_runs_beside_lora_runs_and_each_other_match_solo_runs_bit_for_bit(solo, busy):
    want_a, path_a = solo_run(solo, 3)
    want_b, path_b = solo_run(solo, 3, offset=1)
    sc = client(busy)
    a = sc.create_lora_training_client(**SPEC)
    b = sc.create_lora_training_client(**SPEC)
    loras = [sc.create_lora_training_client(base_model="openrl/tiny", rank=4, seed=s) for s in (1, 2)]
    got_a, got_b = [], []
    for k in range(3):  # every run's ops queued together: the LoRA runs fuse, the full runs take turns
        futures = [(a.forward_backward([datum(TEXT[k % 3])], "cross_entropy"), a)]
        futures.append((b.forward_backward([datum(TEXT[(k + 1) % 3])], "cross_entropy"), b))
        futures += [(t.forward_backward([datum(TEXT[2])], "cross_entropy"), t) for t in loras]
        steps = [t.optim_step(types.AdamParams(learning_rate=3e-3)) for _, t in futures]
        got_a.append(float(futures[0][0].result().metrics["loss:sum"]))
        got_b.append(float(futures[1][0].result().metrics["loss:sum"]))
        for s in steps:
            s.result()
        spilled = list((busy.data_dir / "spill").glob("*.safetensors"))  # the run waiting, on disk
        assert spilled and all(f.stat().st_mode & 0o777 == 0o600 for f in spilled)
        assert (busy.data_dir / "spill").stat().st_mode & 0o777 == 0o700
        # sampling a full run while the other holds the device
        sampler = a.save_weights_and_get_sampling_client()
        assert sampler.sample(
            types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=4)
        ).result()
    assert got_a == want_a and got_b == want_b
    assert_same(weights(busy, a.save_state("end").result().path), weights(solo, path_a))
    assert_same(weights(busy, b.save_state("end").result().path), weights(solo, path_b))
    # with room for one, they took turns: runs were moved off the device and back
    moves = busy.service.models["openrl/tiny"].trainer.residency.status()["moves"]
    assert moves["out_disk"] >= 2 and moves["in"] >= 2, moves
    metrics = busy.client(ALICE_KEY).get("/metrics").text
    assert 'openrl_full_run_moves_total{model="openrl/tiny",move="in"}' in metrics
    sc.close("success").result()
    assert not list((busy.data_dir / "spill").glob("*.safetensors"))  # a finished run leaves no spill


def test_a_full_run_too_big_for_the_device_is_refused_at_create_with_the_numbers(tmp_path, tiny_model_dir):
    live = start_server(tmp_path / "d", tiny_model_dir, full_run_budget_bytes=1 << 20)
    try:
        sc = client(live)
        with pytest.raises(
            Exception, match=r"needs 11\.\d MiB .* 1\.0 MiB .*OPENRL_FULL_RUN_BUDGET_BYTES"
        ) as e:
            sc.create_lora_training_client(**SPEC).get_info()  # the SDK raises once the client is used
        assert "lora_config.rank" in str(e.value)
        tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=4)  # LoRA runs are unaffected
        step(tc, 0)
        assert live.client().get("/readyz").status_code == 200
        sc.close("success").result()
    finally:
        live.stop()


def test_full_checkpoints_are_served_by_the_openai_endpoint_and_export_as_model_folders(solo, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.service.test_export import assert_close, export, hf_logprobs
    from tests.service.test_openai_api import oai, text_of, tinker_greedy

    sc = client(solo)
    tc = sc.create_lora_training_client(**SPEC)
    for _ in range(6):
        step(tc, 0, lr=1e-2)
    path = tc.save_weights_for_sampler("full-served").result().path
    sampler = sc.create_sampling_client(model_path=path)
    want = tinker_greedy(sampler, PROMPT, 8)
    got = oai(solo).completions.create(model=path, prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.choices[0].text == text_of(want)
    base = oai(solo).completions.create(model="openrl/tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert base.choices[0].text != got.choices[0].text

    # a PEFT export of a full run is refused, pointing to the full export
    peft = export(solo, path, tmp_path / "peft")
    assert peft.returncode != 0 and "full fine-tune" in peft.stderr and "merged" in peft.stderr
    assert not (tmp_path / "peft").exists()
    done = export(solo, path, tmp_path / "full", "--merged")
    assert done.returncode == 0, done.stderr
    info = json.loads((tmp_path / "full" / "openrl_export.json").read_text())
    assert info["lora"]["rank"] == 0 and info["format"] == "merged"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float32)
    seq = TEXT[0]
    assert_close(hf_logprobs(model, seq), sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result())
    sc.close("success").result()


def test_full_runs_taking_turns_resume_exactly_after_kill_9(solo, tmp_path, tiny_model_dir):
    """Two full runs on a device with room for one (so one waits on disk), the service killed with
    SIGKILL mid-way and restarted: both continue and end bit-identical to runs never interrupted."""
    from tests._support.serve import finish, start, wait_ready

    want_a, path_a = solo_run(solo, 4)
    want_b, path_b = solo_run(solo, 4, offset=1)
    env = {
        "OPENRL_API_KEYS": f"alice:{ALICE_KEY}",
        "OPENRL_FUSION": "off",
        "OPENRL_FULL_RUN_BUDGET_BYTES": str(int(footprint(tiny_model_dir) * 1.5)),
        "OPENRL_SNAPSHOT_INTERVAL_S": "0.5",  # journal snapshots read the run waiting on disk too
    }
    data = tmp_path / "d"
    data.mkdir()
    served = start(data, tiny_model_dir, env=env)
    try:
        wait_ready(served)
        sc = tinker.ServiceClient(base_url=served.url, api_key=ALICE_KEY)
        a = sc.create_lora_training_client(**SPEC)
        b = sc.create_lora_training_client(**SPEC)
        got_a, got_b = [], []
        for k in range(2):
            got_a.append(step(a, k))
            got_b.append(step(b, k + 1))
        # A snapshot is taken only when something was journaled since the last one, and the last
        # step's op moved the other run to disk after its records were written (when exactly is the
        # engine's business): journal one more request (a sampler on the base model) until a snapshot
        # sees one run on disk.
        assert wait_for_spill(data)

        def linked() -> bool:
            # the journal's snapshot holds both runs, a file each, while one waits on disk: a restart
            # restores them. (The waiting run's file is its spill file linked when a snapshot first
            # meets it on disk; when a snapshot had already written it, unchanged since, that file is
            # kept: engine/run_files.py. Which comes first is the engine's timing, so either holds.)
            spilled = list((data / "spill").glob("*.safetensors"))
            files = list((data / "journal").glob("run-*.tensors"))
            return bool(spilled) and len(files) == 2

        deadline = time.monotonic() + 60
        while not linked() and time.monotonic() < deadline:
            sc.create_sampling_client(base_model=SPEC["base_model"])
            time.sleep(0.6)  # past OPENRL_SNAPSHOT_INTERVAL_S
        assert linked(), sorted(p.name for p in (data / "journal").iterdir())
        served.proc.kill()
        served.proc.wait()
        served = start(data, tiny_model_dir, env=env, port=int(served.url.rsplit(":", 1)[1]))
        wait_ready(served)
        for k in range(2, 4):
            got_a.append(step(a, k))
            got_b.append(step(b, k + 1))
        assert got_a == want_a and got_b == want_b
        assert_same(weights_in(data, a.save_state("end").result().path), weights(solo, path_a))
        assert_same(weights_in(data, b.save_state("end").result().path), weights(solo, path_b))
        sc.close("success").result()
    finally:
        served.proc.terminate()
        finish(served)


def wait_for_spill(data_dir: Path, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if list((data_dir / "spill").glob("*.safetensors")):
            return True
        time.sleep(0.1)
    return False


def weights_in(data_dir: Path, tinker_path: str) -> dict[str, torch.Tensor]:
    run_id, _, rest = tinker_path.removeprefix("tinker://").partition("/")
    return load_file(
        next(data_dir.glob(f"tenants/*/runs/{run_id.replace(':', '~')}/{rest}")) / "model.safetensors"
    )


def test_runs_move_to_host_memory_first_then_to_disk_and_come_back_exactly(tmp_path, tiny_model_dir):
    """The Residency's order, in process: the least recently served run moves to the host share while
    it has room, the next one to disk; every run, brought back, continues bit for bit as if alone.
    (On a CPU device the host share is normally off, since host memory is the device's: turned on here
    so the order of moves is exercised without a GPU.)"""
    from openrl_service.models.loading import load_base_model
    from openrl_service.training.full import Residency
    from openrl_service.training.lora import LoraSpec
    from openrl_service.training.optim_params import AdamParams
    from openrl_service.training.trainer import DatumArrays, Trainer

    base = load_base_model(str(tiny_model_dir), data_dir=tmp_path)
    seq = np.array(TEXT[0], dtype=np.int64)
    data = [DatumArrays(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(len(seq) - 1, np.float32)})]
    one = Trainer(base).footprint(LoraSpec(rank=0))
    res = Residency(
        base.device,
        budget_bytes=int(one * 1.5),
        host_bytes=int(one * 1.5),
        spill_dir=tmp_path / "spill",
        host_tier_on_cpu=True,
    )
    shared, alone = Trainer(base, residency=res), Trainer(base)

    def step_(trainer, st, lr):
        trainer.forward_backward(st, data, "cross_entropy", {}, forward_only=False)
        trainer.optim_step(st, AdamParams(learning_rate=lr))

    lrs = [1e-3, 2e-3, 3e-3]
    runs = [shared.new_state(LoraSpec(rank=0), 0) for _ in lrs]
    for _ in range(2):
        for st, lr in zip(runs, lrs, strict=True):
            step_(shared, st, lr)
    where = [res.where[id(st.adapter)] for st in runs]
    assert where == ["disk", "host", "device"], where  # least recently served is furthest away
    assert res.moves["out_host"] >= 1 and res.moves["out_disk"] >= 1
    for st, lr in zip(runs, lrs, strict=True):
        ref = alone.new_state(LoraSpec(rank=0), 0)
        for _ in range(2):
            step_(alone, ref, lr)
        got = st.adapter.state_dict()  # brings it back
        assert_same(got, ref.adapter.state_dict())
        assert_same(Trainer.optimizer_tensors(st), Trainer.optimizer_tensors(ref))


def test_a_run_moved_to_disk_keeps_no_mapping_of_the_file_it_was_read_from(tmp_path, tiny_model_dir):
    """A run brought back from disk computes on a mapping of its spill file, and the pages its steps
    write become the process's own. Moved off again, it must let go of that mapping: a kept step count
    (a view of the same mapping) once held a 180M run's written pages, gigabytes, after it had gone to
    disk, until the container was OOM-killed (bench/scale.py)."""
    from openrl_service.models.loading import load_base_model
    from openrl_service.training.full import Residency
    from openrl_service.training.lora import LoraSpec
    from openrl_service.training.optim_params import AdamParams
    from openrl_service.training.trainer import DatumArrays, Trainer

    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("reads /proc/self/maps (Linux)")
    base = load_base_model(str(tiny_model_dir), data_dir=tmp_path)
    seq = np.array(TEXT[0], dtype=np.int64)
    data = [DatumArrays(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(len(seq) - 1, np.float32)})]
    one = Trainer(base).footprint(LoraSpec(rank=0))
    spill = tmp_path / "spill"
    res = Residency(base.device, budget_bytes=int(one * 1.5), host_bytes=0, spill_dir=spill)
    trainer = Trainer(base, residency=res)
    a, b = (trainer.new_state(LoraSpec(rank=0), 0) for _ in range(2))

    def mapped() -> set[str]:
        return {
            line.split(maxsplit=5)[5].removesuffix(" (deleted)")
            for line in maps.read_text().splitlines()
            if str(spill) in line
        }

    for st in (a, b, a, b, a):  # each step brings one run in from disk and sends the other out
        trainer.forward_backward(st, data, "cross_entropy", {}, forward_only=False)
        trainer.optim_step(st, AdamParams(learning_rate=1e-3))
        assert res.where[id(st.adapter)] == "device"
        other = b if st is a else a
        assert res.where[id(other.adapter)] == "disk"
        assert mapped() <= {str(res._spill_path(id(st.adapter)))}, mapped()  # only the resident run's


def test_a_run_moved_off_between_a_calls_slices_gets_its_gradient_back_exactly(tmp_path, tiny_model_dir):
    """A call cut into slices (other runs' ops run between them) sets the run's earlier gradient aside;
    if another full run's op moved this one to disk meanwhile, the gradient comes back when the call
    ends: the step equals one taken alone."""
    from openrl_service.models.loading import load_base_model
    from openrl_service.training.full import Residency
    from openrl_service.training.lora import LoraSpec
    from openrl_service.training.optim_params import AdamParams
    from openrl_service.training.trainer import DatumArrays, Trainer, accumulating_grads

    base = load_base_model(str(tiny_model_dir), data_dir=tmp_path)
    seqs = [np.array(t, dtype=np.int64) for t in TEXT]
    data = [
        [DatumArrays(s[:-1], {"target_tokens": s[1:], "weights": np.ones(len(s) - 1, np.float32)})]
        for s in seqs
    ]
    one = Trainer(base).footprint(LoraSpec(rank=0))
    res = Residency(base.device, budget_bytes=int(one * 1.5), host_bytes=0, spill_dir=tmp_path / "spill")
    shared, alone = Trainer(base, residency=res), Trainer(base)

    def fb(trainer, st, k):
        trainer.forward_backward(st, data[k], "cross_entropy", {}, forward_only=False)

    mine, other = (shared.new_state(LoraSpec(rank=0), 0) for _ in range(2))
    fb(shared, mine, 0)  # an earlier call's gradient, pending
    with accumulating_grads([mine]):  # a sliced call: its first slice, then another run's op
        fb(shared, mine, 1)
        fb(shared, other, 2)
        assert res.where[id(mine.adapter)] == "disk"
    shared.optim_step(mine, AdamParams(learning_rate=1e-3))

    ref = alone.new_state(LoraSpec(rank=0), 0)
    fb(alone, ref, 0)
    with accumulating_grads([ref]):
        fb(alone, ref, 1)
    alone.optim_step(ref, AdamParams(learning_rate=1e-3))
    assert_same(mine.adapter.state_dict(), ref.adapter.state_dict())
    assert mine.pending_backward == 0 and ref.pending_backward == 0


def test_a_full_run_whose_session_finishes_while_it_is_made_leaves_nothing_behind(tmp_path, tiny_model_dir):
    """The session of a full run is finished while the worker is still making its copy of the model:
    the copy is not kept (no device share, no spill file), and the tenant's full-run quota is free."""
    import shutil
    import threading

    from openrl_service.config import Limits, Settings
    from openrl_service.engine.service import TrainingService
    from tests._support.raw import RawTinker
    from tests.conftest import free_port
    from tests.service.test_shutdown import in_thread, wait_for

    shutil.copytree(tiny_model_dir, tmp_path / "models" / "openrl-tiny")
    settings = Settings(
        data_dir=tmp_path, port=free_port(), no_auth=True, limits=Limits(max_full_runs_per_tenant=1)
    )
    svc = TrainingService(settings)
    with in_thread(settings, svc) as (_, http):
        wait_for(lambda: http.get("/readyz").json()["state"] == "ready", "ready")
        trainer = svc.models["openrl/tiny"].trainer
        made, go = threading.Event(), threading.Event()
        new_state = trainer.new_state

        def slow(spec, seed):  # the copy is made; the session finishes before the op ends
            state = new_state(spec, seed)
            made.set()
            go.wait(60)
            return state

        trainer.new_state = slow
        raw = RawTinker(http)
        sid = raw.session()
        r = raw.post(
            "create_model", session_id=sid, model_seq_id=0, base_model="openrl/tiny", lora_config={"rank": 0}
        )
        assert r.status_code == 200, r.text
        assert made.wait(60)
        assert trainer.residency.runs  # the copy exists, on the device
        raw.finish_sessions()
        go.set()
        raw.result(r.json()["request_id"])
        wait_for(lambda: not trainer.residency.runs, "the copy to be dropped", 30)
        trainer.new_state = new_state
        again = raw.session()  # the quota of one full run is free again
        raw.create_model(again, rank=0)
        assert len(trainer.residency.runs) == 1
        raw.finish_sessions()
