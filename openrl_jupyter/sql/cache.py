"""The private, verified cache of built text-to-SQL databases (``database_path``): per user, per seed;
anything another account could have planted or changed is refused or rebuilt."""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

from openrl_jupyter.sql.schemas import _SCHEMAS, GENERATOR_VERSION, SCHEMAS, _build

# -- the private cache of built databases ----------------------------------------------------------


class UnsafeCacheError(PermissionError):
    """A cache folder or file that someone else could have written: refused, never read."""


def cache_dir() -> Path:
    """Where the databases are cached by default: ``$XDG_CACHE_HOME`` (when absolute, as the XDG spec
    says) or ``~/.cache``, then ``openrl-jupyter/sql``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return root / "openrl-jupyter" / "sql"


def _refuse(path: Path, why: str) -> UnsafeCacheError:
    return UnsafeCacheError(
        f"refusing {path} for the text-to-SQL databases: {why}. Another account could plant a database "
        "there and change every reward computed from it; remove it, or use a folder only you can write "
        "(directory=...)"
    )


def _check_owner(path: Path, st: os.stat_result, *, root_ok: bool) -> None:
    uid = os.getuid()
    if st.st_uid != uid and not (root_ok and st.st_uid == 0):
        raise _refuse(path, f"it is owned by uid {st.st_uid}, not by this user (uid {uid})")


def _check_private(path: Path, st: os.stat_result) -> None:
    _check_owner(path, st, root_ok=False)
    if st.st_mode & 0o022:
        raise _refuse(path, f"it is writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o})")


_folders: dict[tuple[Path, int], tuple[Path, tuple[int, int, int, int]]] = {}  # checked: real path, stat


def _private_folder(folder: Path, made_here: int) -> Path:
    """``folder`` created (mode 0700) and checked: it and the ``made_here - 1`` folders above it (the
    ones this cache makes) are this user's and writable by no one else; every folder above them is
    this user's or root's. Its real path (symbolic links resolved: their targets are what is checked).
    Checked once per process while the folder stays the same one (only its owner or root can swap a
    folder above it, and those were checked)."""
    folder = Path(os.path.abspath(folder))
    known = _folders.get((folder, made_here))
    if known is not None:
        try:
            st = os.stat(known[0])
            if (st.st_dev, st.st_ino, st.st_uid, st.st_mode) == known[1] and os.path.realpath(folder) == str(
                known[0]
            ):
                return known[0]
        except OSError:
            pass
    for level in reversed([folder, *folder.parents][:made_here]):
        try:
            level.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except FileNotFoundError:
            level.mkdir(mode=0o700, parents=True, exist_ok=True)
    real = Path(os.path.realpath(folder))
    chain = [real, *real.parents]
    for i, level in enumerate(chain):
        st = os.stat(level)
        if i < made_here:
            if not stat.S_ISDIR(st.st_mode):
                raise _refuse(level, "it is not a folder")
            _check_private(level, st)
        else:
            _check_owner(level, st, root_ok=True)
    st = os.stat(real)
    _folders[folder, made_here] = (real, (st.st_dev, st.st_ino, st.st_uid, st.st_mode))
    return real


_cache_lock = threading.Lock()
_fallback: list[Path] = []  # this process's private temporary folder, when the cache folder cannot be made
_digests: dict[tuple[str, int], str] = {}  # (db_id, seed) -> SHA-256 of what this process builds
_verified: dict[Path, tuple[int, int, int, int]] = {}  # file -> (dev, inode, size, mtime) when last checked


def _default_folder() -> Path:
    try:
        return _private_folder(cache_dir(), made_here=2)
    except UnsafeCacheError:
        raise
    except (OSError, RuntimeError, KeyError):  # no usable home (read-only, missing, no passwd entry)
        if not _fallback:
            folder = Path(tempfile.mkdtemp(prefix="openrl-sql-"))  # 0700, a name no one can predict
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            _fallback.append(folder)
        return _fallback[0]


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def database_path(db_id: str, seed: int = 0, directory: str | os.PathLike[str] | None = None) -> Path:
    """The database file for (``db_id``, ``seed``), built on first use and cached on disk.

    This is how a job (or a detached run) gets the databases back: rebuilt from the seed, not shipped.
    The cache is this user's: ``directory``, by default :func:`cache_dir` (``~/.cache/openrl-jupyter/sql``;
    a private temporary folder of this process when that cannot be made). Its folder is created mode
    0700 and files are written mode 0600 and atomically. A folder or file that another account owns or
    could write, or a file that is a symbolic link, is refused (:class:`UnsafeCacheError`, naming the
    path and why). A cached file is used only when its SHA-256 is that of the database this process
    builds from the seed (checked on first use, and again whenever the file changes); anything else,
    e.g. a file of an older generator, is rebuilt in its place.
    """
    if db_id not in _SCHEMAS:
        raise ValueError(f"db_id must be one of {', '.join(SCHEMAS)}, got {db_id!r}")
    seed = int(seed)
    with _cache_lock:
        folder = _default_folder() if directory is None else _private_folder(Path(directory), made_here=1)
        path = folder / f"{db_id}-v{GENERATOR_VERSION}-seed{seed}.sqlite"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat.S_ISLNK(st.st_mode):
                raise _refuse(path, f"it is a symbolic link (to {os.readlink(path)})")
            if not stat.S_ISREG(st.st_mode):
                raise _refuse(path, "it is not a regular file")
            _check_private(path, st)
            if _verified.get(path) == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns):
                return path
        fresh = None
        if (db_id, seed) not in _digests:
            fresh = _build(db_id, seed, folder)
            _digests[db_id, seed] = _sha256(fresh)
        try:
            if st is None or _sha256(path) != _digests[db_id, seed]:
                os.replace(fresh or _build(db_id, seed, folder), path)
                fresh = None
        finally:
            if fresh is not None:
                fresh.unlink(missing_ok=True)
        st = os.lstat(path)
        _verified[path] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return path
