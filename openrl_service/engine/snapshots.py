"""A snapshot as data (format 2): the registry's state through the journal records' value codec, the
runs' and samplers' tensors (adapters, gradients, Adam moments) in a safetensors file beside it
(``snap-N.tensors``), referred to by key. Format 1 (the first release: data classes pickled, tensors
inline) is still read. Durability (durability.py) captures and restores the state; this module is
its on-disk form.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from openrl_service.engine import records
from openrl_service.storage.journal import Journal

# 2: plain data (engine/records.py values), the runs' and samplers' tensors in snap-N.tensors
# (safetensors) by reference; 1: the first release's, data classes pickled and tensors inline (read)
STATE_VERSION = 2
STATE_VERSIONS = (1, 2)


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


def adapter_data(adapter) -> dict:
    """An adapter's weights as journal data: {module: (A, B)}; a full fine-tune's {parameter: W}."""
    if adapter.full:
        return {n: tensor_data(t) for n, t in adapter.weights.items()}
    return {n: (tensor_data(a), tensor_data(b)) for n, (a, b) in adapter.weights.items()}


def adapter_from(spec, data: dict, device: Any, *, trainable: bool):
    """The inverse of :func:`adapter_data`."""
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


def write_snapshot(journal: Journal, n: int, state: dict) -> int:
    """Snapshot ``n`` as data: the runs' and samplers' tensors go to their own file (referenced by
    key), everything else through the records' value codec."""
    tensors: dict[str, np.ndarray] = {}

    def refer(data: tuple[str, np.ndarray]) -> tuple[str, tuple]:
        dtype, arr = data
        key = f"t{len(tensors)}"
        tensors[key] = np.ascontiguousarray(arr)
        return dtype, (b"tensor", {"key": key})

    def adapter(weights: dict) -> dict:
        # a LoRA's {module: (A, B)}, or a full fine-tune's {parameter: W} (one (dtype, array) each)
        return {
            m: refer(w) if isinstance(w[0], str) else (refer(w[0]), refer(w[1])) for m, w in weights.items()
        }

    runs = []
    for r in state["runs"]:
        t = r["state"]
        if t is not None:
            t = {
                **t,
                "weights": adapter(t["weights"]),
                "grads": {k: refer(v) for k, v in t["grads"].items()},
                "optimizer": {k: refer(v) for k, v in t["optimizer"].items()},
            }
        runs.append({**r, "state": t})
    samplers = [
        {**e, "weights": None if e["weights"] is None else adapter(e["weights"])} for e in state["samplers"]
    ]
    data = records.encode_value({**state, "runs": runs, "samplers": samplers})
    return journal.write_snapshot(n, data, tensors)


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
    path = journal.snapshot_tensors(n)
    if not path.exists():
        return records.decode_value(state)
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return records.decode_value(state, tensors=f.get_tensor)
