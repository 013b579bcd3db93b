"""Per-run LoRA adapters on one shared base model, routed per forward pass.

The base model's target ``nn.Linear`` layers are wrapped once by :class:`LoRALinear`. Which adapter a
forward pass uses is decided by the :class:`AdapterRouter` (``with router.use(adapter): model(...)``),
so any number of runs share the frozen base weights while each keeps its own A/B tensors, its own
gradients and its own optimizer. Gradients can only reach the adapter that was active, which is
what keeps runs isolated.

Cross-run batching routes per batch row instead: ``with router.use_rows([a, b, a, None]): model(...)``
applies adapter ``a`` to rows 0 and 2, ``b`` to row 1 and nothing to row 3. Rows are grouped by
adapter once per ``use_rows`` (not per layer), and each layer runs the frozen base matmul over the
whole batch plus one batched low-rank update per adapter on that adapter's rows (``index_select``
→ ``x A^T B^T`` → ``index_add``). A causal LM never mixes batch rows, so the gradient of a sum of
per-row losses reaches each adapter only through its own rows: runs stay isolated in one pass.
When every row has the same adapter, ``use_rows`` is exactly ``use`` (same kernels, bit-identical).

Adapters are exported in PEFT's layout (``base_model.model.<module>.lora_A.weight`` +
``adapter_config.json``), so PEFT and vLLM load what this service saves.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from openrl_service.errors import UserError
from openrl_service.training.weights import RunWeights

LORA_ALPHA = 32.0


@dataclass(frozen=True)
class LoraSpec:
    """What a run trains: rank and which layer groups carry LoRA."""

    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    alpha: float = LORA_ALPHA
    optimizer: str = "adamw"  # or "dimuon" (training/dimuon.py): chosen at create, kept by checkpoints

    @property
    def full(self) -> bool:
        """Rank 0 is a full fine-tune (as other Tinker-compatible services read it): the run trains
        its own copy of the model's weights instead of an adapter (``training/full.py``)."""
        return self.rank == 0

    @property
    def scale(self) -> float:
        return 1.0 if self.full else self.alpha / self.rank

    def to_json(self) -> dict:
        return asdict(self)


