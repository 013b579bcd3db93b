"""Files written whole: a new file beside the name (0600 from its creation), fsynced, renamed over
the name, then the folder fsynced so the rename itself survives a power cut. A crash leaves the old
file or the whole new one, never a half-written one, and no other account can read it at any
moment (unless a wider ``mode`` is asked for). Both halves use it (the service's keys,
records, checkpoint manifests and snapshots; the notebook side's discovery files), so it imports
nothing of either.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(
    path: str | os.PathLike[str], data: bytes | str, *, mode: int | None = None, parents: bool = True
) -> None:
    """``data`` as ``path`` (text is written as UTF-8), atomically and durably. The new file is 0600
    from its creation (``tempfile.mkstemp``), then ``mode`` if another one is given. ``parents``:
    create the folder if it is missing; False leaves a missing folder missing (FileNotFoundError),
    for a file whose folder another thread may delete."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None and mode != 0o600:
                os.chmod(tmp, mode)
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the folder's entries (a rename, a new or deleted file) durable (POSIX; on Windows a
    folder cannot be opened, and a rename there is durable once the call returns)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
