"""Per-run LoRA adapters on one shared base model, routed per forward pass.

The base model's target ``nn.Linear`` layers are wrapped once by :class:`LoRALinear`. Which adapter a
forward pass uses is decided by the :class:`AdapterRouter` (``with router.use(adapter): model(...)``),
so any number of runs share the frozen base weights while each keeps its own A/B tensors, its own
gradients and its own optimizer. Gradients can only reach the adapter that was active, which is
what keeps runs isolated.

Adapters are exported in PEFT's layout (``base_model.model.<module>.lora_A.weight`` +
``adapter_config.json``), so PEFT and vLLM load what this service saves.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

LORA_ALPHA = 32.0


@dataclass(frozen=True)
class LoraSpec:
    """What a run trains: rank and which layer groups carry LoRA."""

    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    alpha: float = LORA_ALPHA

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_json(self) -> dict:
        return asdict(self)


class Adapter:
    """One set of LoRA weights: {module name: (A [r, in], B [out, r])}, plus its scale."""

    def __init__(self, spec: LoraSpec, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        self.spec = spec
        self.weights = weights
        self.scale = spec.scale

    def parameters(self) -> list[torch.Tensor]:
        return [t for pair in self.weights.values() for t in pair]

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, (a, b) in self.weights.items():
            yield f"{name}.lora_A", a
            yield f"{name}.lora_B", b

    def snapshot(self) -> Adapter:
        """An immutable copy (detached clones): sampling "step 7" keeps sampling step 7."""
        with torch.no_grad():
            frozen = {n: (a.detach().clone(), b.detach().clone()) for n, (a, b) in self.weights.items()}
        return Adapter(self.spec, frozen)

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, (a, b) in self.weights.items():
            out[f"base_model.model.{name}.lora_A.weight"] = a.detach().to("cpu", torch.float32).contiguous()
            out[f"base_model.model.{name}.lora_B.weight"] = b.detach().to("cpu", torch.float32).contiguous()
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())


class AdapterRouter:
    """Says which adapter the wrapped layers apply during the current forward pass."""

    def __init__(self) -> None:
        self.active: Adapter | None = None

    @contextlib.contextmanager
    def use(self, adapter: Adapter | None):
        previous, self.active = self.active, adapter
        try:
            yield
        finally:
            self.active = previous


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus the active adapter's low-rank update: y = W x + s·B(A x)."""

    def __init__(self, base: nn.Linear, name: str, router: AdapterRouter):
        super().__init__()
        self.base = base
        self.name = name
        self.router = router
        self.in_features = base.in_features
        self.out_features = base.out_features

    @property
    def weight(self) -> torch.Tensor:  # transformers reads .weight on the output embedding
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        adapter = self.router.active
        if adapter is None:
            return y
        pair = adapter.weights.get(self.name)
        if pair is None:
            return y
        a, b = pair
        delta = (x.to(a.dtype) @ a.t()) @ b.t()
        return y + (delta * adapter.scale).to(y.dtype)


@dataclass
class TargetModule:
    name: str
    group: str  # "attn" | "mlp" | "unembed"
    in_features: int
    out_features: int


def classify_linear_layers(model: nn.Module) -> list[TargetModule]:
    """Every LoRA-able Linear, grouped as attention, MLP or the unembedding (lm_head)."""
    out_emb = model.get_output_embeddings()
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if module is out_emb:
            group = "unembed"
        elif ".layers." in f".{name}." or ".h." in f".{name}.":
            lowered = name.lower()
            group = "attn" if ("attn" in lowered or "attention" in lowered) else "mlp"
        else:
            continue
        targets.append(TargetModule(name, group, module.in_features, module.out_features))
    if not any(t.group == "attn" for t in targets):
        raise ValueError("unsupported architecture: found no attention nn.Linear layers to attach LoRA to")
    return targets


def inject_lora(model: nn.Module, router: AdapterRouter) -> list[TargetModule]:
    """Wrap every target Linear of ``model`` in place; returns the targets."""
    targets = classify_linear_layers(model)
    for t in targets:
        parent_name, _, child = t.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), t.name, router))
    for p in model.parameters():
        p.requires_grad_(False)
    return targets


def new_adapter(
    spec: LoraSpec, targets: list[TargetModule], *, seed: int, device: torch.device | str
) -> Adapter:
    """Fresh trainable weights: A ~ kaiming-uniform (as PEFT), B = 0, so the run starts at the base model."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    wanted = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
    weights = {}
    for t in targets:
        if not wanted[t.group]:
            continue
        a = torch.empty(spec.rank, t.in_features, dtype=torch.float32)
        bound = 1.0 / math.sqrt(t.in_features)  # kaiming_uniform_(a=sqrt(5)) bound
        a.uniform_(-bound, bound, generator=gen)
        b = torch.zeros(t.out_features, spec.rank, dtype=torch.float32)
        weights[t.name] = (
            a.to(device).requires_grad_(True),
            b.to(device).requires_grad_(True),
        )
    if not weights:
        raise ValueError(
            "LoRA config trains nothing: enable at least one of train_attn, train_mlp, train_unembed"
        )
    return Adapter(spec, weights)


def adapter_from_peft(
    spec: LoraSpec, tensors: dict[str, torch.Tensor], *, device: torch.device | str, trainable: bool
) -> Adapter:
    """Inverse of :meth:`Adapter.peft_state_dict`."""
    weights: dict[str, list] = {}
    for key, t in tensors.items():
        if not key.startswith("base_model.model.") or not key.endswith(".weight"):
            raise ValueError(f"unexpected tensor {key!r} in adapter file")
        body = key[len("base_model.model.") : -len(".weight")]
        name, _, which = body.rpartition(".")
        slot = weights.setdefault(name, [None, None])
        slot[0 if which == "lora_A" else 1] = t.to(device, torch.float32).clone().requires_grad_(trainable)
    for name, (a, b) in weights.items():
        if a is None or b is None:
            raise ValueError(f"adapter file is missing lora_A or lora_B for {name}")
    return Adapter(spec, {n: (a, b) for n, (a, b) in weights.items()})


def peft_adapter_config(spec: LoraSpec, targets: list[TargetModule], base_model: str) -> dict:
    wanted = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
    modules = sorted({t.name.rpartition(".")[2] for t in targets if wanted[t.group]})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