class Adapter(RunWeights):
    """One set of LoRA weights: {module name: (A [r, in], B [out, r])}, plus its scale. One of the two
    kinds of run weights (training/weights.py); ``FullWeights`` (training/full.py) is the other."""

    def __init__(self, spec: LoraSpec, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        self.spec = spec
        self.weights = weights
        self.scale = spec.scale
        self.writes = 0  # optimizer steps applied (touch()); see version

    def parameters(self) -> list[torch.Tensor]:
        return [t for pair in self.weights.values() for t in pair]

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, (a, b) in self.weights.items():
            yield f"{name}.lora_A", a
            yield f"{name}.lora_B", b

    @staticmethod
    def check_file(base, spec, shapes: dict[str, list[int]], *, field: str, model: str) -> None:
        check_peft_shapes(spec, base.targets, shapes, model=model, field=field)

    @classmethod
    def placeholders(cls, spec: LoraSpec, names: list[str], *, dtype=None, trainable: bool) -> Adapter:
        """Empty tensors under ``names`` (``named_parameters`` order), to be filled from a run file."""
        pairs: dict[str, list] = {}
        for n in names:
            module, _, which = n.rpartition(".")
            slot = pairs.setdefault(module, [None, None])
            slot[0 if which == "lora_A" else 1] = torch.empty(0, dtype=torch.float32).requires_grad_(
                trainable
            )
        return cls(spec, {m: (a, b) for m, (a, b) in pairs.items()})

    def snapshot(self) -> Adapter:
        """An immutable copy (detached clones): sampling "step 7" keeps sampling step 7."""
        with torch.no_grad():
            frozen = {n: (a.detach().clone(), b.detach().clone()) for n, (a, b) in self.weights.items()}
        return Adapter(self.spec, frozen)

    def detached(self) -> Adapter:
        return Adapter(self.spec, {n: (a.detach(), b.detach()) for n, (a, b) in self.weights.items()})

    def applied(self, router: AdapterRouter):
        return router.routing(self)

    def dimuon_args(self) -> tuple[int | None, list[torch.Tensor]]:
        return self.spec.rank, []

    def checkpoint_payload(self, base, base_model: str) -> tuple[dict[str, torch.Tensor], dict]:
        return self.peft_state_dict(), peft_adapter_config(self.spec, base.targets, base_model)

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, (a, b) in self.weights.items():
            out[f"base_model.model.{name}.lora_A.weight"] = a.detach().to("cpu", torch.float32).contiguous()
            out[f"base_model.model.{name}.lora_B.weight"] = b.detach().to("cpu", torch.float32).contiguous()
        return out


@dataclass(frozen=True)
class RowGroup:
    """The batch rows (``rows``: a long tensor of row indices) that one adapter applies to; ``span`` is
    ``(start, stop)`` when those rows are one contiguous block."""

    adapter: Adapter
    rows: torch.Tensor
    span: tuple[int, int] | None = None


class AdapterRouter:
    """Says which adapter the wrapped layers apply during the current forward pass: one adapter for
    the whole batch (``active``) or, under :meth:`use_rows`, one per batch row (``groups``)."""

    def __init__(self) -> None:
        self.active: Adapter | None = None
        self.groups: tuple[RowGroup, ...] | None = None  # set only while rows carry different adapters
        self.rows = 0  # the batch size under use_rows
        # Full fine-tunes (training/full.py): each parameter's Hugging Face name -> the (module,
        # attribute) slots that hold it (a tied embedding has two), and its layer group.
        self.slots: dict[str, list[tuple[nn.Module, str]]] = {}
        self.param_groups: dict[str, str] = {}
        # The base model's own tensors (parameters and persistent buffers, Hugging Face names, a tied
        # embedding under both its names), recorded at bind, before any full run is swapped in. They
        # are never written and never leave this record, so any thread may read them; the modules'
        # slots hold a full run's tensors during its ops and are read on the device worker only.
        self.base_weights: dict[str, torch.Tensor] = {}

    def bind(self, model: nn.Module, targets: list[TargetModule]) -> None:
        """Learn the model's parameter slots, under the names Hugging Face gives them (a wrapped
        Linear's ``<name>.base.weight`` is ``<name>.weight``), and record the base's own tensors."""
        wrapped = {t.name: t.group for t in targets}
        self.base_weights = {}
        for key, value in model.state_dict().items():
            owner, _, leaf = key.rpartition(".")
            if owner.endswith(".base") and owner[: -len(".base")] in wrapped:
                key = f"{owner[: -len('.base')]}.{leaf}"
            elif owner == "base" and "" in wrapped:
                key = leaf
            self.base_weights[key] = value
        inputs = model.get_input_embeddings()
        canonical: dict[int, str] = {}
        for name, p in model.named_parameters():
            mod_name, _, attr = name.rpartition(".")
            group = "other"  # norms and the like: a full run always trains them
            if mod_name.endswith(".base") and mod_name[: -len(".base")] in wrapped:
                mod_name = mod_name[: -len(".base")]
                group = wrapped[mod_name]
            elif inputs is not None and p is inputs.weight:
                group = "unembed"
            hf = f"{mod_name}.{attr}" if mod_name else attr
            canonical[id(p)] = hf
            self.param_groups[hf] = group
        self.slots = {}
        for _, module in model.named_modules(remove_duplicate=False):
            for attr, p in module._parameters.items():
                if p is not None and id(p) in canonical:
                    slot = self.slots.setdefault(canonical[id(p)], [])
                    if not any(m is module and a == attr for m, a in slot):
                        slot.append((module, attr))

    def full_names(self, spec: LoraSpec) -> list[str]:
        """The parameters a full fine-tune with ``spec`` trains: every one, but the attention, MLP or
        embedding (input and output) weights when its flag turns that group off."""
        off = {
            g
            for g, on in (("attn", spec.train_attn), ("mlp", spec.train_mlp), ("unembed", spec.train_unembed))
            if not on
        }
        return [n for n, g in self.param_groups.items() if g not in off]

    @contextlib.contextmanager
    def use(self, adapter: RunWeights | None):
        """The next forward passes compute with ``adapter`` (None: the base model alone)."""
        with adapter.applied(self) if adapter is not None else self.routing(None):
            yield

    @contextlib.contextmanager
    def routing(self, adapter: Adapter | None):
        """One LoRA adapter (or none) for every row of the next passes."""
        previous = self.active, self.groups, self.rows
        self.active, self.groups, self.rows = adapter, None, 0
        try:
            yield
        finally:
            self.active, self.groups, self.rows = previous

    @contextlib.contextmanager
    def _swapped(self, weights):
        """The model computes with a full fine-tune's own tensors in place of the base's (the same
        module objects, so every kernel and the KV cache are as for the base model); a tensor kept in
        another dtype than the model's (float32 master weights of a bfloat16 model) is cast here,
        differentiably, so gradients reach the run's own tensor."""
        weights.ensure_resident()
        saved: list[tuple[nn.Module, str, torch.Tensor]] = []
        try:
            for name, t in weights.weights.items():
                slots = self.slots[name]
                old = slots[0][0]._parameters[slots[0][1]]
                if t.dtype == old.dtype:
                    use = t
                elif torch.is_grad_enabled() and t.requires_grad:
                    use = t.to(old.dtype)  # differentiable: the gradient reaches the float32 master
                else:
                    use = weights.cast(name, old.dtype)  # sampling: cast once per version
                for module, attr in slots:
                    saved.append((module, attr, module._parameters[attr]))
                    module._parameters[attr] = use
            yield
        finally:
            for module, attr, old in reversed(saved):
                module._parameters[attr] = old

    @contextlib.contextmanager
    def use_rows(self, adapters: Sequence[Adapter | None], device: torch.device | str | None = None):
        """Row ``i`` of the next forward passes gets ``adapters[i]`` (None: the base model only)."""
        distinct = {id(a) for a in adapters}
        if len(distinct) <= 1:  # one adapter for all rows: the single-adapter path, bit for bit
            with self.use(adapters[0] if adapters else None):
                yield
            return
        if any(a is not None and not a.shares_batch for a in adapters):
            raise ValueError("a full fine-tune's weights cannot share a batch with other weights")
        order: dict[int, tuple[Adapter, list[int]]] = {}
        for i, a in enumerate(adapters):
            if a is not None:
                order.setdefault(id(a), (a, []))[1].append(i)
        groups = tuple(
            RowGroup(
                a,
                torch.tensor(rows, dtype=torch.long, device=device),
                (rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else None,
            )
            for a, rows in order.values()
        )
        if all(g.span is not None for g in groups):  # blocks: slices instead of index_select/index_add
            groups = tuple(sorted(groups, key=lambda g: g.span))
        else:  # any interleaved adapter: every group gathers and scatters (the slice path needs all)
            groups = tuple(RowGroup(g.adapter, g.rows) for g in groups)
        previous = self.active, self.groups, self.rows
        self.active, self.groups, self.rows = None, groups, len(adapters)
        try:
            yield
        finally:
            self.active, self.groups, self.rows = previous


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus the active adapter's low-rank update: y = W x + s·B(A x).

    Few ops per call (this runs once per layer per decoded token): the frozen matmul is ``F.linear``
    on the base weights when the base is a plain ``nn.Linear``, the update two ``F.linear`` (the same
    kernels, bit for bit, as ``x @ A.T @ B.T``), and dtype casts only where the dtypes differ."""

    def __init__(self, base: nn.Linear, name: str, router: AdapterRouter):
        super().__init__()
        self.base = base
        self.name = name
        self.router = router
        self.in_features = base.in_features
        self.out_features = base.out_features
        # A subclass (a quantised Linear, say) keeps its own forward.
        self._plain = type(base) is nn.Linear

    @property
    def weight(self) -> torch.Tensor:  # transformers reads .weight on the output embedding
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        y = F.linear(x, base.weight, base.bias) if self._plain else base(x)
        router = self.router
        if router.groups is not None:
            return self._forward_rows(x, y, router.groups)
        adapter = router.active
        if adapter is None:
            return y
        pair = adapter.weights.get(self.name)
        if pair is None:
            return y
        return y + _scaled_delta(x, pair, adapter.scale, y.dtype)

    def _forward_rows(self, x: torch.Tensor, y: torch.Tensor, groups: tuple[RowGroup, ...]) -> torch.Tensor:
        """Per-row adapters: one low-rank update per adapter over its rows, added in place of those rows.

        When every adapter's rows are one block (the trainer's fused passes order rows by run), the
        updates are computed on slices (views) and joined with one ``cat``; otherwise they are gathered
        with ``index_select`` and scattered back with ``index_add``."""
        if groups[0].span is not None and x.shape[0] == self.router.rows:
            pieces, pos = [], 0
            for g in groups:
                start, stop = g.span  # type: ignore[misc]
                if start > pos:
                    pieces.append(y.new_zeros((start - pos, *y.shape[1:])))
                pair = g.adapter.weights.get(self.name)
                if pair is None:
                    pieces.append(y.new_zeros((stop - start, *y.shape[1:])))
                else:
                    pieces.append(_scaled_delta(x[start:stop], pair, g.adapter.scale, y.dtype))
                pos = stop
            if pos < y.shape[0]:
                pieces.append(y.new_zeros((y.shape[0] - pos, *y.shape[1:])))
            return y + torch.cat(pieces)
        for g in groups:
            pair = g.adapter.weights.get(self.name)
            if pair is None:
                continue
            rows = g.rows if g.rows.device == x.device else g.rows.to(x.device)
            y = y.index_add(0, rows, _scaled_delta(x.index_select(0, rows), pair, g.adapter.scale, y.dtype))
        return y


def _scaled_delta(
    x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """s·B(A x) in ``dtype``: the adapter's update (computed in the adapter's dtype)."""
    a, b = pair
    if x.dtype != a.dtype:
        x = x.to(a.dtype)
    delta = F.linear(F.linear(x, a), b) * scale
    return delta if delta.dtype == dtype else delta.to(dtype)


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
    router.bind(model, targets)
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


def peft_shapes(spec: LoraSpec, targets: list[TargetModule]) -> dict[str, list[int]]:
    """The tensor names and shapes of ``spec``'s adapter on a model with ``targets``, as PEFT saves them."""
    wanted = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed}
    out: dict[str, list[int]] = {}
    for t in targets:
        if wanted[t.group]:
            out[f"base_model.model.{t.name}.lora_A.weight"] = [spec.rank, t.in_features]
            out[f"base_model.model.{t.name}.lora_B.weight"] = [t.out_features, spec.rank]
    return out


