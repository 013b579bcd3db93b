"""Reading a checkpoint folder: every file from one directory held open (a concurrent overwrite, an
atomic exchange of directories, cannot mix an old manifest with new tensors), each file checked against
the manifest's SHA-256, tensors read one at a time (storage/checkpoints.py ``CheckpointStore.load``
and ``verify``). ``ref`` is the CheckpointRef being read (for its path in messages)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from openrl_service.errors import UserError
from openrl_service.storage.tensorfile import read_tensors


class Folder:
    """A checkpoint directory held open: files are read relative to it (where the OS allows)."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self.fd = path, fd

    @classmethod
    def open(cls, path: Path) -> Folder | None:
        if os.open not in os.supports_dir_fd:
            return cls(path, None) if path.is_dir() else None
        try:
            return cls(path, os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def read(self, name: str) -> bytes:
        with self.open_file(name) as f:
            return f.read()

    def open_file(self, name: str):
        if self.fd is None:
            return open(self.path / name, "rb")
        return os.fdopen(os.open(name, os.O_RDONLY, dir_fd=self.fd), "rb")

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)


def verified(folder: Folder, name: str, digests: dict, ref: Any) -> bytes:
    """The file's bytes if they match the manifest's SHA-256 (files the manifest does not list are
    read as they are)."""
    data = folder.read(name)
    want = digests.get(name)
    if want is not None and hashlib.sha256(data).hexdigest() != want:
        raise corrupt(ref, name)
    return data


def corrupt(ref: Any, name: str) -> UserError:
    """The error for a file whose bytes no longer match the manifest's SHA-256."""
    return UserError(
        f"checkpoint {ref.path} is corrupt: {name} does not match the SHA-256 in its manifest "
        "(the file changed on disk after it was saved); save the checkpoint again",
        field="path",
    )


def identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def check_digest(f, want: str, name: str, ref: Any) -> int:
    """Hash the open file from its start in blocks; UserError naming the file when it does not match
    the manifest. Returns the bytes read."""
    f.seek(0)
    h, n = hashlib.sha256(), 0
    for block in iter(lambda: f.read(4 << 20), b""):
        h.update(block)
        n += len(block)
    if h.hexdigest() != want:
        raise corrupt(ref, name)
    return n


def tensors_of(
    folder: Folder, name: str, digests: dict, ref: Any, already_hashed=lambda f, want: False
) -> dict[str, torch.Tensor]:
    """A tensor file's tensors, its SHA-256 checked first (unless ``already_hashed`` says this very
    file was, off the worker: CheckpointStore.verify), both streamed: the bytes are hashed in blocks
    and the tensors read one at a time from the same open file (never the file's bytes and its tensors
    in memory at once: a full fine-tune's checkpoint is the size of the model)."""
    with folder.open_file(name) as f:
        want = digests.get(name)
        if want is not None and not already_hashed(f, want):
            check_digest(f, want, name, ref)
        source = f"/proc/self/fd/{f.fileno()}" if Path("/proc/self/fd").is_dir() else folder.path / name
        try:
            with read_tensors(source) as lazy:
                return {k: lazy[k] for k in lazy}
        except Exception as e:  # noqa: BLE001 - not a tensor file (a file changed behind our back)
            raise UserError(
                f"checkpoint {ref.path}: {name} is not a readable tensor file ({e})", field="path"
            ) from e
