"""Forward/backward and optimizer steps for per-run LoRA adapters on the shared base model.

Everything here runs on the engine's single device-worker thread. A call's datums run as padded
micro-batches (longest first, at most ``microbatch_tokens`` padded tokens each), never one datum at
a time. Gradients accumulate in the run's own adapter tensors until its ``optim_step``, which clips
and steps over that run's parameters only.

Cross-run fusion (:meth:`Trainer.forward_backward_fused`): several runs' calls become ONE set of
padded micro-batches over all their datums (longest first, the same ``microbatch_tokens`` budget),
each row routed to its run's adapter (``AdapterRouter.use_rows``). Per micro-batch the logits are
computed once; each call's rows then get their own loss function, config, loss sum, token count and
ratio statistics, and the backward pass runs on the sum of the training calls' losses. Batch rows
never interact in a causal LM, so each run's adapter receives exactly its own gradient; optimizer
state and grad clipping stay per run (``optim_step`` is unchanged). Results equal running the calls
one after another up to float reassociation (different padding and matmul shapes), well within
rtol 1e-5 in float32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from openrl_service import progress
from openrl_service.errors import UserError
from openrl_service.memory import train_token_bytes
from openrl_service.models.loading import BaseModel
from openrl_service.training.dimuon import Dimuon, DimuonParams
from openrl_service.training.full import (
    FullWeights,
    Residency,
    footprint,
    master_dtype,
    new_full_weights,
    parameter_count,
    weights_class,
)
from openrl_service.training.lora import Adapter, LoraSpec, new_adapter
from openrl_service.training.losses import FLOAT_INPUTS, compute_loss, ratio_stats
from openrl_service.training.optim_params import AdamParams
from openrl_service.training.weights import RunWeights


@dataclass
class DatumArrays:
    """One validated datum: ``tokens_N`` and its loss inputs ([N] or [N, K] numpy arrays)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]


@dataclass
class TrainState:
    """A run's trainable state: adapter, optimizer, and how many optimizer steps it has taken."""

    spec: LoraSpec
    adapter: Adapter | FullWeights
    optimizer: torch.optim.Optimizer
    steps: int = 0
    pending_backward: int = 0  # forward_backward calls since the last optim_step
    param_names: list[str] = field(default_factory=list)
    group_key: int | None = None  # its key on every rank of a group (group/trainer.py)


@dataclass
class ForwardResult:
    logprobs: list[np.ndarray]  # one per datum, shaped like its target_tokens
    loss: float
    tokens: int
    stats: dict[str, float] | None = None


class FusedItem(NamedTuple):
    """One run's call inside a fused pass (a plain 4-tuple works too: forward_only defaults to False)."""

    state: TrainState | None
    data: list[DatumArrays]
    loss_fn: str
    config: dict[str, float]
    forward_only: bool = False


def make_optimizer(adapter: Adapter | FullWeights, kind: str | None = None) -> torch.optim.Optimizer:
    """The run's optimizer (``kind``, else its spec's): AdamW or Dimuon over its tensors."""
    kind = kind or adapter.spec.optimizer
    if kind == "dimuon":
        rank, plain = adapter.dimuon_args()
        return Dimuon(adapter.parameters(), rank, plain=plain)
    # foreach: one call per update stage over all the adapter's tensors instead of a Python loop over
    # them (torch's CPU default); the same arithmetic, bit for bit, ~25 % less time per step on CPU.
    # Not for a full run: foreach's temporaries are the size of all its tensors (a whole model more
    # at each step), a loop's one tensor's.
    return torch.optim.AdamW(
        adapter.parameters(),
        lr=1e-4,
        betas=(0.9, 0.95),
        eps=1e-12,
        weight_decay=0.0,
        foreach=adapter.shares_batch,
    )


