"""A full run sharded over a group with FSDP2: its own ``fully_shard``-ed copy of the model.

At world size 1 a full run's tensors are swapped into the shared model's slots for its passes
(training/full.py). Sharded parameters cannot be swapped in, so at world size N each full run is a
module of its own: the model's architecture built on the meta device, each decoder layer and then the
whole model ``fully_shard``-ed over the group's one-dimensional mesh, every parameter materialised as
this rank's shard of the base's weights (``distribute_tensor``: one parameter at a time, so no rank
ever holds a second whole copy). Weights are float32 (master weights, as at world size 1): FSDP2 keeps
one dtype per shard group. Gradients are reduce-scattered as sums (``set_gradient_divide_factor(1)``
with sum-only collectives, which gloo needs), so a sharded run's gradient is the same sum over the
batch's datums as on one device.

Memory per rank: the run's footprint (weights, gradients, the gradient set aside while a call
computes, AdamW's two moments) divided by N, plus the all-gather transient: FSDP2 unshards one group at
a time and prefetches the next, so at most the two largest groups' whole float32 weights (and their
gradients during backward) at once. :func:`sharded_need` is that figure; the run is admitted against
the device's share for full runs (OPENRL_FULL_RUN_BUDGET_BYTES, per device) with the other sharded
runs counted, since sharded runs stay on their devices (they do not take turns yet).

Every pass over a sharded run is collective: every rank runs the same number of micro-batches (a rank
short of datums runs a one-token pass whose loss is multiplied by zero). Reading its weights or
optimizer state (a checkpoint, a sampler's snapshot, a journal snapshot) gathers them on rank 0
(``full_tensor``), one tensor at a time.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from openrl_service.errors import UserError
from openrl_service.storage.tensorfile import read_tensors
from openrl_service.training.full import FullWeights, base_tensors, full_config, parameter_count
from openrl_service.training.trainer import TrainState, make_optimizer
from openrl_service.training.weights import RunWeights, run_tensors


def _fsdp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    return init_device_mesh, fully_shard, DTensor, distribute_tensor, FSDPModule


_MESH: dict[str, object] = {}


def mesh(device: torch.device):
    init_device_mesh = _fsdp()[0]
    key = device.type
    if key not in _MESH:
        _MESH[key] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _MESH[key]


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: each one FSDP2 group (the embeddings, final norm and head are the root's)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and sum(1 for _ in module[0].parameters()):
            return list(module)
    return []


def sharded_need(base, spec, world: int) -> tuple[int, int]:
    """(bytes per rank held while served, the all-gather transient counted in it) of a sharded run."""
    per_param = 4 * (3 + 2)  # weights, gradients, the set-aside gradient, AdamW's two moments
    whole = parameter_count(base, spec) * per_param
    sizes = sorted((sum(p.numel() for p in layer.parameters()) for layer in layers(base.model)), reverse=True)
    in_layers = sum(sizes)
    root = sum(t.numel() for t in base_tensors(base).values()) - in_layers
    biggest = sorted([root, *sizes], reverse=True)[:2]
    transient = sum(biggest) * 4 * 2  # two groups unsharded: weights, and their gradients in backward
    return math.ceil(whole / world) + transient, transient


class ShardedFullWeights(RunWeights):
    """A full run's FSDP2 module on this rank (module docstring)."""

    full = True
    sharded = True
    shares_batch = False
    vllm_serves = False
    scale = 1.0
    CHECKPOINT_FILE = FullWeights.CHECKPOINT_FILE

    def __init__(self, spec, module: torch.nn.Module, names: list[str], group, key: int | None = None):
        self.spec = spec
        self.module = module
        self.group = group
        self.key = key
        self.writes = 0
        self.embeddings: list[str] = []
        params = dict(module.named_parameters())
        self.weights = {n: params[n] for n in names}
        self._cast = None

    # -- the interface ---------------------------------------------------------------------------
    def parameters(self) -> list[torch.Tensor]:
        return list(self.weights.values())

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()

    def nbytes(self) -> int:
        return sum(p.to_local().numel() * 4 for p in self.weights.values())

    def back_on_device(self) -> bool:
        return True  # never moved off

    def prepare(self, base) -> None:
        groups = base.router.param_groups
        self.embeddings = [n for n in self.weights if groups.get(n) == "unembed"]

    @contextlib.contextmanager
    def applied(self, router) -> Iterator[None]:
        with router.routing(None):
            yield

    def forward_model(self, base) -> torch.nn.Module:
        return self.module

    def dimuon_args(self):
        raise UserError(
            "optimizer: Dimuon is not available for full runs sharded over several devices yet; use AdamW",
            field="optimizer",
        )

    def detached(self) -> RunWeights:
        """Only a fused pass asks for this, and full runs never fuse (training/trainer.py)."""
        raise RuntimeError("a sharded full run never joins a fused pass: full runs are not fused")

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        local = torch.zeros((), dtype=torch.float64)
        for g in grads:
            local += g.to_local().detach().double().pow(2).sum().cpu()
        dist.all_reduce(local)
        return float(local.sqrt())

    # -- reads on rank 0: gathered from every rank ------------------------------------------------
    trainer = None  # rank 0's GroupTrainer (set when the run is kept)

    def checkpoint_payload(self, base, base_model: str) -> tuple[dict[str, torch.Tensor], dict]:
        return checkpoint_of(self.trainer, self)

    def optimizer_tensors(self, state: TrainState) -> dict[str, torch.Tensor]:
        return optimizer_tensors_of(self.trainer, state)

    def state_tensors(self, state) -> dict[str, torch.Tensor]:
        return self.trainer.gather(self, state=state, with_state=True)

    def snapshot(self) -> RunWeights:
        """A sampler's copy, whole on rank 0 (where torch samples), taking turns there like a full
        run's snapshot on one device."""
        got = self.trainer.gather(self, with_state=False)
        home = self.trainer.residency
        nbytes = sum(t.numel() * t.element_size() for t in got.values())
        home.make_room(nbytes)
        dev = self.trainer.base.device
        copy = FullWeights(self.spec, {k[2:]: v.to(dev) for k, v in got.items()})
        copy.prepare(self.trainer.base)
        home.add(copy, None, copy.nbytes())
        return copy

    # -- collective reads (every rank runs them, in the same order) -----------------------------
    def full_tensors(self, state: TrainState | None, *, with_state: bool) -> dict[str, torch.Tensor]:
        """Weights (and with ``with_state`` gradients and optimizer state), whole, on rank 0, as
        :func:`run_tensors` names them; other ranks get an empty dict."""
        out = {}
        for k, t in run_tensors(self, state if with_state else None).items():
            if not with_state and not k.startswith("w:"):
                continue
            DTensor = _fsdp()[2]
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            if self.group.rank == 0:
                out[k] = whole.detach().to("cpu", copy=True)
            del whole
        return out


