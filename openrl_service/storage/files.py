"""Private files written whole (mode 0600 from their creation; see :mod:`openrl_common.files`): keys,
key digests, job records and payloads, the hub accounts seen.
"""

from __future__ import annotations

import os

from openrl_common.files import write_atomic


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """``data`` as ``path`` (mode 0600), atomically and durably."""
    write_atomic(path, data, mode=0o600)
