"""The tiny model `openrl/tiny` is built offline, byte-for-byte the same every time, and loads with stock transformers."""

import json

from openrl_service.models.tiny import TINY_DEFAULTS, VOCAB_SIZE, build_tiny_model, tree_digest


def test_build_is_deterministic(tmp_path, tiny_model_dir):
    again = build_tiny_model(tmp_path / "again")
    assert tree_digest(again) == tree_digest(tiny_model_dir)


def test_loads_with_auto_classes_offline(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == VOCAB_SIZE  # the special AutoTokenizer adds (<|endoftext|>) is already inside
    assert tok.encode("Hi!") == [72, 105, 33]  # token id == byte value
    assert tok.decode([72, 105, 33]) == "Hi!"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.vocab_size == VOCAB_SIZE and model.config.tie_word_embeddings
    assert 500_000 < sum(p.numel() for p in model.parameters()) < 800_000


def test_capability_entry_carries_rl_defaults(server):
    caps = server.client().get("/api/v1/get_server_capabilities").json()["supported_models"]
    assert [c["model_name"] for c in caps] == ["openrl/tiny"]
    assert caps[0]["defaults"] == TINY_DEFAULTS
    assert caps[0]["defaults"]["lora_rank"] == 8 and caps[0]["defaults"]["learning_rate"] == 1e-3


def test_cli_make_tiny_model(tmp_path, tiny_model_dir):
    from openrl_service.cli import main

    assert main(["make-tiny-model", str(tmp_path / "m")]) == 0
    assert tree_digest(tmp_path / "m") == tree_digest(tiny_model_dir)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["_name_or_path"] == "openrl/tiny"


def test_llama_shaped_so_vllm_serves_lora_on_the_unembedding(tiny_model_dir):
    # vLLM serves LoRA on a Llama's lm_head (not a Qwen2's); the defaults train the unembedding.
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and TINY_DEFAULTS["train_unembed"]


def test_a_stale_cached_build_is_replaced(tmp_path, tiny_model_dir):
    from openrl_service.models.tiny import ensure_tiny_model

    stale = build_tiny_model(tmp_path / "cache")
    cfg = json.loads((stale / "config.json").read_text())
    (stale / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2ForCausalLM"]}))
    assert tree_digest(ensure_tiny_model(stale)) == tree_digest(tiny_model_dir)


def test_loading_a_model_leaves_the_process_environment_alone(tmp_path, tiny_model_dir, monkeypatch):
    """A service embedded in a process (a test, a kernel) must not change that process's environment:
    TRANSFORMERS_OFFLINE=1 left behind was inherited by every kernel started later, whose tokenizer load
    from the service's hub mirror then failed with "outgoing traffic has been disabled" (the SQL
    notebook's test failed in full runs and passed alone)."""
    import os

    from openrl_service.models.loading import load_base_model

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    before = dict(os.environ)
    base = load_base_model(str(tiny_model_dir), data_dir=tmp_path)
    assert base.tokenizer.encode("Hi!") == [72, 105, 33]
    assert dict(os.environ) == before