# -- making one -----------------------------------------------------------------------------------
def _build(trainer, group, spec, source: dict | None, layout: dict | None) -> TrainState:
    """The run's module, sharded (collective). ``layout`` None: every rank starts from the base's own
    weights (no communication). Else ``layout`` names every tensor of the run's state as
    :func:`run_tensors` does, with its shape, and rank 0's ``source`` holds them whole: each rank
    receives its shard (weights, and where given gradients and optimizer state)."""
    from transformers import AutoModelForCausalLM

    _, fully_shard, _, distribute_tensor, FSDPModule = _fsdp()
    base = trainer.base
    dev = base.device
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(base.model.config, dtype=torch.float32)
    m = mesh(dev)
    for layer in layers(module):
        fully_shard(layer, mesh=m)
    fully_shard(module, mesh=m)
    for unit in module.modules():  # each shard group's own setting (the root's is not inherited)
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # sums over the ranks, as on one device
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    module.to_empty(device=dev)
    own = base_tensors(base)
    trained = set(base.router.full_names(spec))

    given = set(source.keys()) if source is not None and group.rank == 0 else set()

    def whole(key: str) -> torch.Tensor:
        if key in given:
            return source[key].detach().to(dev, torch.float32)
        return torch.empty(layout[key], dtype=torch.float32, device=dev)  # rank 0 sends it

    def scatter(key: str, placements) -> torch.Tensor:
        return distribute_tensor(whole(key), m, placements, src_data_rank=0)

    with torch.no_grad():
        for name, p in module.named_parameters():
            if layout is not None and f"w:{name}" in layout:
                t = scatter(f"w:{name}", p.placements)
            else:  # the base's weights, which every rank holds: no communication
                t = distribute_tensor(
                    own[name].detach().to(dev, torch.float32), m, p.placements, src_data_rank=None
                )
            p.copy_(t)
            p.requires_grad_(name in trained)
        own_buffers = dict(base.model.named_buffers())
        for name, b in module.named_buffers():  # rotary frequencies and the like: not parameters
            b.copy_(own_buffers[name])
    weights = ShardedFullWeights(spec, module, base.router.full_names(spec), group)
    weights.prepare(base)
    state = TrainState(
        spec=spec,
        adapter=weights,
        optimizer=make_optimizer(weights),
        param_names=[n for n, _ in weights.named_parameters()],
    )
    if layout is not None:
        with torch.no_grad():
            for name, p in weights.named_parameters():
                if f"g:{name}" in layout:
                    p.grad = scatter(f"g:{name}", p.placements)
                prefix = f"o:{name}:"
                for key in sorted(k for k in layout if k.startswith(prefix)):
                    slot = key[len(prefix) :]
                    if slot == "step":  # a count, the same on every rank
                        t = whole(key).to("cpu").reshape(()).clone()
                        dist.broadcast(t, src=0)
                        state.optimizer.state[p][slot] = t
                    else:
                        state.optimizer.state[p][slot] = scatter(key, p.placements)
    return state


