"""The recovery journal's files: checksummed records in numbered segments, and snapshots.

Layout under ``<data>/journal/``::

    seg-00000007.log     records appended since snapshot 7 (the newest segment is the open one)
    snap-00000007.bin    the service's state when segment 7 began (one record)

A record is ``MAGIC (4) | version (1) | payload length (4) | crc32 of the payload (4) | payload``.
The payload is a pickle that only :class:`_Loader` reads back: it builds plain containers, numpy
arrays and the few service data classes named in ``_ALLOWED``, nothing else (no function, no module
of a user). A record whose header or checksum does not match ends its segment: a torn last write
(a crash mid-``write``) is dropped, never misread.

Appends go to the OS at once (``write``), so a full disk refuses the request that could not be
recorded (:class:`JournalFull`); :meth:`Journal.sync` makes everything appended so far durable
(one ``fsync`` for every request that waits on it: group commit). A request is acknowledged only
after the sync that covers it.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from openrl_common.files import fsync_dir, write_atomic

log = logging.getLogger(__name__)

MAGIC = b"ORJ\x01"
VERSION = 2  # the frame version written: 2 = records as versioned dicts (engine/records.py)
READS = (1, 2)  # 1: the first release's records (tuples, their data classes pickled)
HEADER = struct.Struct("<4sBII")  # magic, version, payload length, crc32
# No room: the volume is full, a quota is reached, or the file may not grow (RLIMIT_FSIZE).
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

_ALLOWED = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("openrl_service.training.trainer", "ForwardResult"),
    ("openrl_service.training.trainer", "DatumArrays"),
    ("openrl_service.training.trainer", "AdamParams"),
    ("openrl_service.training.lora", "LoraSpec"),
    ("openrl_service.sampling.base", "SamplingParams"),
    ("openrl_service.sampling.base", "SampleJob"),
    ("openrl_service.sampling.base", "SampleOutput"),
    ("openrl_service.sampling.base", "SampledSequence"),
}
_NUMPY = {"_reconstruct", "_frombuffer", "ndarray", "dtype", "scalar"}


class JournalFormatError(RuntimeError):
    """A whole, checksummed record of a format this release does not read (a newer release wrote it)."""


class JournalFull(OSError):
    """The disk (or the journal's volume) is full: the request was not recorded, so not accepted."""


class _Loader(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module.split(".")[0] == "numpy" and name in _NUMPY):
            return super().find_class(module, name)
        if module.startswith("numpy.dtypes") and name.endswith("DType"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"journal: {module}.{name} is not a journal type")


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def loads(data: bytes) -> Any:
    return _Loader(io.BytesIO(data)).load()


def frame(obj: Any) -> bytes:
    payload = dumps(obj)
    return HEADER.pack(MAGIC, VERSION, len(payload), zlib.crc32(payload)) + payload


def read_records(path: Path) -> Iterator[Any]:
    """The records of one file in order; stops (with a warning) at the first torn or corrupt one."""
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at < len(data):
        head = data[at : at + HEADER.size]
        if len(head) < HEADER.size:
            log.warning("journal %s: a torn record header at byte %d was dropped", path.name, at)
            return
        magic, version, length, crc = HEADER.unpack(head)
        payload = data[at + HEADER.size : at + HEADER.size + length]
        if magic == MAGIC and version not in READS and len(payload) == length and zlib.crc32(payload) == crc:
            raise JournalFormatError(
                f"journal {path}: the record at byte {at} is of format {version}, and this release reads "
                f"formats {', '.join(map(str, READS))}: a newer release wrote it. Start that release (or a "
                "later one) on this data dir; nothing was changed"
            )
        if magic != MAGIC or version not in READS or len(payload) < length or zlib.crc32(payload) != crc:
            why = "a torn last record" if len(payload) < length else "a record failing its checksum"
            if magic != MAGIC or version not in READS:
                why = f"a record of another format (version {version})"
            log.warning("journal %s: %s at byte %d; it and what follows were dropped", path.name, why, at)
            return
        yield loads(payload)
        at += HEADER.size + length


class Journal:
    """Append-only segments with group commit, snapshots, and compaction behind each snapshot."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # appends and rotation
        self._sync_lock = threading.Lock()  # one fsync at a time; waiters share it
        self._file: io.BufferedWriter | None = None
        self.segment = 0
        self.appended = 0  # records appended (this process)
        self.synced = 0  # records known durable

    # -- naming ---------------------------------------------------------------------------------
    def _seg(self, n: int) -> Path:
        return self.folder / f"seg-{n:08d}.log"

    def _snap(self, n: int) -> Path:
        return self.folder / f"snap-{n:08d}.bin"

    def snapshot_tensors(self, n: int) -> Path:
        """Snapshot ``n``'s tensors (safetensors), beside it; absent when it has none."""
        return self.folder / f"snap-{n:08d}.tensors"

    def _numbers(self, prefix: str) -> list[int]:
        out = []
        suffix = {"snap": ".bin", "seg": ".log"}[prefix]
        for p in self.folder.glob(f"{prefix}-*{suffix}"):
            stem = p.name.split("-", 1)[1].split(".", 1)[0]
            if stem.isdigit() and not p.name.endswith(".tmp"):
                out.append(int(stem))
        return sorted(out)

    # -- reading (recovery) ---------------------------------------------------------------------
    def latest_snapshot(self) -> tuple[int, Any] | None:
        """(n, state) of the newest readable snapshot, or None."""
        for n in reversed(self._numbers("snap")):
            records = list(read_records(self._snap(n)))
            if records:
                return n, records[0]
            log.warning("journal: snapshot %d is unreadable; trying an older one", n)
        return None

    def records_since(self, n: int) -> Iterator[Any]:
        """Every record of segments numbered n and up, in order."""
        for k in self._numbers("seg"):
            if k >= n:
                yield from read_records(self._seg(k))

    # -- writing --------------------------------------------------------------------------------
    def open(self, segment: int) -> None:
        """Append to a fresh segment ``segment`` (after recovery: one past everything on disk)."""
        with self._lock:
            self._open(segment)

    def next_segment(self) -> int:
        return max([0, *self._numbers("seg"), *self._numbers("snap")]) + 1

    def _open(self, segment: int) -> None:
        if self._file is not None:
            self._file.close()
        self.segment = segment
        self._file = open(self._seg(segment), "ab", buffering=0)  # noqa: SIM115 - held open
        fsync_dir(self.folder)

    def append(self, record: Any) -> int:
        """Write one record to the OS; returns its number for :meth:`sync`. ``JournalFull`` when the
        disk is full (the record is cut back off the segment)."""
        data = frame(record)
        with self._lock:
            if self._file is None:  # a service used without recovery (scripts, tests): a new segment
                self._open(self.next_segment())
            f = self._file
            at = f.tell()
            try:
                view = memoryview(data)
                while view:
                    view = view[f.write(view) :]
            except OSError as e:
                try:
                    f.truncate(at)
                    f.seek(at)
                except OSError:
                    pass
                if e.errno in FULL:
                    raise JournalFull(
                        e.errno, f"the journal's disk is full ({self.folder}: {e.strerror})"
                    ) from e
                raise
            self.appended += 1
            return self.appended

    def sync(self, upto: int | None = None) -> None:
        """Make every record appended so far (at least up to number ``upto``) durable."""
        upto = self.appended if upto is None else upto
        if self.synced >= upto:
            return
        with self._sync_lock:
            if self.synced >= upto:
                return  # another caller's fsync covered it
            with self._lock:
                f, target = self._file, self.appended
            if f is not None:
                try:
                    os.fsync(f.fileno())
                except OSError as e:
                    if e.errno in FULL:
                        raise JournalFull(
                            e.errno, f"the journal's disk is full ({self.folder}: {e.strerror})"
                        ) from e
                    raise
            self.synced = max(self.synced, target)

    def rotate(self) -> int:
        """Start segment n+1 for new appends (the old one made durable); returns n+1."""
        with self._sync_lock, self._lock:
            if self._file is not None:
                os.fsync(self._file.fileno())
            self.synced = self.appended
            self._open(max(self.segment + 1, self.next_segment()))
            return self.segment

    def write_snapshot(
        self, n: int, state: Any, tensors: dict | None = None, *, keep: set[str] | None = None
    ) -> int:
        """Write snapshot ``n`` atomically (temp file, fsync, rename) — its ``tensors`` first, to
        ``snap-N.tensors`` (safetensors, format 2), the state that refers to them last — then drop what
        it replaces: segments before ``n``, older snapshots, and run files (``run-*.tensors``,
        ``sampler-*.tensors``: format 3) not in ``keep``. Returns its size in bytes."""
        size = 0
        tmp = None
        if tensors:
            from safetensors.numpy import save_file

            path = self.snapshot_tensors(n)
            tmp = path.with_name(path.name + ".tmp")
            save_file(tensors, str(tmp))
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            size += path.stat().st_size
        keep = set(keep or ())
        for name in keep:
            size += (self.folder / name).stat().st_size
        data = frame(state)
        write_atomic(self._snap(n), data)  # the folder fsynced: the tensors' rename is durable too
        for k in self._numbers("seg"):
            if k < n:
                self._seg(k).unlink(missing_ok=True)
        for k in self._numbers("snap"):
            if k < n:
                self._snap(k).unlink(missing_ok=True)
        for p in self.folder.glob("snap-*.tensors"):  # older ones, and any a crash left without its snapshot
            stem = p.name.split("-", 1)[1].split(".", 1)[0]
            if stem.isdigit() and int(stem) < n:
                p.unlink(missing_ok=True)
        for pattern in ("run-*.tensors", "sampler-*.tensors"):
            for p in self.folder.glob(pattern):
                if p.name not in keep:
                    p.unlink(missing_ok=True)
        # what an interrupted snapshot left: its tensors' temporary file, or write_atomic's
        for stale in [*self.folder.glob("*.tmp"), *self.folder.glob(".snap-*")]:
            if stale != tmp:
                stale.unlink(missing_ok=True)
        return size + len(data)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    os.fsync(self._file.fileno())
                finally:
                    self._file.close()
                    self._file = None
