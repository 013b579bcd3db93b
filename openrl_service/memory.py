"""The memory accountant: how much memory the service has, and what each part of it may hold.

One plan per served model's device, made once the model is loaded and its sampler (vLLM's KV cache)
has started, so it counts what they took. On a GPU the room is what the CUDA allocator reports free
then. On the CPU it is what the OS reports available, or what the container's memory limit leaves
(cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``, less what the container already uses)
when that is lower: a pod with ``limits.memory: 6Gi`` on a 64 GiB node is OOM-killed at 6 GiB, and
``/proc/meminfo`` still reports the node's memory there.

Of the room, the plan reserves (``Plan.parts``):

- ``activations``: one training op's activations (a tenth of the room, at most 2 GiB); the trainer
  cuts its micro-batches so that their tokens' estimated activations fit (``train_token_bytes``);
- ``sampling``: one batched generate of the torch sampler (OPENRL_SAMPLE_BATCH_BYTES, sampling/budget.py);
- ``sampler_snapshots``: LoRA sampler snapshots and the OpenAI endpoint's LoRA cache (a 32nd of the
  room at most, and OPENRL_MAX_SAMPLER_SNAPSHOT_BYTES; held to it by
  bytes; a full run's snapshots and the endpoint's full checkpoints take turns in the full runs' share);
- ``moves``: the one tensor a spill, a load or a snapshot holds beyond the run itself (twice the
  largest of the model's);
- ``margin``: a twentieth of the room and 256 MiB, for what is not counted (the allocator's slack,
  request data, what the process itself grows by once it has run its first ops).

What is left is the full runs' share (``full_runs``): their weights, gradients, a set-aside
gradient, optimizer state and casts (training/full.py ``footprint``) and their sampler snapshots take
turns in it. OPENRL_FULL_RUN_BUDGET_BYTES replaces the computed share (and OPENRL_FULL_HOST_BUDGET_BYTES
the host share of runs moved off a GPU). The plan is logged at start and published in ``/metrics``
(``openrl_memory_bytes{model,part}``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

from openrl_service.sampling.budget import Dims

log = logging.getLogger("openrl.memory")

CGROUP = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 writes a page-rounded 2^63 for "no limit"
MAX_ACTIVATIONS = 2 << 30


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def container_limit(root: Path = CGROUP) -> int | None:
    """The memory limit of this process's container (cgroup v2, else v1), or None without one."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        limit = _read_int(path)
        if limit is not None:
            return limit if limit < NO_LIMIT else None
    return None


def container_used(root: Path = CGROUP) -> int | None:
    """The container's working set, as the kubelet counts it: its memory in use less the inactive
    page cache (the kernel drops that before it kills anyone). Mapped files in use stay in: a model's
    weights read by mmap and the libraries' code are memory the limit counts, not anonymous."""
    v2 = _read_int(root / "memory.current")
    if v2 is not None:
        return max(0, v2 - (_stat(root / "memory.stat", "inactive_file") or 0))
    v1 = _read_int(root / "memory" / "memory.usage_in_bytes")
    if v1 is not None:
        return max(0, v1 - (_stat(root / "memory" / "memory.stat", "total_inactive_file") or 0))
    return None


def peak_used(root: Path = CGROUP) -> int | None:
    """The container's peak memory use so far (v2 ``memory.peak``, v1 ``max_usage_in_bytes``)."""
    return _read_int(root / "memory.peak") or _read_int(root / "memory" / "memory.max_usage_in_bytes")


def host_room(available: int | None, root: Path = CGROUP) -> tuple[int | None, str]:
    """(bytes this process may still take on the host, where that figure comes from): the OS's
    available memory, or the container limit less its use when that is lower."""
    limit = container_limit(root)
    if limit is not None:
        used = container_used(root)
        if used is None:
            try:
                import psutil

                used = psutil.Process().memory_info().rss
            except ImportError:
                used = 0
        left = max(0, limit - used)
        if available is None or left < available:
            return left, f"container limit {_fmt(limit)} less {_fmt(used)} in use"
    return available, "available memory"


def train_token_bytes(config, dtype_bytes: int) -> int:
    """Estimated activation bytes one trained token holds until its backward pass: each layer's
    saved residual stream, q/k/v, attention output and MLP activations, plus its logits, their
    log-softmax and gradient (float32), and half again for the backward's temporaries."""
    d = Dims.of(config)
    per_layer = dtype_bytes * (6 * d.hidden + (d.heads + 2 * d.kv_heads) * d.head_dim + 4 * d.inter)
    return int(1.5 * (d.layers * per_layer + 12 * d.vocab))


@dataclass
class Plan:
    """What one device's memory is for (bytes): ``room`` and its ``parts``, ``full_runs`` the rest."""

    device: str
    room: int | None
    source: str
    parts: dict[str, int] = field(default_factory=dict)
    full_runs: int | None = None
    full_runs_source: str = "computed"
    host_share: int = 0

    def describe(self) -> str:
        if self.room is None:
            return f"{self.device}: memory unknown; full runs unlimited"
        parts = ", ".join(f"{k} {_fmt(v)}" for k, v in self.parts.items())
        full = "unlimited" if self.full_runs is None else _fmt(self.full_runs)
        return (
            f"{self.device}: {_fmt(self.room)} free for work ({self.source}); reserved: {parts}; "
            f"full runs ({self.full_runs_source}): {full}"
        )

    def metrics(self) -> dict[str, int]:
        out = dict(self.parts)
        if self.room is not None:
            out["room"] = self.room
        if self.full_runs is not None:
            out["full_runs"] = self.full_runs
        return out


def plan(
    device: str,
    room: int | None,
    source: str,
    *,
    sampling: int,
    sampler_snapshots: int,
    largest_tensor: int,
    full_runs: int | None,
    host_share: int,
) -> Plan:
    """Divide ``room`` (what the device has free once the model and sampler are up)."""
    p = Plan(device=device, room=room, source=source, host_share=host_share)
    if room is not None:
        p.parts = {
            "activations": min(MAX_ACTIVATIONS, max(64 << 20, room // 10)),
            "sampling": sampling,
            "sampler_snapshots": min(sampler_snapshots, max(32 << 20, room // 32)),
            "moves": 2 * largest_tensor,
            "margin": room // 20 + (256 << 20),
        }
        p.full_runs = max(0, room - sum(p.parts.values()))
    if full_runs is not None:
        p.full_runs, p.full_runs_source = full_runs, "OPENRL_FULL_RUN_BUDGET_BYTES"
    return p


def give_back() -> None:
    """Return the C heap's freed memory to the OS (glibc ``malloc_trim``): after a run's gigabytes
    leave, the allocator would otherwise keep them, and a container's limit counts them."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        return None


def _fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
