"""The deterministic tiny model `openrl/tiny`: built offline, same bytes every build.

A byte-level tokenizer whose token id *is* the byte value (ids 0-255), four specials after them,
a Qwen-style chat template, and a 4-layer Llama-shaped config with fixed-seed random weights (~0.6 M
parameters). It exists so that the whole service, the SDK conformance suite and the notebooks run
on a laptop CPU with no model hub. Llama-shaped (not Qwen2) because vLLM serves LoRA on a Llama's
``lm_head`` but not on a Qwen2's, and the tiny model's defaults train the unembedding: with a Qwen2
the vLLM sampler could not serve the default runs.

`openrl/tiny-wide` (spec ``tiny-wide``) is the same recipe with hidden size 192 (~1.3 M parameters):
a second, differently shaped model for serving several base models in one service.

`openrl/scale-30m` and `openrl/scale-180m` (specs ``scale-30m``, ``scale-180m``) are the same recipe at
sizes where memory matters (~28 M and ~181 M parameters, fp32): what ``make bench-scale`` serves under a
container memory limit to make full fine-tunes take turns. Random weights: they learn, they know nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from openrl_service.models.tools_template import with_tools

TINY_MODEL_NAME = "openrl/tiny"
TINY_WIDE_MODEL_NAME = "openrl/tiny-wide"
SCALE_30M_MODEL_NAME = "openrl/scale-30m"
SCALE_180M_MODEL_NAME = "openrl/scale-180m"
_TINY_DEPTH = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
# name -> the config fields that differ between the variants (openrl/tiny's bytes never change)
TINY_SHAPES = {
    TINY_MODEL_NAME: {"hidden_size": 128, "intermediate_size": 256, **_TINY_DEPTH},
    TINY_WIDE_MODEL_NAME: {"hidden_size": 192, "intermediate_size": 384, **_TINY_DEPTH},
    SCALE_30M_MODEL_NAME: {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 10,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    },
    SCALE_180M_MODEL_NAME: {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
SEED = 20260501
ARCH = "LlamaForCausalLM"

# What RL on this model needs (measured; see docs/service/models.md, "The tiny model"): rank 8 on every linear layer
# plus the unembedding at lr 1e-3 lifts a letter-fraction reward from ~0.24 to ~1.0 in 60 steps.
TINY_DEFAULTS = {
    "lora_rank": 8,
    "learning_rate": 1e-3,
    "train_unembed": True,
    "train_mlp": True,
    "train_attn": True,
    "group_size": 8,
    "batch_size": 8,
    "max_tokens": 16,
    "temperature": 1.0,
}

# ChatML, with the Hermes tools block (tools_template.py) for conversations that offer or use tools
CHAT_TEMPLATE = with_tools(
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_vocab() -> dict[str, int]:
    """Map the ByteLevel pre-tokenizer's 256 visible symbols so that symbol(b) has id b."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256 + n.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = {}
    n = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    assert set(chars.values()) == set(alphabet)
    return {chars[b]: b for b in range(256)}


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    return fast


def tiny_variant(spec: str) -> str | None:
    """The built-in model a ``--model`` spec names ("tiny", "tiny-wide", "scale-30m", "scale-180m" or
    the full name), else None."""
    for name in TINY_SHAPES:
        if spec in (name, name.removeprefix("openrl/")):
            return name
    return None


def variant_parameters(name: str) -> int:
    """How many parameters the built-in model ``name`` has, from its shape (embeddings tied)."""
    shape = TINY_SHAPES[name]
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q and o, k and v, the MLP's three, two norms
    return VOCAB_SIZE * h + shape["num_hidden_layers"] * layer + h  # + the final norm


def tiny_folder_name(name: str) -> str:
    """Where under ``<data_dir>/models`` a tiny variant is built: openrl-tiny, openrl-tiny-wide."""
    return name.replace("/", "-")


def build_tiny_model(out_dir: str | os.PathLike, name: str = TINY_MODEL_NAME) -> Path:
    """Write the tiny model ``name`` (config, weights, tokenizer) to ``out_dir``; deterministic bytes."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert ids == list(range(256, VOCAB_SIZE)), ids
    endoftext, _im_start, im_end, pad = ids
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        **TINY_SHAPES[name],
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=pad,
        torch_dtype="float32",
    )
    config.architectures = [ARCH]
    # Fork the global RNG so building the model never disturbs a caller's seeded state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, endoftext], pad_token_id=pad, bos_token_id=None
    )
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".tiny-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # Drop files whose content is not reproducible or not needed.
        for file in os.listdir(tmp):
            shutil.move(os.path.join(tmp, file), out / file)
    _normalise_json(out, name)
    return out


def _normalise_json(out: Path, name: str) -> None:
    """Rewrite JSON files with sorted keys so the bytes never depend on dict order."""
    for path in out.glob("*.json"):
        data = json.loads(path.read_text())
        if path.name == "config.json":
            data["_name_or_path"] = name
        if path.name == "tokenizer_config.json":
            # transformers 5 writes its own class name ("TokenizersBackend"), which 4.x cannot load;
            # PreTrainedTokenizerFast loads the same tokenizer.json in 4.x and 5.x alike.
            data["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def tree_digest(path: str | os.PathLike) -> str:
    """sha256 over the sorted (name, bytes) of every file in a model folder."""
    h = hashlib.sha256()
    root = Path(path)
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def ensure_tiny_model(cache_dir: str | os.PathLike, name: str = TINY_MODEL_NAME) -> Path:
    """Build the tiny model ``name`` into ``cache_dir`` once; later calls reuse it."""
    target = Path(cache_dir)
    marker = target / "config.json"
    if marker.exists():
        if json.loads(marker.read_text()).get("architectures") == [ARCH]:
            return target
        # A folder built by an older release (a Qwen2-shaped tiny model): rebuild it in place.
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-build-"))
    try:
        build_tiny_model(staging, name)
        try:
            os.replace(staging, target)
        except OSError:
            # Another process won the race; its copy is byte-identical.
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
