"""The data-dir lock: one ``openrl-service`` process owns a data dir at a time.

The store keeps each tenant's records in memory and must be the only writer of its folder (see
docs/architecture.md, Storage), so ``serve`` takes an exclusive ``flock`` on
``<data>/openrl-service.lock`` before it touches anything else and holds it for its whole life. The
lock file names the holder (pid, host, start time, URL) so a second ``serve`` on the same folder exits
at once with a message saying who has it. The kernel drops the lock with the holder's last file
descriptor, so a process that dies in any way (``kill -9`` and OOM included) frees the folder; the
file itself stays behind and is rewritten by the next owner.

``flock`` is advisory and local to one machine's kernel: it does not protect a folder that two hosts
mount over NFS. Without ``fcntl`` (Windows) there is no lock, and a warning says so.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from openrl_common.datadirs import LOCK_NAME

log = logging.getLogger(__name__)


class DataDirInUse(RuntimeError):
    """Another process holds the data dir's lock; ``holder`` is what it wrote in the lock file."""

    def __init__(self, data_dir: Path, holder: dict):
        self.data_dir = data_dir
        self.holder = holder
        who = ", ".join(
            part
            for part in (
                f"pid {holder['pid']}" if "pid" in holder else "",
                f"on host {holder['host']}" if "host" in holder else "",
                f"since {holder['since']}" if "since" in holder else "",
                f"serving {holder['url']}" if "url" in holder else "",
            )
            if part
        )
        super().__init__(
            f"data dir {data_dir} is in use by another openrl-service ({who or 'holder unknown'}); "
            "one process owns a data dir: stop that one first, or pass another --data-dir"
        )


class DataDirLock:
    """An exclusive hold on a data dir; release it with :meth:`release` (or let the process end)."""

    def __init__(self, path: Path, fd: int | None):
        self.path = path
        self._fd = fd
        self.holder: dict = {}

    @classmethod
    def acquire(cls, data_dir: Path, *, url: str | None = None) -> DataDirLock:
        """Take the lock now or raise :class:`DataDirInUse` naming the holder; never waits."""
        path = Path(data_dir) / LOCK_NAME
        if fcntl is None:  # pragma: no cover - Windows
            log.warning("no fcntl on this platform: nothing stops a second service on %s", data_dir)
            return cls(path, None)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise DataDirInUse(Path(data_dir), holder) from None
        except BaseException:
            os.close(fd)
            raise
        lock = cls(path, fd)
        lock.holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        lock.announce(url)
        return lock

    def announce(self, url: str | None) -> None:
        """Name the URL this holder serves in the lock file (readers join a service by it: ``serve``
        names it once its port is bound and its start secret written)."""
        holder = dict(self.holder)
        if url:
            holder["url"] = url
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, json.dumps(holder).encode() + b"\n", 0)

    def release(self) -> None:
        """Give the data dir up (idempotent). The file stays; its next owner rewrites it."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock


def _read_holder(fd: int) -> dict:
    """What the holder wrote, or {} when it has not written yet (it locks first, then writes)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