def new_sharded_state(trainer, group, spec, source=None, layout=None) -> TrainState:
    if spec.optimizer == "dimuon":
        raise UserError(
            "optimizer: Dimuon is not available for full runs sharded over several devices yet; use AdamW",
            field="optimizer",
        )
    return _build(trainer, group, spec, source, layout)


def optimizer_as_run_tensors(names: list[str], opt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's optimizer tensors (``<name>.<slot>``, training/trainer.py) as run-file keys."""
    out = {}
    for n in names:
        for slot in ("exp_avg", "exp_avg_sq", "step"):
            t = opt.get(f"{n}.{slot}")
            if t is not None:
                out[f"o:{n}:{slot}"] = t.reshape(()) if slot == "step" else t
    return out


def layout_of(tensors) -> dict[str, list[int]]:
    return {k: list(tensors[k].shape) for k in tensors.keys()}  # noqa: SIM118  (a file: no __iter__)


def state_from_source(trainer, spec, source: dict, steps: int = 0, pending: int = 0) -> TrainState:
    """Rank 0: a sharded run from whole tensors it read (run-file keys), sent to every rank."""
    layout = layout_of(source)
    key = trainer.new_key()
    state, _ = trainer.group.call(
        "shard_state",
        {"model": trainer.base.name, "key": key, "spec": spec, "layout": layout},
        lambda: new_sharded_state(trainer, trainer.group, spec, source, layout),
    )
    trainer.keep(state, key)
    state.steps, state.pending_backward = steps, pending
    return state


def source_of(weights, waiting_in: Path | None, opt: dict | None = None):
    """Whole tensors of a run rank 0 holds (a FullWeights) or a run file names, with run-file keys."""
    if waiting_in is not None:
        return read_tensors(waiting_in)
    src = {f"w:{n}": t for n, t in weights.named_parameters()}
    if opt:
        src.update(optimizer_as_run_tensors([n for n, _ in weights.named_parameters()], opt))
    return contextlib.nullcontext(src)


def checkpoint_of(trainer, weights: ShardedFullWeights) -> tuple[dict[str, torch.Tensor], dict]:
    """Rank 0: the full checkpoint (every parameter of the model, the run's where it trains them)."""
    got = trainer.gather(weights, with_state=False)
    out = {n: t.detach().to("cpu").contiguous() for n, t in base_tensors(trainer.base).items()}
    out.update({k[2:]: v for k, v in got.items()})
    return out, full_config(trainer.base)


def optimizer_tensors_of(trainer, state: TrainState) -> dict[str, torch.Tensor]:
    got = trainer.gather(state.adapter, state=state, with_state=True)
    out: dict[str, torch.Tensor] = {}
    for k, v in got.items():
        if k.startswith("o:"):
            name, _, slot = k[2:].rpartition(":")
            out[f"{name}.{slot}"] = v.reshape(1).to(torch.float32) if slot == "step" else v
    out["__steps__"] = torch.tensor([float(state.steps)])
    return out
