"""Journal snapshots' tensors, one file per run and per sampler snapshot (snapshot format 3).

A snapshot used to copy every run's tensors into host memory and write them as one file: a service
with three full fine-tunes of a 180M model wrote 1.5 GB, every interval, from RAM it did not have.
Here each run's tensors (weights, gradients, optimizer state: training/full.py ``run_tensors``, the
format of a spill file too) go to ``run-<digest of run_id>-<tag>.tensors`` in the journal folder, one tensor at a
time (storage/tensorfile.py), and only when the run changed since its last file: an idle run costs
nothing, and a full run waiting on disk is snapshotted by linking its spill file (no bytes copied).
A sampler snapshot never changes: its file is written once. The memory a snapshot needs is one
tensor (a device tensor's host copy; none on a CPU device), whatever the runs' sizes.

The snapshot's state refers to the files by name; once it is durable the journal deletes every run
or sampler file no snapshot refers to (storage/journal.py ``write_snapshot``). At a recovery a LoRA
run is read back whole (it is small); a full run goes back on disk, its spill file a link of its
snapshot file, and comes onto the device when its first op needs it.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

import torch

from openrl_service import crashpoints, progress
from openrl_service.storage.tensorfile import link_or_copy, read_tensors, write_tensors
from openrl_service.training.weights import place_tensors

RUN_FILES = ("run-*.tensors", "sampler-*.tensors")


def _safe(ident: str) -> str:
    """An id as a file-name part: a digest (ids are the service's, but a name never carries a path)."""
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def fingerprint(st: Any) -> tuple:
    """What changes whenever a run's tensors do: its weights' version, its step and backward counts,
    and each gradient's identity and version (an accumulated one is added to in place)."""
    grads = tuple(
        (id(p.grad), p.grad._version) if p.grad is not None else None for p in st.adapter.parameters()
    )
    return (st.adapter.version, st.steps, st.pending_backward, grads)


class RunFiles:
    """The per-run files of the journal folder ``folder``: which is current for each run."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._runs: dict[str, tuple[tuple, str]] = {}  # run_id -> (fingerprint, file name)
        self._samplers: dict[str, tuple[int, str]] = {}  # sampler_id -> (id(adapter), file name)
        self.written = 0  # bytes written by snapshots (linked files count 0)
        self.reused = 0  # run files a snapshot referred to again, unchanged

    def known(self) -> set[str]:
        return {v[1] for v in (*self._runs.values(), *self._samplers.values())}

    def path(self, name: str) -> Path:
        return self.folder / name

    def run(self, run_id: str, st: Any) -> dict:
        """The run's file (written now if the run changed), as the snapshot's state refers to it."""
        fp = fingerprint(st)
        known = self._runs.get(run_id)
        if known is not None and known[0] == fp and self.path(known[1]).exists():
            self.reused += 1
            name = known[1]
        else:
            name = f"run-{_safe(run_id)}-{uuid.uuid4().hex[:12]}.tensors"
            self._write(name, st.adapter, st)
            self._runs[run_id] = (fp, name)
        return {
            "file": name,
            "names": [n for n, _ in st.adapter.named_parameters()],  # their order: the optimizer's
            "steps": st.steps,
            "pending_backward": st.pending_backward,
        }

    def sampler(self, sampler_id: str, adapter: Any) -> dict:
        known = self._samplers.get(sampler_id)
        if known is not None and known[0] == id(adapter) and self.path(known[1]).exists():
            self.reused += 1
            return {"file": known[1], "names": [n for n, _ in adapter.named_parameters()]}
        name = f"sampler-{_safe(sampler_id)}-{uuid.uuid4().hex[:12]}.tensors"
        self._write(name, adapter, None)
        self._samplers[sampler_id] = (id(adapter), name)
        return {"file": name, "names": [n for n, _ in adapter.named_parameters()]}

    def _write(self, name: str, weights: Any, st: Any) -> None:
        home = getattr(weights, "home", None)
        spilled = home.spill_file(weights) if home is not None else None
        if spilled is not None:  # waiting on disk: its spill file is in this very format
            link_or_copy(spilled, self.path(name))
            return
        tensors = weights.state_tensors(st)
        half = len(tensors) // 2

        def step(i: int) -> None:
            progress.tick()
            if i == half:
                crashpoints.hit("snapshot_write")

        self.written += write_tensors(self.path(name), tensors, progress=step)

    def forget(self, keep: set[str]) -> None:
        """Drop what this process remembers of files no longer kept (after a snapshot)."""
        self._runs = {k: v for k, v in self._runs.items() if v[1] in keep}
        self._samplers = {k: v for k, v in self._samplers.items() if v[1] in keep}

    def adopt(self, run_id: str, st: Any, name: str) -> None:
        """At a recovery: the restored run's file is current until the run changes."""
        self._runs[run_id] = (fingerprint(st), name)


def placeholders(names: list[str], dtype: torch.dtype, *, trainable: bool) -> dict[str, torch.Tensor]:
    """Empty tensors standing for a full run's weights while they wait on disk."""
    return {n: torch.empty(0, dtype=dtype).requires_grad_(trainable) for n in names}


def load_into(path: Path, weights: Any, st: Any, device: torch.device) -> None:
    """Read a run or sampler file's tensors into ``weights`` (and ``st``'s gradients and optimizer)."""
    with read_tensors(path) as f:
        place_tensors(weights, st, f, device)