class Trainer:
    # fp32 logits of one micro-batch (tokens × vocab × 4 bytes) stay under this; large vocabularies
    # (150k for Qwen) would otherwise need ~10 GB of logits for 16k tokens.
    LOGITS_BUDGET_BYTES = 2 << 30

    def __init__(
        self, base: BaseModel, *, microbatch_tokens: int = 16384, residency: Residency | None = None
    ):
        self.base = base
        # full runs' turns on the device (training/full.py); unlimited unless the service sets a budget
        self.residency = residency or Residency(base.device, budget_bytes=None, host_bytes=0, spill_dir=None)
        by_logits = self.LOGITS_BUDGET_BYTES // (4 * max(1, base.vocab_size))
        self.microbatch_tokens = min(microbatch_tokens, max(256, by_logits))
        self.memory_plan = None  # the accountant's (memory.py), set by the service
        # each decoder layer a forward pass enters is progress (/healthz: a big model's long step,
        # or a long generate, never looks like a wedged worker)
        for module in base.model.modules():
            if isinstance(module, torch.nn.ModuleList):
                for layer in module:
                    layer.register_forward_pre_hook(progress.tick)

    def publish(self, state: TrainState) -> None:
        """The run's state was changed outside the trainer (a checkpoint or journal loaded into it):
        a group's trainer sends it to every rank (group/trainer.py); one device has nothing to do."""

    def plan_memory(self, plan) -> None:
        """Take the memory accountant's plan (openrl_service/memory.py): the full runs' share, and
        micro-batches cut so that one's estimated activations fit what it reserves for them."""
        self.memory_plan = plan
        self.residency.budget = plan.full_runs
        self.residency.host_budget = plan.host_share if self.residency.device.type != "cpu" else 0
        self.residency._publish()
        room = plan.parts.get("activations")
        if room is not None:
            per = train_token_bytes(
                self.base.model.config, torch.empty((), dtype=self.base.dtype).element_size()
            )
            self.microbatch_tokens = min(self.microbatch_tokens, max(64, room // max(1, per)))

    # -- runs -------------------------------------------------------------------------------
    def footprint(self, spec: LoraSpec) -> int:
        """Device bytes a full run with ``spec`` holds while served (0 for LoRA: it is small)."""
        if not spec.full:
            return 0
        return footprint(self.base, spec, optimizer_slots=1 if spec.optimizer == "dimuon" else 2)

    def snapshot_need(self, spec: LoraSpec) -> int:
        """Device bytes a sampler snapshot of a full run with ``spec`` holds (its weights only)."""
        return parameter_count(self.base, spec) * master_dtype(self.base.dtype).itemsize if spec.full else 0

    def make_room_for(self, spec: LoraSpec) -> None:
        """Before a run's tensors are made: move full runs off the device until they fit."""
        if spec.full:
            self.residency.make_room(self.footprint(spec))

    def make_room_for_snapshot(self, spec: LoraSpec) -> None:
        """Before a sampler's copy of a full run's weights is read: room for it on the device."""
        if spec.full:
            self.residency.make_room(self.snapshot_need(spec))

    def take_in(self, weights: RunWeights) -> RunWeights:
        """A sampler's or the OpenAI endpoint's weights (no training state): a full run's take turns
        on the device with the runs, held weakly (they leave when their holder lets go)."""
        weights.adopt(self, None)
        return weights

    def admit(self, spec: LoraSpec) -> None:
        """Refuse a full run that alone cannot fit the device's share for full runs (UserError)."""
        if spec.full:
            self.residency.admit(self.footprint(spec), f"a full fine-tune of {self.base.name}")

    def new_state(self, spec: LoraSpec, seed: int) -> TrainState:
        if spec.full:
            self.residency.make_room(self.footprint(spec))  # before the copy is made
            return self.state_for(new_full_weights(self.base, spec))
        adapter = new_adapter(spec, self.base.targets, seed=seed, device=self.base.device)
        return self.state_for(adapter)

    def state_for(self, adapter: RunWeights, *, waiting_in: Path | None = None) -> TrainState:
        """A run's training state around ``adapter`` (on the device; or, ``waiting_in``, a run file
        whose tensors a full run takes when its first op needs them)."""
        adapter.prepare(self.base)
        state = TrainState(
            spec=adapter.spec,
            adapter=adapter,
            optimizer=make_optimizer(adapter),
            param_names=[n for n, _ in adapter.named_parameters()],
        )
        adapter.adopt(self, state, waiting_in)
        return state

    def state_from(self, weights: RunWeights, optimizer: dict[str, torch.Tensor] | None) -> TrainState:
        """A run from a checkpoint's weights and (or not) its optimizer tensors."""
        state = self.state_for(weights)
        try:
            if optimizer is not None:
                Trainer.load_optimizer_tensors(state, optimizer)
        except BaseException:
            state.adapter.leave()  # the device share state_for took
            raise
        return state

    def load_into(
        self, state: TrainState, loaded: RunWeights, optimizer: dict[str, torch.Tensor] | None, steps: int
    ) -> None:
        """A checkpoint's weights (and optimizer tensors, or a fresh optimizer at ``steps``) in place of
        a run's (Tinker's load_state)."""
        state.adapter.ensure_resident()
        with torch.no_grad():
            theirs = dict(loaded.named_parameters())
            for n, mine in state.adapter.named_parameters():
                mine.copy_(theirs[n])
                mine.grad = None
        if optimizer is not None:
            Trainer.load_optimizer_tensors(state, optimizer)
        else:
            state.optimizer = make_optimizer(state.adapter)
            state.steps = steps
        state.pending_backward = 0

    def restore_state(self, spec: LoraSpec, names: list[str], path: Path) -> TrainState:
        """A run from its journal-snapshot file (engine/run_files.py): weights, gradients, optimizer."""
        weights = weights_class(spec).placeholders(
            spec, names, dtype=master_dtype(self.base.dtype), trainable=True
        )
        return self.state_for(weights, waiting_in=path)

    def restore_weights(self, spec: LoraSpec, names: list[str], path: Path) -> RunWeights:
        """A sampler snapshot's weights from its journal-snapshot file."""
        weights = weights_class(spec).placeholders(
            spec, names, dtype=master_dtype(self.base.dtype), trainable=False
        )
        weights.adopt(self, None, path)
        return weights

    # -- forward / backward -----------------------------------------------------------------
    def _microbatches(self, lengths: list[int]) -> list[list[int]]:
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        batches: list[list[int]] = []
        current: list[int] = []
        for i in order:
            longest = lengths[current[0]] if current else lengths[i]
            if current and longest * (len(current) + 1) > self.microbatch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
        return batches

    def forward_backward(
        self,
        state: TrainState | None,
        data: list[DatumArrays],
        loss_fn: str,
        config: dict[str, float],
        *,
        forward_only: bool,
    ) -> ForwardResult:
        """Run the call; on failure (e.g. out of memory in a later micro-batch) the run's gradients are
        left exactly as they were, so a failed call never leaks part of its gradient into optim_step."""
        if forward_only or state is None:
            return self._run(state, data, loss_fn, config, forward_only=True)
        with accumulating_grads([state]):
            return self._run(state, data, loss_fn, config, forward_only=False)

    def _run(
        self,
        state: TrainState | None,
        data: list[DatumArrays],
        loss_fn: str,
        config: dict[str, float],
        *,
        forward_only: bool,
        min_passes: int = 0,
    ) -> ForwardResult:
        """``min_passes``: a sharded run's collective passes, padded with one-token passes that
        contribute nothing, so that every rank of a group runs as many (group/sharded.py)."""
        base = self.base
        adapter = state.adapter if state is not None else None
        model = adapter.forward_model(base) if adapter is not None else base.model
        dev = base.device
        outputs: list[np.ndarray | None] = [None] * len(data)
        total = 0.0
        ntok = 0
        stats_acc: dict[str, float] = {}
        passes = 0
        for idx in self._microbatches([len(d.tokens) for d in data]):
            batch = [data[i] for i in idx]
            L = max(len(d.tokens) for d in batch)
            B = len(batch)
            ids = torch.zeros(B, L, dtype=torch.long)
            valid = torch.zeros(B, L, dtype=torch.bool)
            for r, d in enumerate(batch):
                n = len(d.tokens)
                ids[r, :n] = torch.from_numpy(d.tokens)
                valid[r, :n] = True
            target = _pad([d.inputs["target_tokens"] for d in batch], L, torch.long)
            inputs = {
                k: _pad([d.inputs[k] for d in batch], L, torch.float32).to(dev)
                for k in FLOAT_INPUTS
                if k in batch[0].inputs
            }
            ids, valid, target = ids.to(dev), valid.to(dev), target.to(dev)
            with torch.set_grad_enabled(not forward_only), base.router.use(adapter):
                logits = model(input_ids=ids, use_cache=False).logits
                lp = _target_logprobs(logits, target)
                del logits
                per_datum = compute_loss(loss_fn, lp, inputs, valid, config)
                loss = per_datum.sum()
                if not forward_only:
                    loss.backward()
            total += float(loss.detach())
            ntok += int(valid.sum())
            merge_stats(stats_acc, ratio_stats(lp, inputs, valid, config))
            lp_cpu = lp.detach().to("cpu", torch.float32).numpy()
            for r, i in enumerate(idx):
                n = len(data[i].tokens)
                outputs[i] = lp_cpu[r, :n].copy()
            passes += 1
        for _ in range(min_passes - passes):
            with torch.set_grad_enabled(not forward_only), base.router.use(adapter):
                logits = model(
                    input_ids=torch.zeros(1, 1, dtype=torch.long, device=dev), use_cache=False
                ).logits
                if not forward_only:
                    (logits.sum() * 0.0).backward()
            del logits
        return ForwardResult(outputs, total, ntok, stats_acc or None)  # type: ignore[arg-type]

    # -- cross-run fusion -----------------------------------------------------------------------
    def forward_backward_fused(self, items: list[FusedItem] | list[tuple]) -> list[ForwardResult]:
        """Several runs' (forward_)backward calls as one padded pass with per-row adapters.

        ``items`` are ``(state, data, loss_fn, config[, forward_only])``; ``state`` may be None only for
        forward-only calls (base model). Returns one :class:`ForwardResult` per item, in order, equal to
        what :meth:`forward_backward` would return for it alone. Each training call's gradient is added
        to its own run's accumulated gradient (``pending_backward`` += 1 per call); if the pass fails,
        every run's gradients are left exactly as they were and the exception propagates. A single item
        is simply :meth:`forward_backward` (bit-identical)."""
        items = [FusedItem(*it) for it in items]
        for it in items:
            if it.state is None and not it.forward_only:
                raise ValueError("forward_backward_fused: a training call needs a TrainState")
        if len(items) == 1:
            it = items[0]
            return [
                self.forward_backward(it.state, it.data, it.loss_fn, it.config, forward_only=it.forward_only)
            ]
        with accumulating_grads([it.state for it in items if not it.forward_only]):
            return self._run_fused(items)

    def _run_fused(self, items: list[FusedItem]) -> list[ForwardResult]:
        base = self.base
        dev = base.device
        flat = [(k, j) for k, it in enumerate(items) for j in range(len(it.data))]  # (item, datum)
        datum = [items[k].data[j] for k, j in flat]
        any_grad = any(not it.forward_only for it in items)
        # A forward-only call's adapter must stay out of the autograd graph: its rows get a zero
        # gradient from the others' backward, which would otherwise land in that run's .grad.
        adapters = [
            None
            if it.state is None
            else (it.state.adapter.detached() if it.forward_only and any_grad else it.state.adapter)
            for it in items
        ]
        outputs: list[list[np.ndarray | None]] = [[None] * len(it.data) for it in items]
        totals = [0.0] * len(items)
        ntoks = [0] * len(items)
        stats_acc: list[dict[str, float]] = [{} for _ in items]
        for idx in self._microbatches([len(d.tokens) for d in datum]):
            idx = sorted(idx, key=lambda i: flat[i][0])  # each item's rows one block: sliced LoRA updates
            L = max(len(datum[i].tokens) for i in idx)
            B = len(idx)
            ids = torch.zeros(B, L, dtype=torch.long)
            valid = torch.zeros(B, L, dtype=torch.bool)
            for r, i in enumerate(idx):
                n = len(datum[i].tokens)
                ids[r, :n] = torch.from_numpy(datum[i].tokens)
                valid[r, :n] = True
            ids, valid = ids.to(dev), valid.to(dev)
            # This micro-batch's rows of each item, in row order.
            rows_of: dict[int, list[int]] = {}
            for r, i in enumerate(idx):
                rows_of.setdefault(flat[i][0], []).append(r)
            row_adapters = [adapters[flat[i][0]] for i in idx]
            targets = {
                k: _pad([datum[idx[r]].inputs["target_tokens"] for r in rows], L, torch.long).to(dev)
                for k, rows in rows_of.items()
            }
            with base.router.use_rows(row_adapters, device=dev), torch.set_grad_enabled(any_grad):
                logits = base.model(input_ids=ids, use_cache=False).logits
                lps = _item_logprobs(logits, rows_of, targets, dev)
                del logits
                losses = {}
                for k, rows in rows_of.items():
                    it = items[k]
                    batch = [datum[idx[r]] for r in rows]
                    inputs = {
                        key: _pad([d.inputs[key] for d in batch], L, torch.float32).to(dev)
                        for key in FLOAT_INPUTS
                        if key in batch[0].inputs
                    }
                    v = valid[rows] if len(rows) < B else valid
                    losses[k] = compute_loss(it.loss_fn, lps[k], inputs, v, it.config).sum()
                    merge_stats(stats_acc[k], ratio_stats(lps[k], inputs, v, it.config))
                    ntoks[k] += int(v.sum())
                train_losses = [loss for k, loss in losses.items() if not items[k].forward_only]
                if train_losses:
                    torch.stack(train_losses).sum().backward()
            for k, rows in rows_of.items():
                totals[k] += float(losses[k].detach())
                lp_cpu = lps[k].detach().to("cpu", torch.float32).numpy()
                for q, r in enumerate(rows):
                    _, j = flat[idx[r]]
                    outputs[k][j] = lp_cpu[q, : len(datum[idx[r]].tokens)].copy()
        return [
            ForwardResult(outputs[k], totals[k], ntoks[k], stats_acc[k] or None)  # type: ignore[arg-type]
            for k in range(len(items))
        ]

    # -- optimizer ----------------------------------------------------------------------------
    def optim_step(self, state: TrainState, adam: AdamParams | DimuonParams) -> dict[str, float]:
        kind = "dimuon" if isinstance(adam, DimuonParams) else "adamw"
        if kind != state.spec.optimizer:
            want = (
                "DimuonParams (optimizer_params)"
                if state.spec.optimizer == "dimuon"
                else "AdamParams (adam_params)"
            )
            field = "optimizer_params" if kind == "dimuon" else "adam_params"
            raise UserError(
                f"{field}: this run was created with the {state.spec.optimizer} optimizer; send {want}",
                field=field,
            )
        state.adapter.ensure_resident()
        params = state.adapter.parameters()
        grads = [p.grad for p in params if p.grad is not None]
        norm = state.adapter.grad_norm(grads)
        if not math.isfinite(norm):
            for p in params:
                p.grad = None
            state.pending_backward = 0
            raise UserError(
                "optim_step skipped: the accumulated gradient norm is not finite "
                "(check advantages/weights for inf or huge values); gradients were discarded",
                field="gradients",
            )
        if adam.grad_clip_norm > 0 and norm > adam.grad_clip_norm:
            coef = adam.grad_clip_norm / (norm + 1e-6)
            for g in grads:
                g.mul_(coef)
        if kind == "dimuon":
            state.optimizer.configure(adam)
        else:
            for group in state.optimizer.param_groups:
                group["lr"] = adam.learning_rate
                group["betas"] = (adam.beta1, adam.beta2)
                group["eps"] = adam.eps
                group["weight_decay"] = adam.weight_decay
        state.optimizer.step()
        state.adapter.touch()
        state.optimizer.zero_grad(set_to_none=True)
        state.steps += 1
        state.pending_backward = 0
        return {
            "grad_norm:mean": norm,
            "learning_rate:mean": adam.learning_rate,
            "step:max": float(state.steps),
        }

    # -- optimizer state as plain tensors (safetensors; never pickle) -------------------------
    # AdamW keeps exp_avg and exp_avg_sq per tensor, Dimuon its momentum; both a step count.
    SLOTS = {"adamw": ("exp_avg", "exp_avg_sq"), "dimuon": ("momentum",)}

    @staticmethod
    def optimizer_tensors(state: TrainState) -> dict[str, torch.Tensor]:
        """``<tensor>.<slot>`` and ``<tensor>.step`` per tensor with state, ``__steps__``, and (Dimuon)
        ``__dimuon__`` marking whose state it is."""
        gathered = getattr(state.adapter, "optimizer_tensors", None)
        if gathered is not None:  # a sharded run's: gathered from every rank (group/sharded.py)
            return gathered(state)
        out: dict[str, torch.Tensor] = {}
        slots = Trainer.SLOTS[state.spec.optimizer]
        names = dict(zip(state.param_names, state.adapter.parameters(), strict=True))
        for name, p in names.items():
            st = state.optimizer.state.get(p)
            if not st:
                continue
            for slot in slots:
                out[f"{name}.{slot}"] = st[slot].detach().to("cpu").contiguous()
            out[f"{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).to("cpu")
        out["__steps__"] = torch.tensor([float(state.steps)])
        if state.spec.optimizer == "dimuon":
            out["__dimuon__"] = torch.tensor([1.0])
        return out

    @staticmethod
    def load_optimizer_tensors(state: TrainState, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the run's optimizer state by ``tensors`` (the caller's dict, emptied as the state is
        made: a tensor already of the right device and dtype is taken, not copied). The old state
        goes first, so a full run never holds two optimizers' moments."""
        kind = "dimuon" if "__dimuon__" in tensors else "adamw"
        if kind != state.spec.optimizer:
            raise UserError(
                f"path: the checkpoint holds {kind} optimizer state; this run uses {state.spec.optimizer}",
                field="path",
            )
        state.optimizer = None
        state.optimizer = make_optimizer(state.adapter)
        for name, p in zip(state.param_names, state.adapter.parameters(), strict=True):
            slots = Trainer.SLOTS[kind]
            if f"{name}.{slots[0]}" not in tensors:
                continue
            st = {"step": tensors.pop(f"{name}.step").reshape(()).clone().to(torch.float32)}
            for slot in slots:
                t = tensors.pop(f"{name}.{slot}")
                v = t.to(p.device, torch.float32 if kind == "dimuon" else p.dtype)
                st[slot] = v  # the dict's own tensor (taken), or its copy on the device
                del t, v
            state.optimizer.state[p] = st
        if "__steps__" in tensors:
            state.steps = int(tensors["__steps__"].item())


@contextlib.contextmanager
def accumulating_grads(states: list[TrainState]) -> Iterator[None]:
    """One training call's gradient, added to what each run had accumulated, or nothing at all.

    The runs' earlier gradients are set aside while the block runs; when it completes they are added
    back and each state counts one more pending backward per call (a state listed twice made two
    calls), however many calls the block made itself; if it raises (also GeneratorExit, when a
    sliced call is closed between slices) every run's gradients and count are left exactly as they
    were, so a failed call never leaks part of its gradient into optim_step."""
    distinct = {id(st): st for st in states}
    _back_on_device(distinct.values())  # a full run's gradient is on the device only while it is
    params = [p for st in distinct.values() for p in st.adapter.parameters()]
    stash = [p.grad for p in params]
    pending = {k: st.pending_backward for k, st in distinct.items()}
    for p in params:
        p.grad = None
    try:
        yield
    except BaseException:
        gone = _back_on_device(distinct.values())
        for p, g in zip(params, stash, strict=True):
            if id(p) not in gone:
                p.grad = g
        for k, st in distinct.items():
            st.pending_backward = pending[k]
        raise
    gone = _back_on_device(distinct.values())
    for p, g in zip(params, stash, strict=True):
        if g is not None and id(p) not in gone:
            p.grad = g if p.grad is None else g.add_(p.grad)
    for k, st in distinct.items():  # calls made inside the block (a sliced call's slices) count as one
        st.pending_backward = pending[k] + sum(1 for s in states if s is st)


def _back_on_device(states) -> set[int]:
    """Between a sliced call's slices another run's op may have moved a full run off the device:
    bring it back before its set-aside gradient is restored. A run dropped meanwhile (its session
    finished) gets nothing back; its parameters' ids are returned."""
    gone: set[int] = set()
    for st in states:
        if not st.adapter.back_on_device():
            gone.update(id(p) for p in st.adapter.parameters())
    return gone


def merge_stats(acc: dict[str, float], stats: dict[str, float] | None) -> None:
    """Fold one micro-batch's ratio statistics into ``acc``: sums add, min and max combine."""
    for k, val in (stats or {}).items():
        if k == "ratio_min":
            acc[k] = min(acc.get(k, math.inf), val)
        elif k == "ratio_max":
            acc[k] = max(acc.get(k, -math.inf), val)
        else:
            acc[k] = acc.get(k, 0.0) + val


def _pad(arrays: list[np.ndarray], length: int, dtype: torch.dtype) -> torch.Tensor:
    first = arrays[0]
    shape = (len(arrays), length, *first.shape[1:])
    out = torch.zeros(shape, dtype=dtype)
    for r, a in enumerate(arrays):
        out[r, : a.shape[0]] = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
    return out


def _item_logprobs(
    logits: torch.Tensor, rows_of: dict[int, list[int]], targets: dict[int, torch.Tensor], dev
) -> dict[int, torch.Tensor]:
    """Each item's [b, L] (or [b, L, K]) target logprobs from one micro-batch's logits.

    When all items' targets have the same shape, the batch's targets are gathered in one call (the
    rows' logsumexp is computed once); otherwise each item gathers from its own rows."""
    shapes = {t.shape[2:] for t in targets.values()}
    if len(shapes) == 1:
        B = logits.shape[0]
        order = [r for rows in rows_of.values() for r in rows]
        full = torch.zeros((B, *next(iter(targets.values())).shape[1:]), dtype=torch.long, device=dev)
        full[torch.tensor(order, device=dev)] = torch.cat(list(targets.values()))
        lp = _target_logprobs(logits, full)
        if len(rows_of) == 1:
            return {k: lp for k in rows_of}
        return {k: lp[torch.tensor(rows, device=dev)] for k, rows in rows_of.items()}
    out = {}
    for k, rows in rows_of.items():
        out[k] = _target_logprobs(logits[torch.tensor(rows, device=dev)], targets[k])
    return out


def _target_logprobs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log p(target) per position: [B, L] for [B, L] targets, [B, L, K] for [B, L, K]."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    if target.dim() == 2:
        return (logits.gather(-1, target.unsqueeze(-1)) - lse).squeeze(-1)
    return logits.gather(-1, target) - lse
