"""Using what you trained from the notebook: `%openrl chat` (a reply, a continued conversation, the chat
box) and `%openrl export` / `run.export`, through a real IPython shell against the real service."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import tinker
from tinker import types

from openrl_jupyter import session as sess
from openrl_jupyter.rewards import registry
from tests._support.runs import PROMPTS, SMALL, letters
from tests.conftest import ALICE_KEY, TINY
from tests.jupyter import test_magics
from tests.jupyter.test_magics import connect, one_error_line, run
from tests.jupyter.test_run import unique

PROMPT = list(b"Once upon a time")
shell, clean = test_magics.shell, test_magics.clean  # that module's IPython shell and clean-up fixtures


@pytest.fixture(scope="module")
def ckpt(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=2).result()
    seq = PROMPT + list(b" ab ab ab ab ab ab")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * (len(PROMPT) - 1) + [1.0] * 18},
    )
    for _ in range(20):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    yield tc.save_weights_for_sampler("chat").result().path
    sc.close("success").result()


def direct_chat(server, model: str, messages: list[dict], max_tokens: int) -> str:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {ALICE_KEY}"},
        json={"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
        timeout=60,
    )
    return r.json()["choices"][0]["message"]["content"]


def test_chat_prints_the_reply_and_continues_the_conversation(shell, server, ckpt, monkeypatch):
    connect(shell, server, monkeypatch)
    first = run(shell, f"%openrl chat {ckpt} Once upon a time --max-tokens 6")
    assert first.ok, first.text
    want = direct_chat(server, ckpt, [{"role": "user", "content": "Once upon a time"}], 6)
    assert first.out.strip() == want.strip()
    second = run(shell, f"%openrl chat {ckpt} and then --max-tokens 6")
    assert second.ok, second.text
    history = [
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": want},
        {"role": "user", "content": "and then"},
    ]
    assert second.out.strip() == direct_chat(server, ckpt, history, 6).strip()
    fresh = run(shell, f"%openrl chat {ckpt} Once upon a time --max-tokens 6 --new")
    assert fresh.out == first.out


def test_the_chat_box_answers_without_holding_the_kernel(shell, server, ckpt, monkeypatch):
    connect(shell, server, monkeypatch)
    box = shell.run_cell(f"%openrl chat {ckpt} --max-tokens 5", store_history=False).result
    assert type(box).__name__ == "ChatBox"
    box.submit("hello")
    deadline = time.monotonic() + 60
    while not box.turns and time.monotonic() < deadline:
        time.sleep(0.05)
    ((question, answer),) = box.turns
    assert question == "hello"
    assert answer == direct_chat(server, ckpt, [{"role": "user", "content": "hello"}], 5)
    assert "hello" in box.conversation.value and not box.button.disabled


def test_a_blank_reply_says_why_and_what_to_try(shell, server, monkeypatch):
    """The untrained tiny model answers "hi" with nothing printable (a newline and control bytes):
    the cell says so, and why, instead of printing an empty line."""
    connect(shell, server, monkeypatch)
    want = direct_chat(server, TINY, [{"role": "user", "content": "hi"}], 16)
    assert want and not want.isprintable() and not want.strip("\n\x02")  # the case a user met
    out = run(shell, f"%openrl chat {TINY} hi --max-tokens 16").out.strip()
    assert out.startswith(f"openrl: {TINY} replied with nothing printable ({len(want)} characters: "), out
    assert "it used its max_tokens (16) on them" in out or "it ended its answer at once" in out, out
    assert "--temperature 0.8" in out and "trained checkpoint" in out, out
    reply = sess.get_session("m").chat(TINY, "hi", max_tokens=16, temperature=0)
    assert reply == want and reply.finish_reason in ("stop", "length") and reply.completion_tokens is not None


def test_chat_with_another_tenants_checkpoint_is_one_error_line(shell, server, ckpt, monkeypatch):
    monkeypatch.setenv("OPENRL_TOKEN", "tml-bob-0123456789abcdef")
    assert run(shell, f"%openrl connect {server.url} --name bobs").ok
    cell = run(shell, f"%openrl chat {ckpt} hi --session bobs")
    one_error_line(cell, "not found")


def test_export_magic_writes_a_model_folder(shell, server, ckpt, monkeypatch, tmp_path):
    connect(shell, server, monkeypatch)
    cell = run(shell, f"%openrl export {ckpt} {tmp_path / 'merged'} --merged")
    assert cell.ok, cell.text
    assert "merged" in cell.out and TINY in cell.out
    info = json.loads((tmp_path / "merged" / "openrl_export.json").read_text())
    assert info["tinker_path"] == ckpt and (tmp_path / "merged" / "model.safetensors").is_file()
    cell = run(shell, f"%openrl export {ckpt} {tmp_path / 'merged'}")
    line = one_error_line(cell, f"{tmp_path / 'merged'} exists and is not empty: add --force to replace it")
    assert "overwrite=True" not in line
    cell = run(shell, f"%openrl export {ckpt} {tmp_path / 'merged'} --force")  # the flag it named works
    assert cell.ok, cell.text
    cell = run(shell, f"%openrl export {TINY} {tmp_path / 'base'}")
    one_error_line(cell, "tinker://")


def test_a_run_exports_its_current_weights(server, tmp_path):
    s = sess.connect(server.url, token=ALICE_KEY, name="exporting")
    try:
        name = unique("export")
        registry.register(name, letters)
        r = s.train(reward=name, prompts=PROMPTS, steps=1, **SMALL).wait(120)
        info = r.export(tmp_path / "adapter")
        assert info["format"] == "peft" and info["tinker_path"].startswith("tinker://")
        with pytest.raises(sess.UsageError, match=r"adapter exists and is not empty: add overwrite=True to"):
            r.export(tmp_path / "adapter")
        assert r.export(tmp_path / "adapter", overwrite=True)["format"] == "peft"
        config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == TINY
        reply = s.chat(r.name, "hi", max_tokens=4, temperature=0)  # a run by name: its weights now
        assert reply == direct_chat(server, info["tinker_path"], [{"role": "user", "content": "hi"}], 4)
    finally:
        from tests._support.runs import forget_runs

        forget_runs(s)
        sess.disconnect("exporting")
