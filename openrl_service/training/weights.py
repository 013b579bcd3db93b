"""What a run trains, behind one interface: :class:`RunWeights`.

Two classes implement it:

- ``Adapter`` (training/lora.py): a LoRA run's A/B pairs. Small, always on the device, and several
  share one batched forward pass (rows routed per adapter).
- ``FullWeights`` (training/full.py): a full fine-tune's own copy of the model's weights. Gigabytes:
  it takes turns on the device (its ``home`` Residency moves it out and back), and a forward pass
  swaps its tensors into the model's slots, so it never shares a pass.

The trainer, the engine, the journal's snapshots, checkpoints and the samplers call the methods
below; what differs between the kinds lives in the two classes, not in ``if weights.full`` branches
across the modules. ``LoraSpec.full`` (rank 0) still says which kind a request asks for, where a run
is created, counted against a quota, or its files named; ``weights_class`` (training/full.py) maps it
to the class. :func:`run_tensors` / :func:`place_tensors` are a run's whole training state by name,
the same for both kinds (spill files and the journal's run files).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

import torch

from openrl_service import progress
from openrl_service.storage.tensorfile import read_tensors


class RunWeights(abc.ABC):
    """The interface (methods every run's weights have; the abstract ones each class implements)."""

    full = False  # the kind, for logs and documents; behaviour goes through the methods below
    shares_batch = True  # may be one of several weights in a batched forward pass (routed per row)
    vllm_serves = True  # vLLM can sample it (a LoRA slot on its base weights)
    home: Any = None  # who moves its tensors on and off the device (full runs only)
    train_state: Any = None
    CHECKPOINT_FILE = "adapter_model.safetensors"  # its tensors' file in a checkpoint folder

    spec: Any
    weights: dict

    # -- tensors ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def parameters(self) -> list[torch.Tensor]:
        """Its trained tensors, in the optimizer's order."""

    @abc.abstractmethod
    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The same, by name (the names of its checkpoints' and run files' tensors)."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())

    def touch(self) -> None:
        """Record an update of the weights (the trainer calls it after each optimizer step)."""
        self.writes += 1

    @property
    def version(self) -> int:
        """Grows whenever the weights change: an optimizer step (``touch``) or any in-place write."""
        return self.writes + sum(t._version for t in self.parameters())

    @abc.abstractmethod
    def snapshot(self) -> RunWeights:
        """An immutable copy: sampling "step 7" keeps sampling step 7."""

    @abc.abstractmethod
    def detached(self) -> RunWeights:
        """The same tensors without autograd history (no copy)."""

    # -- the device ------------------------------------------------------------------------------
    def ensure_resident(self) -> None:
        """Its tensors on the device before an op reads them (LoRA: always there)."""
        return None  # LoRA: nothing to do (FullWeights overrides it)

    def back_on_device(self) -> bool:
        """Between a sliced call's slices: bring it back; False when it has left for good (its
        session finished) and gets nothing back."""
        return True

    def prepare(self, base) -> None:
        """Before its optimizer is made, learn what of ``base`` it needs (full: its embeddings)."""
        return None  # LoRA: nothing to do (FullWeights overrides it)

    def adopt(self, trainer, state, waiting_in=None) -> None:
        """Its trainer takes it in (``state``: its TrainState, None for a sampler snapshot); with
        ``waiting_in`` (a run file), its tensors are read from there (LoRA: now; full: when its
        first op needs them, the file linked as its spill file)."""
        if waiting_in is not None:
            with read_tensors(waiting_in) as f:
                place_tensors(self, state, f, trainer.base.device)

    def forward_model(self, base) -> torch.nn.Module:
        """The module a pass with these weights runs: the shared model (a sharded full run: its own)."""
        return base.model

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        """The L2 norm of the accumulated gradient (a sharded run's: over every rank's shard)."""
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    def state_tensors(self, state) -> dict[str, torch.Tensor]:
        """:func:`run_tensors` of these weights (a sharded run's gathered whole on rank 0)."""
        return run_tensors(self, state)

    on_leave: Any = None  # a group's: the other ranks drop their copy too (group/trainer.py)

    def leave(self) -> None:
        """Its session finished, or it was never adopted: give up its device share and spill file
        (LoRA: nothing to give up; FullWeights extends it)."""
        notify, self.on_leave = self.on_leave, None
        if notify is not None:
            notify()

    @abc.abstractmethod
    def applied(self, router):
        """A context in which the model computes with these weights (the router's ``use``)."""

    # -- optimizer -------------------------------------------------------------------------------
    @abc.abstractmethod
    def dimuon_args(self) -> tuple[int | None, list[torch.Tensor]]:
        """(LoRA rank for Dimuon's rank correction or None, tensors it does not orthogonalise)."""

    # -- files -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def checkpoint_payload(self, base, base_model: str) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, config) of a checkpoint of these weights (PEFT pair, or a whole model)."""


def run_tensors(weights, state) -> dict[str, torch.Tensor]:
    """Everything that makes a run's training state, by name: ``w:<p>`` its weights, ``g:<p>`` their
    gradients, ``o:<p>:<slot>`` the optimizer's state of each (the format of spill files and of the
    journal snapshots' run files, so that a run waiting on disk is snapshotted by linking its file)."""
    out: dict[str, torch.Tensor] = {}
    opt = state.optimizer.state if state is not None else {}
    for name, p in weights.named_parameters():
        out[f"w:{name}"] = p.data
        if p.grad is not None:
            out[f"g:{name}"] = p.grad
        for k, v in (opt.get(p) or {}).items():
            if isinstance(v, torch.Tensor):
                out[f"o:{name}:{k}"] = v
    return out


def place_tensors(weights, state, tensors, device: torch.device) -> None:
    """Put a run's tensors (``tensors[key]`` for the keys of :func:`run_tensors`; a dict or a lazily
    read file) back in place on ``device``, one at a time: the inverse of :func:`run_tensors`."""
    weights._cast = None  # a sampling copy in the model's dtype goes with a move
    keys = set(tensors.keys())
    opt = state.optimizer.state if state is not None else None
    for name, p in weights.named_parameters():
        progress.tick()
        p.data = tensors[f"w:{name}"].to(device)
        g = f"g:{name}"
        p.grad = tensors[g].to(device) if g in keys else None
        if opt is None:
            continue
        prefix = f"o:{name}:"
        slots = [k for k in keys if k.startswith(prefix)]
        if not slots:
            continue
        st = opt[p]
        for key in slots:
            k, v = key[len(prefix) :], tensors[key]
            # a step count is a copy: a tensor read from a file is a view of the whole file's private
            # mapping (storage/tensorfile.py read_tensors), and a step kept from it would keep every
            # page of the run the optimizer wrote, after the run had moved off again
            st[k] = v.clone() if k == "step" and v.dim() == 0 else v.to(device)
