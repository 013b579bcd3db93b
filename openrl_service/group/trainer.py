"""The trainer of a group: rank 0's :class:`GroupTrainer` sends, the other ranks' :class:`Follower` runs.

Every rank holds the base model and, under the same key, each run's state. A command names the model,
the run's key and plain data; each rank does its part with the same :class:`Trainer` code:

- **LoRA runs** are replicated: every rank holds the whole adapter and its optimizer, and every rank
  holds the same values after each command. A (forward_)backward splits the batch's datums over the
  ranks (datum ``i`` on rank ``i mod N``; a rank with none computes nothing), and the new gradient is
  summed over the ranks before it is added to what the run had accumulated, so an ``optim_step`` is
  the same arithmetic on every rank. Losses are sums over datums, so the sum of the ranks' parts is the
  batch's loss (``loss:sum``), and the logprobs come back in the batch's order. The base stays
  replicated: sharding it (FSDP) would all-gather the frozen weights at every micro-batch, which pays
  only when the base does not fit on one device (not supported yet).
- **Full runs** are sharded with FSDP2 (group/sharded.py): one ``fully_shard``-ed module per run, each
  rank holding 1/N of its weights, gradients and optimizer state; reading its weights (a checkpoint, a
  sampler's snapshot, a journal snapshot) is a collective that gathers them on rank 0.
- What rank 0 changes in a run's state outside these commands (a checkpoint loaded, a run restored
  from the journal) it sends whole (``publish``).

Sampling runs on rank 0 alone (torch), on its copy of the adapters; a full run's sampler snapshot is
gathered there first.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from openrl_service.errors import UserError
from openrl_service.training.full import _gib
from openrl_service.training.trainer import (
    DatumArrays,
    ForwardResult,
    FusedItem,
    Trainer,
    TrainState,
    accumulating_grads,
    make_optimizer,
    merge_stats,
)
from openrl_service.training.weights import RunWeights, place_tensors, run_tensors

log = logging.getLogger("openrl.group")


def share(n: int, rank: int, world: int) -> list[int]:
    """The datums of a batch of ``n`` that ``rank`` computes: ``rank``, ``rank + world``, …"""
    return list(range(rank, n, world))


def _item_wire(key: int | None, data: list[DatumArrays], loss_fn: str, config: dict, forward_only: bool):
    return {
        "key": key,
        "data": [(d.tokens, d.inputs) for d in data],
        "loss_fn": loss_fn,
        "config": dict(config),
        "forward_only": bool(forward_only),
    }


def run_part(trainer: Trainer, group, items: list[FusedItem]) -> list[ForwardResult | None]:
    """This rank's part of a (fused) (forward_)backward: its share of each item's datums, run as one
    pass (fused when several runs'); the new gradients summed over the ranks before they join what
    each run had accumulated. One result per item (None where this rank had none of its datums)."""
    mine = [
        FusedItem(it.state, [it.data[i] for i in share(len(it.data), group.rank, group.world_size)], *it[2:])
        for it in items
    ]
    train = [it.state for it in mine if not it.forward_only and it.state is not None]
    replicated = [st for st in train if not getattr(st.adapter, "sharded", False)]
    todo = [k for k, it in enumerate(mine) if it.data]
    results: list[ForwardResult | None] = [None] * len(items)
    with accumulating_grads(train):
        if any(getattr(it.state.adapter, "sharded", False) for it in mine if it.state is not None):
            it = mine[0]  # a full run never shares a pass: one item, every rank in every pass
            n = len(items[0].data)
            passes = max(
                len(
                    trainer._microbatches(
                        [len(items[0].data[i].tokens) for i in share(n, r, group.world_size)]
                    )
                )
                for r in range(group.world_size)
            )  # every rank runs as many collective passes
            results[0] = trainer._run(
                it.state, it.data, it.loss_fn, it.config, forward_only=it.forward_only, min_passes=passes
            )
        elif len(todo) == 1:
            k = todo[0]
            it = mine[k]
            results[k] = trainer._run(it.state, it.data, it.loss_fn, it.config, forward_only=it.forward_only)
        elif todo:
            for k, r in zip(todo, trainer._run_fused([mine[k] for k in todo]), strict=True):
                results[k] = r
        _sum_new_gradients(group, replicated)  # a sharded run's: summed by FSDP's reduce-scatter
    return results


def _sum_new_gradients(group, states: list[TrainState]) -> None:
    """Inside ``accumulating_grads``: each run's ``.grad`` is this call's gradient only; sum it over
    the ranks (a rank that computed none of a run's datums adds zeros)."""
    grads = []
    for st in {id(s): s for s in states}.values():
        for p in st.adapter.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    group.all_reduce_sum(grads)


def _combine(items: list[FusedItem], world: int, parts: list[list[Any]]) -> list[ForwardResult]:
    """Rank 0's answer: each item's per-rank results (``parts[rank][k]``) put back in datum order."""
    out = []
    for k, it in enumerate(items):
        logprobs: list[np.ndarray | None] = [None] * len(it.data)
        total, ntok, stats = 0.0, 0, {}
        for rank in range(world):
            r = parts[rank][k]
            if r is None:
                continue
            for i, lp in zip(share(len(it.data), rank, world), r.logprobs, strict=True):
                logprobs[i] = lp
            total += r.loss
            ntok += r.tokens
            merge_stats(stats, r.stats)
        out.append(ForwardResult(logprobs, total, ntok, stats or None))  # type: ignore[arg-type]
    return out


def state_bytes(states) -> int:
    """Bytes of run state this rank holds: weights, gradients and optimizer state (a sharded run's
    local shards only)."""
    total = 0
    for st in states:
        tensors = [t for p in st.adapter.parameters() for t in (p, p.grad) if t is not None]
        if st.optimizer is not None:
            tensors += [
                v for per in st.optimizer.state.values() for v in per.values() if isinstance(v, torch.Tensor)
            ]
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


class GroupTrainer(Trainer):
    """Rank 0's trainer of one model in a group: the same interface as :class:`Trainer`; what changes a
    run's tensors is sent to every rank (module docstring)."""

    def __init__(self, base, *, group, **kw):
        super().__init__(base, **kw)
        self.group = group
        self._next_key = 0
        self._live: weakref.WeakValueDictionary[int, TrainState] = weakref.WeakValueDictionary()
        group.held = lambda: state_bytes(list(self._live.values()))
        self._sharded: dict[int, int] = {}  # sharded full runs' keys -> bytes each holds per device
        self._gone: set[int] = set()  # keys every rank has dropped

    def new_key(self) -> int:
        key, self._next_key = self._next_key, self._next_key + 1
        return key

    def keep(self, state: TrainState, key: int) -> None:
        """``state`` is known to every rank as ``key``; when it leaves, every rank drops it."""
        state.group_key = key
        self._live[key] = state
        state.adapter.on_leave = lambda: self._drop(key)
        if getattr(state.adapter, "sharded", False):
            state.adapter.trainer = self  # its reads gather through this trainer's group
            state.adapter.key = key

    def _key(self, state: TrainState) -> int:
        if state.group_key is None:
            self.keep(state, self.new_key())
        if state.group_key in self._gone:
            # its session finished and every rank let it go (at world size 1 an op queued before the
            # finish still runs on the orphaned tensors; here they are gone from the other ranks)
            raise UserError(
                "model_id: this run's session has finished; its ops no longer run", field="model_id"
            )
        return state.group_key

    # -- runs ------------------------------------------------------------------------------------
    def admit(self, spec) -> None:
        if not spec.full:
            return
        from openrl_service.group.sharded import sharded_need

        need, transient = sharded_need(self.base, spec, self.group.world_size)
        budget = self.residency.budget
        used = sum(self._sharded.values())
        if budget is not None and used + need > budget:
            raise UserError(
                f"a full fine-tune of {self.base.name} sharded over {self.group.world_size} devices needs "
                f"{_gib(need)} per device (its weights, gradients and optimizer state / "
                f"{self.group.world_size}, plus {_gib(transient)} for FSDP's all-gathers); the full runs' "
                f"share of each device is {_gib(budget)} (OPENRL_FULL_RUN_BUDGET_BYTES) and "
                f"{_gib(used)} of it is held by {len(self._sharded)} sharded full runs, which stay on "
                "their devices; train a LoRA (rank >= 1), or use more devices",
                field="lora_config.rank",
            )

    def make_room_for(self, spec) -> None:
        if not spec.full:  # a sharded run never takes the turns a full run takes on one device
            super().make_room_for(spec)

    def _count(self, state: TrainState) -> None:
        from openrl_service.group.sharded import sharded_need

        key = state.group_key
        self._sharded[key] = sharded_need(self.base, state.spec, self.group.world_size)[0]

    def new_state(self, spec, seed: int) -> TrainState:
        if spec.full:
            from openrl_service.group.sharded import new_sharded_state

            self.admit(spec)
            key = self.new_key()
            state, _ = self.group.call(
                "new_state",
                {"model": self.base.name, "key": key, "spec": spec, "seed": seed},
                lambda: new_sharded_state(self, self.group, spec),
            )
            self.keep(state, key)
            self._count(state)
            return state
        state = super().new_state(spec, seed)
        self.group.call(
            "new_state",
            {"model": self.base.name, "key": self._key(state), "spec": spec, "seed": seed},
            lambda: None,
        )
        return state

    def state_for(self, adapter: RunWeights, *, waiting_in: Path | None = None) -> TrainState:
        if adapter.spec.full:  # a full run's whole weights, read here: every rank takes its shard
            return self._sharded_from(adapter, waiting_in, None)
        state = super().state_for(adapter, waiting_in=waiting_in)
        self.publish(state)
        return state

    def _sharded_from(self, weights, waiting_in, optimizer) -> TrainState:
        from openrl_service.group.sharded import source_of, state_from_source

        self.admit(weights.spec)
        try:
            with source_of(weights, waiting_in, optimizer) as source:
                state = state_from_source(self, weights.spec, source)
        finally:
            weights.leave()  # rank 0's whole copy (a checkpoint's, or a restored run's placeholders)
        self._count(state)
        return state

    def state_from(self, weights: RunWeights, optimizer) -> TrainState:
        if weights.spec.full:
            return self._sharded_from(weights, None, optimizer)
        state = super().state_from(weights, optimizer)
        self.publish(state)
        return state

    def load_into(self, state: TrainState, loaded: RunWeights, optimizer, steps: int) -> None:
        if not getattr(state.adapter, "sharded", False):
            super().load_into(state, loaded, optimizer, steps)
            self.publish(state)
            return
        from openrl_service.group.sharded import layout_of, new_sharded_state, source_of

        key = state.group_key
        with source_of(loaded, None, optimizer) as source:
            layout = layout_of(source)
            new, _ = self.group.call(
                "shard_state",
                {"model": self.base.name, "key": key, "spec": state.spec, "layout": layout},
                lambda: new_sharded_state(self, self.group, state.spec, source, layout),
            )
        state.adapter.on_leave = None  # the same key goes on: the other ranks replaced theirs
        state.adapter, state.optimizer, state.param_names = new.adapter, new.optimizer, new.param_names
        self.keep(state, key)
        if optimizer is None:
            state.steps = steps
        else:
            state.steps = int(optimizer["__steps__"].item()) if "__steps__" in optimizer else state.steps
        state.pending_backward = 0

    def gather(self, weights, *, state: TrainState | None = None, with_state: bool) -> dict:
        """A sharded run's tensors, whole, on rank 0 (collective; module docstring)."""
        if weights.key in self._gone:
            raise UserError("model_id: this run's session has finished", field="model_id")
        got, _ = self.group.call(
            "gather",
            {"model": self.base.name, "key": weights.key, "with_state": with_state},
            lambda: weights.full_tensors(state, with_state=with_state),
        )
        return got

    def publish(self, state: TrainState) -> None:
        """Send the run's whole state as rank 0 holds it (weights, gradients, optimizer, counts); a
        sharded run's state is every rank's already."""
        if getattr(state.adapter, "sharded", False):
            return
        key = self._key(state)
        tensors = {k: v.detach().to("cpu") for k, v in run_tensors(state.adapter, state).items()}
        payload = {
            "model": self.base.name,
            "key": key,
            "spec": state.spec,
            "names": [n for n, _ in state.adapter.named_parameters()],
            "tensors": tensors,
            "steps": state.steps,
            "pending": state.pending_backward,
        }
        self.group.call("put_state", payload, lambda: None)

    def _drop(self, key: int) -> None:
        self._sharded.pop(key, None)
        self._gone.add(key)
        self.group.call("drop", {"key": key}, lambda: None)

    # -- forward / backward -----------------------------------------------------------------------
    def forward_backward(self, state, data, loss_fn, config, *, forward_only: bool) -> ForwardResult:
        return self._group_pass([FusedItem(state, data, loss_fn, config, forward_only)])[0]

    def forward_backward_fused(self, items) -> list[ForwardResult]:
        return self._group_pass([FusedItem(*it) for it in items])

    def _group_pass(self, items: list[FusedItem]) -> list[ForwardResult]:
        for it in items:
            if it.state is None and not it.forward_only:
                raise ValueError("forward_backward_fused: a training call needs a TrainState")
        wire = [
            _item_wire(None if it.state is None else self._key(it.state), it.data, *it[2:]) for it in items
        ]
        mine, others = self.group.call(
            "forward_backward",
            {"model": self.base.name, "items": wire},
            lambda: run_part(self, self.group, items),
        )
        return _combine(items, self.group.world_size, [mine, *others])

    # -- optimizer -------------------------------------------------------------------------------
    def optim_step(self, state: TrainState, adam) -> dict[str, float]:
        metrics, _ = self.group.call(
            "optim_step",
            {"model": self.base.name, "key": self._key(state), "adam": adam},
            lambda: Trainer.optim_step(self, state, adam),
        )
        return metrics


class Follower:
    """A rank other than 0: the same models, the runs' states by key, rank 0's commands executed."""

    def __init__(self, group, trainers: dict[str, Trainer]):
        self.group = group
        self.trainers = trainers
        self.states: dict[int, TrainState] = {}
        group.held = lambda: state_bytes(list(self.states.values()))

    def execute(self, name: str, p: dict) -> Any:
        if name in ("ping", "stop"):
            return None
        if name == "drop":
            st = self.states.pop(p["key"], None)
            if st is not None:
                st.adapter.leave()
            return None
        trainer = self.trainers[p["model"]]
        if name in ("new_state", "shard_state") and p["spec"].full:
            from openrl_service.group.sharded import new_sharded_state

            old = self.states.pop(p["key"], None)
            self.states[p["key"]] = new_sharded_state(trainer, self.group, p["spec"], None, p.get("layout"))
            del old  # a load_state's: the run's previous module goes once the new one is made
            return None
        if name == "new_state":
            self.states[p["key"]] = trainer.new_state(p["spec"], p["seed"])
            return None
        if name == "put_state":
            self.states[p["key"]] = _put_state(trainer, p, self.states.get(p["key"]))
            return None
        if name == "gather":
            st = self.states[p["key"]]
            st.adapter.full_tensors(st, with_state=p["with_state"])
            return None
        if name == "forward_backward":
            items = [
                FusedItem(
                    None if w["key"] is None else self.states[w["key"]],
                    [DatumArrays(tokens, inputs) for tokens, inputs in w["data"]],
                    w["loss_fn"],
                    w["config"],
                    w["forward_only"],
                )
                for w in p["items"]
            ]
            return run_part(trainer, self.group, items)
        if name == "optim_step":
            Trainer.optim_step(trainer, self.states[p["key"]], p["adam"])
            return None
        raise ValueError(f"unknown group command {name!r}")


def _put_state(trainer: Trainer, p: dict, old: TrainState | None) -> TrainState:
    """A run's whole state as rank 0 sent it (``publish``), in place of what this rank held."""
    from openrl_service.training.full import weights_class

    if old is not None:
        old.adapter.leave()
    spec = p["spec"]
    weights = weights_class(spec).placeholders(spec, p["names"], dtype=torch.float32, trainable=True)
    state = TrainState(
        spec=spec, adapter=weights, optimizer=make_optimizer(weights), param_names=list(p["names"])
    )
    place_tensors(weights, state, p["tensors"], trainer.base.device)
    state.steps = p["steps"]
    state.pending_backward = p["pending"]
    return state