def check_peft_shapes(
    spec: LoraSpec, targets: list[TargetModule], got: dict[str, list[int]], *, model: str, field: str
) -> None:
    """Refuse (UserError naming the tensor, the expected and the found shape) an adapter file whose
    tensors are not exactly ``spec``'s adapter on ``model``: a foreign or mismatched adapter."""
    expected = peft_shapes(spec, targets)
    for key in sorted(got):
        if key not in expected:
            raise UserError(
                f"{field}: tensor {key} (shape {list(got[key])}) is not a LoRA tensor of {model} for this "
                f"adapter (rank {spec.rank}, train_attn={spec.train_attn}, train_mlp={spec.train_mlp}, "
                f"train_unembed={spec.train_unembed})",
                field=field,
            )
        if list(got[key]) != expected[key]:
            raise UserError(
                f"{field}: tensor {key} has shape {list(got[key])}; expected {expected[key]} "
                f"(LoRA rank {spec.rank} on {model})",
                field=field,
            )
    missing = [k for k in expected if k not in got]
    if missing:
        raise UserError(
            f"{field}: tensor {missing[0]} (expected shape {expected[missing[0]]}) is missing; "
            f"{len(missing)} of the {len(expected)} tensors of a rank-{spec.rank} adapter on {model} are absent",
            field=field,
        )


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
