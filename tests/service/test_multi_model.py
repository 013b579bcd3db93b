"""Several base models in one service: openrl/tiny and openrl/tiny-wide (hidden 192) served together
on loopback, driven with the unmodified Tinker SDK; each run, sampler and checkpoint stays on its own
model; a bad base_model, a memory budget too small and a restart without a model are refused."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from openrl_service.config import ModelEntry, Settings, parse_model_entry
from tests._support.raw import RawTinker, sft_datum
from tests.conftest import ALICE_KEY, BOB_KEY, LiveServer, free_port, start_server
from tests.jupyter.test_dashboard import sent  # noqa: F401 - the fixture: widgets' frontend messages
from tests.service.test_recovery import adapter
from tests.service.test_scheduling import held_worker

TINY, WIDE = "openrl/tiny", "openrl/tiny-wide"
BOTH = ["tiny", "tiny-wide"]
PROMPT = [72, 105, 33, 10, 65]  # "Hi!\nA": byte ids, the same in both tokenizers


@pytest.fixture(scope="module")
def both(tmp_path_factory, tiny_model_dir) -> LiveServer:
    """One service serving openrl/tiny (the default) and openrl/tiny-wide."""
    live = start_server(tmp_path_factory.mktemp("multi"), tiny_model_dir, models=BOTH)
    yield live
    live.stop()


@pytest.fixture
def sc(both):
    client = tinker.ServiceClient(base_url=both.url, api_key=ALICE_KEY)
    yield client
    client.close("success").result()


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def train_step(tc, tokens: list[int], lr: float = 1e-2):
    fb = tc.forward_backward([datum(tokens)], "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=lr))
    return fb.result(), opt.result()


def test_capabilities_and_readyz_list_every_model(both):
    caps = tinker.ServiceClient(base_url=both.url, api_key=ALICE_KEY).get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [TINY, WIDE]
    ready = httpx.get(f"{both.url}/readyz").json()
    assert ready["model"] == TINY  # the default: the first one
    assert [m["name"] for m in ready["models"]] == [TINY, WIDE]


def test_runs_on_both_models_interleaved_stay_on_their_model(both, sc):
    a = sc.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    b = sc.create_lora_training_client(base_model=WIDE, rank=4, seed=1).result()
    assert a.get_info().model_data.model_name == TINY
    assert b.get_info().model_data.model_name == WIDE
    # Interleaved: both runs' calls are in flight together.
    fa = a.forward_backward([datum(PROMPT + [66, 67])], "cross_entropy")
    fb = b.forward_backward([datum(PROMPT + [66, 67])], "cross_entropy")
    oa = a.optim_step(types.AdamParams(learning_rate=1e-2))
    ob = b.optim_step(types.AdamParams(learning_rate=1e-2))
    la, lb = fa.result().metrics["loss:sum"], fb.result().metrics["loss:sum"]
    oa.result(), ob.result()
    assert la != lb  # two different base models (same LoRA seed, same data)

    # Each checkpoint names its model, and its tensors have that model's shapes (hidden 128 vs 192).
    path_a, path_b = a.save_state("a1").result().path, b.save_state("b1").result().path
    (ta, ma), (tb, mb) = adapter(both.data_dir, path_a), adapter(both.data_dir, path_b)
    assert ma["base_model"] == TINY and mb["base_model"] == WIDE
    q_a = next(v for k, v in ta.items() if "q_proj.lora_A" in k)
    q_b = next(v for k, v in tb.items() if "q_proj.lora_A" in k)
    assert q_a.shape[1] == 128 and q_b.shape[1] == 192
    assert both.service.runs[b.model_id].base_model == WIDE

    # Isolation: training A leaves B bit-identical.
    for _ in range(2):
        train_step(a, PROMPT + [70, 71])
    path_a2, path_b2 = a.save_state("a2").result().path, b.save_state("b2").result().path
    ta2, tb2 = adapter(both.data_dir, path_a2)[0], adapter(both.data_dir, path_b2)[0]
    assert all(np.array_equal(tb[k], tb2[k]) for k in tb)
    assert not all(np.array_equal(ta[k], ta2[k]) for k in ta)

    # A training client restored from B's checkpoint is on B's model.
    b2 = sc.create_training_client_from_state(path_b)
    assert b2.get_info().model_data.model_name == WIDE


def test_a_sampler_of_the_second_model_samples_that_model(both, sc, tiny_model_dir):
    """Base-model samplers: each model's prompt logprobs are those of that model computed with
    stock transformers; a LoRA sampler of B matches B's training client."""
    from transformers import AutoModelForCausalLM

    seq = types.ModelInput.from_ints(PROMPT)
    for name, folder in ((TINY, "openrl-tiny"), (WIDE, "openrl-tiny-wide")):
        sampler = sc.create_sampling_client(base_model=name)
        got = sampler.compute_logprobs(seq).result()[1:]
        model = AutoModelForCausalLM.from_pretrained(both.data_dir / "models" / folder)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT])).logits[0].float()
        want = torch.log_softmax(logits, -1)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4, err_msg=name)

    b = sc.create_lora_training_client(base_model=WIDE, rank=4, seed=2).result()
    train_step(b, PROMPT + [80, 81])
    sampler = b.save_weights_and_get_sampling_client()
    assert sampler.get_base_model() == WIDE
    full = PROMPT + [80, 81]
    sampled = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:]
    trained = b.forward([datum(full)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    np.testing.assert_allclose(sampled, trained.to_numpy(), atol=1e-4)
    out = sampler.sample(seq, 2, types.SamplingParams(max_tokens=4, seed=5)).result()
    assert len(out.sequences) == 2 and all(len(s.tokens) <= 4 for s in out.sequences)


def test_an_unknown_base_model_is_refused_naming_the_field_and_the_served_models(both):
    with both.client() as http:
        raw = RawTinker(http)
        sid = raw.session()
        for route, body in (
            ("create_model", {"model_seq_id": 0, "lora_config": {"rank": 4}}),
            ("create_sampling_session", {"sampling_session_seq_id": 0}),
        ):
            r = raw.post(route, session_id=sid, base_model="openrl/nope", **body)
            assert r.status_code == 404, r.text
            err = r.json()
            assert err["field"] == "base_model", err
            assert "'openrl/nope' is not served" in err["error"] and f"'{TINY}', '{WIDE}'" in err["error"], (
                err
            )
        # Omitted: the default (first) model.
        r = raw.post("create_sampling_session", session_id=sid, sampling_session_seq_id=1)
        assert r.status_code == 200, r.text
        sampler_id = r.json()["sampling_session_id"]
        assert http.get(f"/api/v1/samplers/{sampler_id}").json()["base_model"] == TINY
        raw.finish_sessions()
    sc = tinker.ServiceClient(base_url=both.url, api_key=BOB_KEY)
    with pytest.raises(tinker.NotFoundError, match="base_model: model 'nope' is not served"):
        sc.create_lora_training_client(base_model="nope", rank=4).result()
    sc.close("success").result()


def test_fused_passes_join_ops_of_one_model_only(both):
    """Two runs on each model, their forward_backwards queued together: the worker fuses the
    runs of one model, never runs of the two models."""
    with both.client() as http:
        raw = RawTinker(http)
        sid = raw.session()
        runs = {}
        for k, name in enumerate([TINY, TINY, WIDE, WIDE]):
            r = raw.post(
                "create_model", session_id=sid, model_seq_id=k, base_model=name, lora_config={"rank": 4}
            )
            r.raise_for_status()
            raw.result(r.json()["request_id"])
            runs[r.json()["model_id"]] = name
        svc = both.service
        t0 = time.time()
        with held_worker(svc.engine, svc.futures):
            reqs = [raw.submit_fb(rid, 1, [sft_datum(PROMPT, [66, 67])]) for rid in runs]
        results = [raw.result(q) for q in reqs]
        assert all("error" not in res for res in results), results
        recs = [
            r
            for r in svc.recorder.wait_for(lambda rs: len(rs) >= 4, since=t0)
            if r.kind == "forward_backward"
        ]
        fused = {r.fused_id: set(r.fused_runs) for r in recs if r.fused_id is not None}
        assert fused, "nothing fused: the test would prove nothing"
        for members in fused.values():
            assert len({runs[m] for m in members}) == 1, members
        assert {runs[next(iter(m))] for m in fused.values()} == {TINY, WIDE}
        raw.finish_sessions()


def test_model_entries_parse_name_spec_and_device():
    assert parse_model_entry("tiny") == ModelEntry("tiny")
    assert parse_model_entry("w=tiny-wide@cpu") == ModelEntry("tiny-wide", "w", "cpu")
    assert parse_model_entry("q=/m/Qwen@2x@cuda:1") == ModelEntry("/m/Qwen@2x", "q", "cuda:1")
    assert parse_model_entry("/models/a@b") == ModelEntry("/models/a@b")  # "b" is no device
    s = Settings(models=["tiny", "tiny-wide@cpu"], device="cuda")
    assert s.model_entries() == [ModelEntry("tiny", None, "cuda"), ModelEntry("tiny-wide", None, "cpu")]
    assert Settings(model="tiny", model_name="mine").model_entries() == [ModelEntry("tiny", "mine")]
    with pytest.raises(ValueError, match="with several models write each as NAME=SPEC"):
        Settings(models=BOTH, model_name="x").model_entries()
    with pytest.raises(ValueError, match="must be SPEC or NAME=SPEC"):
        parse_model_entry("=tiny")


def test_cli_refuses_model_name_with_several_models(tmp_path, capsys):
    from openrl_service.cli import main

    code = main(
        ["serve", "--model", "tiny", "--model", "tiny-wide", "--model-name", "x", "--data-dir", str(tmp_path)]
    )
    assert code == 2
    assert "write each as NAME=SPEC" in capsys.readouterr().err


def start_in_thread(data_dir: Path, tiny_dir: Path, **overrides):
    """A service in this process that may fail to start: returns it and /readyz once it is ready or
    failed (conftest.start_server insists on ready)."""
    import shutil

    import uvicorn

    from openrl_service.app import create_app

    models = data_dir / "models" / "openrl-tiny"
    if not models.exists():
        shutil.copytree(tiny_dir, models)
    port = free_port()
    settings = Settings(data_dir=data_dir, port=port, api_keys={ALICE_KEY: "alice"}, **overrides)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", data_dir, app.state.service, server, thread)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            body = httpx.get(f"{live.url}/readyz", timeout=2).json()
            if body["state"] in ("ready", "failed"):
                return live, body
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    live.stop()
    raise RuntimeError("openrl-service neither became ready nor failed in 120 s")


def test_models_that_do_not_fit_the_memory_budget_are_refused_with_the_numbers(tmp_path, tiny_model_dir):
    """Each tiny model needs ~67-70 MiB with the allowance (64 MiB + a quarter of the weights): one
    fits a 100 MiB budget, both do not."""
    live, ready = start_in_thread(tmp_path / "d", tiny_model_dir, models=BOTH, memory_budget_bytes=100 << 20)
    try:
        assert ready["state"] == "failed", ready
        err = ready["error"]
        assert (
            "models need 13" in err and "MiB on cpu, 100.0 MiB budget (OPENRL_MEMORY_BUDGET_BYTES)" in err
        ), err
        assert "openrl/tiny 2.4 MiB weights" in err and "tiny-wide 5.3 MiB weights" in err, err
        with pytest.raises(Exception, match="failed to load"):
            live.service.require_ready()
    finally:
        live.stop()


def test_a_restart_without_a_model_refuses_its_runs_and_with_it_recovers_them(tmp_path, tiny_model_dir):
    """Safe over silent: a data dir holding a live run of openrl/tiny-wide does not start without that
    model (the run would be lost); serving it again brings the run back as it was."""
    data = tmp_path / "data"
    live, ready = start_in_thread(data, tiny_model_dir, models=BOTH)
    assert ready["state"] == "ready", ready
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    b = sc.create_lora_training_client(base_model=WIDE, rank=4, seed=3).result()
    train_step(b, PROMPT + [90, 91])
    before = b.save_state("before").result().path
    model_id = b.model_id
    live.stop()

    # Only openrl/tiny (and a budget that fits it alone): refused, naming the model and the run.
    live, ready = start_in_thread(data, tiny_model_dir, models=["tiny"], memory_budget_bytes=100 << 20)
    try:
        assert ready["state"] == "failed", ready
        assert "'openrl/tiny-wide' (e.g. " in ready["error"] and "It serves 'openrl/tiny'" in ready["error"]
    finally:
        live.stop()

    live, ready = start_in_thread(data, tiny_model_dir, models=BOTH)
    try:
        assert ready["state"] == "ready", ready
        run = live.service.runs[model_id]
        assert run.base_model == WIDE
        # ready once the journal's ops are queued again: the replayed ones run on the worker after
        engine = live.service.engine
        deadline = time.monotonic() + 60
        while engine.queue_depth() or engine.current is not None:
            assert time.monotonic() < deadline, "the replayed ops did not run"
            time.sleep(0.05)
        saved, now = adapter(data, before)[0], run.state.adapter.peft_state_dict()
        assert saved.keys() == now.keys() and all(
            np.array_equal(saved[k], now[k].detach().cpu().numpy()) for k in saved
        )
    finally:
        live.stop()


def test_single_model_service_is_unchanged(server):
    ready = httpx.get(f"{server.url}/readyz").json()
    assert ready["model"] == TINY and [m["name"] for m in ready["models"]] == [TINY]
    caps = server.client().get("/api/v1/get_server_capabilities").json()["supported_models"]
    assert [c["model_name"] for c in caps] == [TINY]


@pytest.mark.usefixtures("sent")
def test_a_notebook_session_picks_its_model_and_its_runs_use_it(both):
    """connect(model=...) picks the base model for the session's runs (and its defaults); the run
    is created on it and its dashboard header names it."""
    from openrl_jupyter import session as sess
    from openrl_jupyter.dashboard import RunDashboard
    from openrl_service.models.tiny import TINY_DEFAULTS

    with pytest.raises(
        sess.UsageError, match="model 'nope' is not served by .* it serves 'openrl/tiny', 'openrl/tiny-wide'"
    ):
        sess.connect(both.url, token=ALICE_KEY, name="nope", model="nope")
    default = sess.connect(both.url, token=ALICE_KEY, name="default-model")
    s = sess.connect(both.url, token=ALICE_KEY, name="wide", model="tiny-wide")
    try:
        assert default.model == TINY
        assert s.model == WIDE and s.defaults == TINY_DEFAULTS and set(s.served) == {TINY, WIDE}
        run = s.train(
            reward=lambda prompt, completion, **info: float(len(completion)),
            prompts=["Hi", "Yo"],
            steps=1,
            batch=1,
            group=2,
            max_tokens=4,
        )
        run.wait(timeout=120)
        assert run.model == WIDE and both.service.runs[run.run_id].base_model == WIDE
        assert s.client.get_run(run.run_id)["base_model"] == WIDE
        dash = RunDashboard(run)
        try:
            assert WIDE in dash.header.value
        finally:
            dash.close()
        with pytest.raises(sess.UsageError, match="model 'openrl/other' is not served"):
            s.train(reward=lambda prompt, completion, **info: 0.0, prompts=["x"], model="openrl/other")
    finally:
        sess.disconnect("wide")
        sess.disconnect("default-model")


def test_the_openai_endpoint_and_the_export_serve_each_model(both, sc, tmp_path):
    """A checkpoint of the second model: the endpoint samples it on that model (greedy tokens equal to
    its Tinker sampler's) and its merged export loads to its logprobs, recording that base's digest."""
    import json

    import openai
    from transformers import AutoModelForCausalLM

    from openrl_common.export import download_export

    b = sc.create_lora_training_client(base_model=WIDE, rank=4, seed=3).result()
    for _ in range(3):
        train_step(b, PROMPT + [80, 81, 82])
    path = b.save_weights_for_sampler("wide-oai").result().path
    sampler = sc.create_sampling_client(model_path=path)
    want = sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=6, temperature=0.0)
    ).result()
    client = openai.OpenAI(base_url=both.url + "/v1", api_key=ALICE_KEY, max_retries=0)
    got = client.completions.create(model=path, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.sequences[0].logprobs[:6], abs=1e-4)
    assert {m.id: getattr(m, "parent", None) for m in client.models.list()}[path] == WIDE

    info = download_export(path, tmp_path / "wide", merged=True, base_url=both.url, api_key=ALICE_KEY)
    assert info["base_model"] == WIDE
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "wide").eval()
    full = PROMPT + [80, 81]
    with torch.no_grad():
        logits = model(torch.tensor([full])).logits[0].float()
    mine = torch.log_softmax(logits, -1)[torch.arange(len(full) - 1), torch.tensor(full[1:])]
    theirs = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:]
    np.testing.assert_allclose(mine.numpy(), theirs, atol=1e-4)
    a = sc.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    tiny_path = a.save_weights_for_sampler("tiny-oai").result().path
    tiny_info = download_export(tiny_path, tmp_path / "tiny", base_url=both.url, api_key=ALICE_KEY)
    assert tiny_info["base_weights_sha256"] != info["base_weights_sha256"]
    assert (
        json.loads((tmp_path / "tiny" / "adapter_config.json").read_text())["base_model_name_or_path"] == TINY
    )
