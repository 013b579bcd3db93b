"""Private files written whole: a new 0600 file beside the name, fsynced, renamed over it.

A crash leaves the old file or the whole new one, never a half-written one, and no other account can
read it at any moment (the temporary file is 0600 from its creation). Keys, key digests, job records
and payloads, the hub accounts seen.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """``data`` as ``path`` (mode 0600), atomically and durably."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
