"""Large tensor files written and read one tensor at a time (the safetensors format).

``safetensors.torch.save_file`` serialises every tensor to bytes in memory before it writes (a peak of
twice the state), and a whole-file ``load_file`` holds the file's bytes and the tensors at once: under a
container's memory limit a multi-GB full run would be OOM-killed by its own spill or snapshot. Here the
header is computed from shapes alone, then each tensor's bytes go to the file straight from its
storage (a CPU tensor is not copied at all; a device tensor is copied to the host one tensor at a
time), with an ``fsync`` every ``SYNC_BYTES`` so the kernel's dirty pages, which count against a
memory cgroup too, stay bounded. Readers open the file lazily (:func:`read_tensors`), one tensor
materialised at a time. ``progress`` is called after each tensor (the health check counts it).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SYNC_BYTES = 64 << 20  # dirty bytes between two fsyncs while writing

_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class Deferred:
    """A tensor made only when its bytes are written, then dropped: a merged export's weights are made
    one at a time, never the whole merged model in memory at once. ``shape`` and ``dtype`` are what
    ``make`` returns (the header is written first); a mismatch fails the write."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _made(name: str, t: torch.Tensor | Deferred) -> torch.Tensor:
    if not isinstance(t, Deferred):
        return t
    made = t.make()
    if tuple(made.shape) != tuple(t.shape) or made.dtype != t.dtype:
        raise ValueError(f"{name}: made {made.dtype} {list(made.shape)}, declared {t.dtype} {list(t.shape)}")
    return made


def _host_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def write_tensors(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, torch.Tensor | Deferred]] | dict[str, torch.Tensor | Deferred],
    *,
    progress: Callable[[int], None] | None = None,
    mode: int = 0o600,
    metadata: dict[str, str] | None = None,
) -> int:
    """Write ``tensors`` to ``path`` (a temporary name beside it, fsynced, then renamed): the
    safetensors format, so ``safetensors.safe_open`` reads it. A :class:`Deferred` value is made when
    its turn comes and dropped once written. Returns the file's size. On any error
    (a full disk) nothing is left at ``path`` or beside it."""
    items = list(tensors.items() if isinstance(tensors, dict) else tensors)
    header: dict[str, dict] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in items:
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} cannot be written")
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            f.write(struct.pack("<Q", len(head)) + head)
            unsynced = 0
            for i, (name, t) in enumerate(items):
                data = _host_bytes(_made(name, t))
                view = data
                while len(view):
                    wrote = f.write(view[: 16 << 20])
                    view = view[wrote:]
                unsynced += len(data)
                del data, view
                if unsynced >= SYNC_BYTES:
                    os.fsync(f.fileno())
                    unsynced = 0
                if progress is not None:
                    progress(i)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path.stat().st_size


class _Lazy:
    """A tensor file as a read-only mapping: each tensor read from the file when asked for."""

    def __init__(self, f):
        self._f = f

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def __iter__(self):
        return iter(self.keys())

    def __contains__(self, name: str) -> bool:
        return name in self._f.keys()  # noqa: SIM118 - safe_open has no __contains__

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._f.get_tensor(name)


@contextlib.contextmanager
def read_tensors(path: str | os.PathLike) -> Iterator[_Lazy]:
    """The file's tensors as a mapping, each read when asked for (one at a time in memory).

    safetensors maps the file (private, copy-on-write) and every tensor it returns is a view of that
    one mapping: pages are read in as they are touched, a page written becomes the process's own, and
    the whole mapping (with every page written, and the file's disk space if it was removed) stays
    until the last tensor read from it is gone. Copy a tensor that outlives the others."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        yield _Lazy(f)


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``dst`` as a second name of ``src`` (a hard link: no bytes copied, and ``src`` may go away
    afterwards); a copy in chunks where links are not possible."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.link(src, tmp)
    except OSError:
        with open(src, "rb") as a, open(tmp, "wb") as b:
            while chunk := a.read(16 << 20):
                b.write(chunk)
            b.flush()
            os.fsync(b.fileno())
    os.replace(tmp, dst)
