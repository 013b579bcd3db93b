"""Full fine-tuning: a run (``rank=0``) that trains its own copy of the model's weights.

A full run's :class:`FullWeights` hold one tensor per trained parameter, under the parameter's Hugging
Face name. The shared base model still does the computing: while a forward pass uses a full run
(``router.use(weights)``), the router puts the run's tensors in the modules' parameter slots (a tied
embedding's two slots get the one tensor) and puts the base's back afterwards, so every kernel, the
KV cache and the samplers work as for the base model, and the base's own weights are never written.
What a full run trains: every parameter, less the attention, MLP or embedding (input and output)
weights when ``train_attn`` / ``train_mlp`` / ``train_unembed`` is off; the parameters it does not
train stay shared with the base (no copy). Weights are kept in float32 (master weights); on a
bfloat16 model they are cast on the way in, differentiably.

Memory. A full run needs its weights, their gradients and the optimizer's state on the device while
it is served: :func:`footprint` (AdamW: 4 bytes × 4 per parameter, Dimuon 4 × 3). The device's share
for full runs (OPENRL_FULL_RUN_BUDGET_BYTES) is the :class:`Residency`'s budget: a run that alone
needs more is refused when it is created, with the numbers; any other is admitted, and runs take
turns. Before a run is served its tensors are brought to the device, and the least recently served
runs are moved out until it fits: to the host share (OPENRL_FULL_HOST_BUDGET_BYTES; off when the device
is the CPU), whose own least recently served runs go on to a file on disk (``<data>/spill``) to make
room, or straight to disk when the host share cannot hold it. So the longer a run has waited, the
further away it is. Moving out and back is exact (the same bits), so a run that took turns computes
exactly what it would have alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from openrl_service.errors import UserError
from openrl_service.training.lora import adapter_from_peft, peft_adapter_config

log = logging.getLogger("openrl.full")

FULL_FILES = ("model.safetensors", "config.json")  # a full checkpoint: what AutoModelForCausalLM loads


class FullWeights:
    """A full fine-tune's own tensors: {Hugging Face parameter name: tensor}."""

    full = True
    scale = 1.0

    def __init__(self, spec, weights: dict[str, torch.Tensor]):
        self.spec = spec
        self.weights = weights
        self.writes = 0
        self.home: Residency | None = None  # a training run's live weights: who moves them
        self.train_state = None  # ...and the TrainState whose gradients and optimizer move with them
        self._cast: tuple[int, torch.dtype, dict[str, torch.Tensor]] | None = None
        self.embeddings: list[str] = []  # the vocabulary-sized ones (set by the Trainer)

    def cast(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in the model's dtype for a pass without gradients (sampling), cast once per
        version of the weights rather than at every decoded token."""
        version = self.version
        if self._cast is None or self._cast[0] != version or self._cast[1] != dtype:
            with torch.no_grad():
                self._cast = (version, dtype, {n: t.detach().to(dtype) for n, t in self.weights.items()})
        return self._cast[2][name]

    def touch(self) -> None:
        self.writes += 1

    @property
    def version(self) -> int:
        return self.writes + sum(t._version for t in self.weights.values())

    def ensure_resident(self) -> None:
        if self.home is not None:
            self.home.ensure(self)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.weights.values())

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()

    def snapshot(self) -> FullWeights:
        """An immutable copy (a sampler's snapshot): a whole copy of the trained weights."""
        self.ensure_resident()
        with torch.no_grad():
            return FullWeights(self.spec, {n: t.detach().clone() for n, t in self.weights.items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained tensors on the CPU, float32."""
        self.ensure_resident()
        return {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in self.weights.items()}


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def base_tensors(base) -> dict[str, torch.Tensor]:
    """The served model's own parameters by Hugging Face name (no copies): from the router's record
    of them, never from the modules' slots, which hold a full run's tensors during its ops."""
    own = base.router.base_weights
    return {n: own[n] for n in base.router.slots}


def new_full_weights(base, spec, *, trainable: bool = True) -> FullWeights:
    """A full run's starting point: a copy of the base model's weights that ``spec`` trains."""
    own = base_tensors(base)
    with torch.no_grad():
        weights = {
            n: own[n].detach().to(dtype=master_dtype(own[n].dtype), copy=True).requires_grad_(trainable)
            for n in base.router.full_names(spec)
        }
    return FullWeights(spec, weights)


def full_checkpoint(base, weights: FullWeights) -> dict[str, torch.Tensor]:
    """Every parameter of the model, the run's where it trains them, the base's elsewhere: the
    ``model.safetensors`` of a full checkpoint (a tied embedding saved once, as Hugging Face does)."""
    out = {n: t.detach().to("cpu").contiguous() for n, t in base_tensors(base).items()}
    out.update(weights.state_dict())  # float32 master weights: a resume continues bit for bit
    return out


def full_config(base) -> dict:
    """config.json of a full checkpoint: the served model's own configuration."""
    cfg = base.model.config.to_dict()
    cfg["torch_dtype"] = str(master_dtype(base.dtype)).removeprefix("torch.")
    cfg.pop("quantization_config", None)  # a GGUF base is served dequantised: so are its full runs
    return cfg


def check_full_tensors(base, spec, shapes: dict[str, list[int]], *, field: str, model: str) -> None:
    """Refuse (naming the tensor) a full checkpoint whose tensors are not this model's."""
    own = base_tensors(base)
    for name, shape in shapes.items():
        if name not in own:
            raise UserError(f"{field}: tensor {name} is not a parameter of {model}", field=field)
        if list(shape) != list(own[name].shape):
            raise UserError(
                f"{field}: tensor {name} has shape {list(shape)}; {model} has {list(own[name].shape)}",
                field=field,
            )
    missing = [n for n in base.router.full_names(spec) if n not in shapes]
    if missing:
        raise UserError(
            f"{field}: tensor {missing[0]} of {model} is missing from the checkpoint", field=field
        )


def full_from_tensors(base, spec, tensors: dict[str, torch.Tensor], *, trainable: bool) -> FullWeights:
    own = base_tensors(base)
    names = base.router.full_names(spec)
    with torch.no_grad():
        weights = {
            n: tensors[n].to(base.device, master_dtype(own[n].dtype)).clone().requires_grad_(trainable)
            for n in names
        }
    return FullWeights(spec, weights)


def weights_from_checkpoint(base, spec, tensors: dict[str, torch.Tensor], *, trainable: bool):
    """A checkpoint's tensors as run weights: a full fine-tune's or a LoRA adapter."""
    if spec.full:
        return full_from_tensors(base, spec, tensors, trainable=trainable)
    return adapter_from_peft(spec, tensors, device=base.device, trainable=trainable)


def checkpoint_payload(base, spec, weights, base_model: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, config) a checkpoint of ``weights`` stores: model.safetensors + config.json of the
    whole model for a full fine-tune, the PEFT pair for a LoRA."""
    if spec.full:
        return full_checkpoint(base, weights), full_config(base)
    return weights.peft_state_dict(), peft_adapter_config(spec, base.targets, base_model)


def parameter_count(base, spec) -> int:
    own = base_tensors(base)
    return sum(own[n].numel() for n in base.router.full_names(spec))


def footprint(base, spec, optimizer_slots: int = 2) -> int:
    """Bytes a full run holds on the device while served: float32 weights, gradients and the
    optimizer's per-parameter state (AdamW 2 slots, Dimuon 1)."""
    return parameter_count(base, spec) * 4 * (2 + optimizer_slots)


def leave_device(adapter) -> None:
    """A full run's device share and spill file go (its session finished, or it was never adopted);
    nothing for a LoRA adapter."""
    if adapter.full and adapter.home is not None:
        adapter.home.drop(adapter)


class Residency:
    """Which full runs' tensors are on the device; least recently served ones wait elsewhere.

    The engine's worker moves runs (every caller of ``ensure`` / ``make_room`` is an op); a finished
    session drops its run from a request thread. Every entry point takes the lock."""

    def __init__(
        self,
        device: torch.device,
        *,
        budget_bytes: int | None,
        host_bytes: int,
        spill_dir: Path | None,
        host_tier_on_cpu: bool = False,
    ):
        self.device = torch.device(device)
        self.budget = budget_bytes  # None: no limit (every run stays on the device)
        # on a CPU device host memory is the device's: runs go straight to disk (``host_tier_on_cpu``
        # keeps the host tier, so its order of moves can be tested without a GPU)
        self.host_budget = host_bytes if (self.device.type != "cpu" or host_tier_on_cpu) else 0
        self.spill_dir = spill_dir
        self.runs: OrderedDict[int, FullWeights] = OrderedDict()  # least recently served first
        self.where: dict[int, str] = {}  # "device" | "host" | "disk"
        self.need: dict[int, int] = {}
        self._lock = threading.RLock()  # the worker moves runs; a finished session drops its own
        self.moves = {"out_host": 0, "out_disk": 0, "in": 0}
        self.seconds = {"out_host": 0.0, "out_disk": 0.0, "in": 0.0}

    # -- accounting ------------------------------------------------------------------------------
    def _on(self, tier: str) -> int:
        return sum(self.need[k] for k, t in self.where.items() if t == tier)

    def admit(self, need: int, what: str) -> None:
        """Refuse (UserError, with the numbers) a run that alone does not fit the device's share."""
        if self.budget is not None and need > self.budget:
            raise UserError(
                f"{what} needs {_gib(need)} on {self.device} (float32 weights, gradients and optimizer "
                f"state), more than the {_gib(self.budget)} full runs may use there "
                "(OPENRL_FULL_RUN_BUDGET_BYTES); train a LoRA (rank >= 1) or freeze the embeddings "
                "(train_unembed=false)",
                field="lora_config.rank",
            )

    def add(self, weights: FullWeights, state, need: int) -> None:
        """Take charge of a run's live weights (on the device now: make room first)."""
        key = id(weights)
        with self._lock:
            self._make_room(need, keep=key)
            self._add(weights, state, need, key)

    def make_room(self, need: int) -> None:
        """Move least recently served runs out until ``need`` more bytes fit (before a new run's copy
        is made)."""
        with self._lock:
            self._make_room(need, keep=-1)

    def _add(self, weights: FullWeights, state, need: int, key: int) -> None:
        weights.home, weights.train_state = self, state
        self.runs[key] = weights
        self.where[key] = "device"
        self.need[key] = need

    def drop(self, weights: FullWeights) -> None:
        with self._lock:
            self._drop(weights)

    def _drop(self, weights: FullWeights) -> None:
        key = id(weights)
        if self.runs.pop(key, None) is None:
            return
        if self.where.pop(key, None) == "disk":
            with contextlib.suppress(OSError):
                self._spill_path(key).unlink()
        self.need.pop(key, None)
        weights.home = None

    def status(self) -> dict:
        with self._lock:  # read from the metrics thread while the worker moves runs
            return {
                "budget_bytes": self.budget,
                "host_budget_bytes": self.host_budget,
                "runs": {
                    t: sum(1 for w in self.where.values() if w == t) for t in ("device", "host", "disk")
                },
                "moves": dict(self.moves),
                "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
            }

    # -- turns -----------------------------------------------------------------------------------
    def ensure(self, weights: FullWeights) -> None:
        """Bring ``weights`` (and its gradients and optimizer state) to the device, moving the least
        recently served runs out until it fits; it becomes the most recently served."""
        with self._lock:
            self._ensure(weights)

    def _ensure(self, weights: FullWeights) -> None:
        key = id(weights)
        if key not in self.runs:
            return
        self.runs.move_to_end(key)
        if self.where[key] == "device":
            return
        self._make_room(self.need[key], keep=key)
        t0 = time.perf_counter()
        self._move(weights, self.device)
        self.where[key] = "device"
        self.moves["in"] += 1
        self.seconds["in"] += time.perf_counter() - t0

    def _make_room(self, need: int, keep: int) -> None:
        if self.budget is None:
            return
        for key in list(self.runs):
            if self._on("device") + need <= self.budget:
                break
            if key == keep or self.where.get(key) != "device":
                continue
            self._evict(key)

    def _evict(self, key: int) -> None:
        """Move a run off the device: to the host share when it fits there at all (the least recently
        served runs already on the host go on to disk to make room), else to disk."""
        weights = self.runs[key]
        t0 = time.perf_counter()
        if self.host_budget and self.need[key] <= self.host_budget:
            for other in list(self.runs):  # least recently served first
                if self._on("host") + self.need[key] <= self.host_budget:
                    break
                if other != key and self.where[other] == "host":
                    t1 = time.perf_counter()
                    self._spill(self.runs[other], other)
                    self.where[other] = "disk"
                    self.moves["out_disk"] += 1
                    self.seconds["out_disk"] += time.perf_counter() - t1
            t0 = time.perf_counter()
            self._move(weights, torch.device("cpu"))
            self.where[key], tier = "host", "out_host"
        else:
            self._spill(weights, key)
            self.where[key], tier = "disk", "out_disk"
        self.moves[tier] += 1
        self.seconds[tier] += time.perf_counter() - t0
        log.info("full run weights %x moved to %s", key, self.where[key])

    # -- moving tensors --------------------------------------------------------------------------
    @staticmethod
    def _tensors(weights: FullWeights) -> dict[str, torch.Tensor]:
        """Everything that moves with a run: weights, gradients, optimizer state (by name)."""
        out: dict[str, torch.Tensor] = {}
        state = weights.train_state
        opt = state.optimizer.state if state is not None else {}
        for name, p in weights.weights.items():
            out[f"w:{name}"] = p.data
            if p.grad is not None:
                out[f"g:{name}"] = p.grad
            for k, v in (opt.get(p) or {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"o:{name}:{k}"] = v
        return out

    def _place(self, weights: FullWeights, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        weights._cast = None  # a sampling copy in the model's dtype goes with the move
        state = weights.train_state
        opt = state.optimizer.state if state is not None else {}
        for name, p in weights.weights.items():
            p.data = tensors[f"w:{name}"].to(device)
            g = tensors.get(f"g:{name}")
            p.grad = None if g is None else g.to(device)
            st = opt.get(p)
            if st:
                for k in list(st):
                    v = tensors.get(f"o:{name}:{k}")
                    if v is not None:
                        st[k] = v if k == "step" and v.dim() == 0 and v.device.type == "cpu" else v.to(device)

    def _move(self, weights: FullWeights, device: torch.device) -> None:
        key = id(weights)
        if self.where.get(key) == "disk":
            path = self._spill_path(key)
            tensors = load_file(str(path))
            self._place(weights, tensors, device)
            with contextlib.suppress(OSError):
                path.unlink()
            return
        self._place(weights, dict(self._tensors(weights)), device)

    def _spill_path(self, key: int) -> Path:
        if self.spill_dir is None:
            raise RuntimeError("full runs need a spill folder to move to disk")
        return self.spill_dir / f"{os.getpid()}-{key:x}.safetensors"

    def _spill(self, weights: FullWeights, key: int) -> None:
        """Write the run's tensors to its spill file and free them (placeholders keep identities)."""
        self.spill_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self._tensors(weights).items()}
        path = self._spill_path(key)
        try:
            save_file(tensors, str(path))
            os.chmod(path, 0o600)
        except BaseException:  # a full disk: the run stays where it was, no partial file is left
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        self._release(weights)

    @staticmethod
    def _release(weights: FullWeights) -> None:
        """Free the run's tensors (empty placeholders keep every identity the optimizer keys on)."""
        weights._cast = None
        state = weights.train_state
        opt = state.optimizer.state if state is not None else {}
        for p in weights.weights.values():
            p.data = torch.empty(0, dtype=p.dtype)
            p.grad = None
            st = opt.get(p)
            if st:
                for k, v in list(st.items()):
                    if isinstance(v, torch.Tensor) and not (k == "step" and v.dim() == 0):
                        st[k] = torch.empty(0, dtype=v.dtype)

    @contextlib.contextmanager
    def readable(self, weights: FullWeights):
        """The run's tensors readable in place for the block (a journal snapshot) without moving it
        onto the device: a run on disk is read into host memory and freed again afterwards."""
        key = id(weights)
        with self._lock:
            if self.where.get(key) != "disk":
                yield
                return
            path = self._spill_path(key)
            self._place(weights, load_file(str(path)), torch.device("cpu"))
            try:
                yield
            finally:
                self._release(weights)  # the file is unchanged: read, never rewritten


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
