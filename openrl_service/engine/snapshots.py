"""A snapshot as data (format 3): the registry's state through the journal records' value codec; each
run's and sampler snapshot's tensors (weights, gradients, optimizer state) in a file of its own in
the journal folder (engine/run_files.py), referred to by name. Format 2 (all tensors in one
``snap-N.tensors`` beside the snapshot, by key) and format 1 (the first release: data classes pickled,
tensors inline) are still read. Durability (durability.py) captures and restores the state; this
module is its on-disk form.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from openrl_service.engine import records
from openrl_service.storage.journal import Journal

# 3: plain data, each run's and sampler's tensors in a file of its own (engine/run_files.py), by
# name; 2: plain data, all the tensors in snap-N.tensors (safetensors) by reference (read); 1: the
# first release's, data classes pickled and tensors inline (read)
STATE_VERSION = 3
STATE_VERSIONS = (1, 2, 3)


def tensor_data(t: torch.Tensor) -> tuple[str, np.ndarray]:
    """A tensor as (dtype, numpy copy); bfloat16 travels as its bits."""
    t = t.detach().to("cpu")
    if t.dtype == torch.bfloat16:
        return "bfloat16", t.view(torch.int16).numpy().copy()
    return str(t.dtype).removeprefix("torch."), t.numpy().copy()


def tensor_from(data: tuple[str, np.ndarray], device: Any) -> torch.Tensor:
    dtype, arr = data
    t = torch.from_numpy(np.array(arr))
    if dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    return t.to(device)


def adapter_from(spec, data: dict, device: Any, *, trainable: bool):
    """A run's or sampler's weights from format 1 or 2 snapshot data ({module: (A, B)} or
    {parameter: W}, each (dtype, array))."""
    from openrl_service.training.lora import Adapter

    if spec.full:
        from openrl_service.training.full import FullWeights

        return FullWeights(
            spec, {n: tensor_from(t, device).requires_grad_(trainable) for n, t in data.items()}
        )
    return Adapter(
        spec,
        {
            n: (
                tensor_from(a, device).requires_grad_(trainable),
                tensor_from(b, device).requires_grad_(trainable),
            )
            for n, (a, b) in data.items()
        },
    )


def write_snapshot(journal: Journal, n: int, state: dict, keep: set[str]) -> int:
    """Snapshot ``n`` as data (format 3): the runs' and samplers' tensors are in their own files
    already (engine/run_files.py), named by the state; ``keep`` lists them, so that the journal
    deletes the others once this snapshot is durable."""
    return journal.write_snapshot(n, records.encode_value(state), keep=keep)


def read_snapshot(journal: Journal, n: int, state: dict) -> dict:
    """A snapshot's state as the restore takes it (tensors loaded from its file)."""
    if state.get("version") not in STATE_VERSIONS:
        raise RuntimeError(
            f"snapshot {n} is of format {state.get('version')}; this release reads formats "
            f"{', '.join(map(str, STATE_VERSIONS))} (a newer release wrote it): start that release "
            "on this data dir; nothing was changed"
        )
    if state["version"] == 1:
        return state  # inline tensors, its data classes unpickled as they are
    if state["version"] == 3:
        return records.decode_value(state)  # the run files are read as runs are restored
    path = journal.snapshot_tensors(n)
    if not path.exists():
        return records.decode_value(state)
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return records.decode_value(state, tensors=f.get_tensor)
