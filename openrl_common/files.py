"""Files written whole: a new file beside the name (with its mode from its creation when one is
given), fsynced, renamed over the name, then the folder fsynced so the rename itself survives a
power cut. A crash leaves the old file or the whole new one, never a half-written one; with
``mode=0o600`` no other account can read it at any moment. Both halves use it (the service's keys,
records, checkpoint manifests and snapshots; the notebook side's discovery files), so it imports
nothing of either.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, mode: int | None = None) -> None:
    """``data`` as ``path`` (text is written as UTF-8), atomically and durably."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the folder's entries (a rename, a new or deleted file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
