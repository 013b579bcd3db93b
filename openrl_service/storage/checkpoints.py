"""Checkpoints on disk: ``tinker://<run>/<kind>/<name>`` ↔ a folder under the tenant's own root.

Layout (every name below is chosen by the service, never by a client):

    <data>/tenants/<tenant>/sessions/<session-id>.json               session record
    <data>/tenants/<tenant>/runs/<run-dir>/run.json                 run metadata
    <data>/tenants/<tenant>/runs/<run-dir>/<weights|sampler_weights|external_weights>/<name>/
        adapter_model.safetensors   PEFT layout, loadable by PEFT and vLLM
        adapter_config.json
          (a full fine-tune's, lora.rank 0: model.safetensors + config.json, a Hugging Face
          folder AutoModelForCausalLM loads)
        optimizer.safetensors       ("weights" checkpoints only: AdamW moments and step)
        manifest.json               kind, run, base model, LoRA spec, steps, file digests,
                                    expires_at (TTL) and public

A checkpoint is written into a temporary folder beside its final place and renamed into it (an
overwrite swaps the two folders in one atomic exchange), so a reader sees the old or the new
checkpoint, never a half-written one or none. Loading reads every file from one opened folder and
checks it against the manifest's SHA-256: a corrupted file is refused by name. Only safetensors and JSON are read back: nothing is unpickled.
A checkpoint past its ``expires_at`` is treated as absent at once and deleted by the next sweep.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from openrl_common.files import fsync_dir, write_atomic
from openrl_service import crashpoints
from openrl_service.config import Limits, tenant_folder
from openrl_service.errors import NotFound, QuotaExceeded, UserError
from openrl_service.storage import checkpoint_read
from openrl_service.storage.checkpoint_read import Folder, identity, tensors_of, verified
from openrl_service.storage.tensorfile import write_tensors

KINDS = ("weights", "sampler_weights", "external_weights")
CHECKPOINT_TYPE = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._-]{0,127}$")
MANIFEST_VERSION = 1
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    kind: str
    name: str

    @property
    def path(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"


def weight_files(manifest: dict) -> tuple[str, str]:
    """(weights file, config file) of a checkpoint: a LoRA's PEFT pair or a full fine-tune's (rank 0)
    Hugging Face pair."""
    if (manifest.get("lora") or {}).get("rank") == 0:
        return "model.safetensors", "config.json"
    return "adapter_model.safetensors", "adapter_config.json"


def check_name(name: str, field: str = "path") -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise UserError(
            f"{field}: checkpoint name must be 1-128 characters of letters, digits, '.', '_' or '-' "
            f"and start with a letter or digit; got {name!r}",
            field=field,
        )
    return name


def parse_tinker_path(path: str, field: str = "path") -> CheckpointRef:
    """Parse ``tinker://<run_id>/<weights|sampler_weights>/<name>``; anything else is a user error."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(
            f"{field}: expected a tinker://<run_id>/<kind>/<name> path; got {path!r}", field=field
        )
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or not _RUN_RE.match(parts[0]) or parts[1] not in KINDS:
        raise UserError(
            f"{field}: expected tinker://<run_id>/<weights|sampler_weights|external_weights>/<name>; got {path!r}",
            field=field,
        )
    return CheckpointRef(parts[0], parts[1], check_name(parts[2], field))


def _folder_bytes(folder: Path) -> int:
    """The bytes of the files directly in ``folder`` (a checkpoint holds no subfolders); 0 if absent."""
    try:
        return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(folder) if e.is_file())
    except OSError:
        return 0


def _tree_bytes(folder: Path) -> int:
    """The bytes of every file under ``folder`` (an export folder's files, one level down), but those
    of folders whose names start with "." (partial builds); 0 if absent."""
    return sum(_folder_bytes(d) for d in _dirs(folder) if not d.name.startswith("."))


def file_sha256(p: Path) -> str:
    """A file's SHA-256, read in blocks."""
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class CheckpointStore:
    """Checkpoints, run metadata and session records of every tenant under one data folder.

    Listings are served from memory: a tenant's session and run records are read from disk once (on
    its first listing) and kept current by this store's own writes; a run's checkpoint listing is
    read once and dropped whenever one of its checkpoints changes. The service is the only writer
    of its data folder."""

    def __init__(self, root: str | os.PathLike, limits: Limits | None = None):
        self.root = Path(root)
        self.limits = limits  # max_checkpoint_bytes_per_tenant, read at each write (None: no quota)
        self._lock = threading.Lock()
        self._usage: dict[str, int] = {}  # tenant → checkpoint bytes on disk, counted on first need
        # tenant → id → record: what this process wrote, plus (once listed) what the disk held
        self._sessions: dict[str, dict[str, dict]] = {}
        self._runs: dict[str, dict[str, dict]] = {}
        self._listed: set[tuple[str, str]] = set()  # ("sessions" | "runs", tenant) read from disk
        self._checkpoints: dict[tuple[str, str], list[dict]] = {}  # (tenant, run id) → manifests
        self._changes = 0  # checkpoint writes so far: a listing read across one is not kept
        # told (tenant, ref) after a checkpoint is deleted: its exports go with it (engine/export.py)
        self.deleted_listeners: list = []
        # Tensor files whose SHA-256 :meth:`verify` checked on a request's thread, by the file's identity
        # (device, inode, size, times) -> the digest: a load on the device worker then reads the
        # tensors without hashing them again. A file changed since (rewritten, touched) has another
        # identity and is hashed again.
        self._hashed: OrderedDict[tuple, str] = OrderedDict()

    # -- locations ---------------------------------------------------------------------------
    def _tenant_root(self, tenant: str) -> Path:
        return self.root / "tenants" / tenant_folder(tenant)  # refuses a malformed tenant

    def run_dir(self, tenant: str, run_id: str) -> Path:
        """``:`` is not portable in file names (Windows); ``~`` never occurs in a run id, so this is 1:1."""
        if not _RUN_RE.match(run_id):
            raise NotFound(f"unknown training run {run_id!r}", field="run_id")
        return self._tenant_root(tenant) / "runs" / run_id.replace(":", "~")

    def _ckpt_dir(self, tenant: str, ref: CheckpointRef) -> Path:
        return self.run_dir(tenant, ref.run_id) / ref.kind / ref.name

    # -- runs ----------------------------------------------------------------------------------
    def write_run_meta(self, tenant: str, run_id: str, meta: dict) -> None:
        d = self.run_dir(tenant, run_id)
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / "run.json", json.dumps(meta, indent=2, sort_keys=True))
        with self._lock:
            self._runs.setdefault(tenant, {})[run_id] = dict(meta)

    def read_run_meta(self, tenant: str, run_id: str) -> dict | None:
        p = self.run_dir(tenant, run_id) / "run.json"
        with self._lock:
            known = self._runs.get(tenant, {}).get(run_id)
        if known is not None:
            return dict(known)
        try:
            return json.loads(p.read_text()) if p.is_file() else None
        except OSError:
            return None

    # -- checkpoints ----------------------------------------------------------------------------
    def exists(self, tenant: str, ref: CheckpointRef) -> bool:
        return (self._ckpt_dir(tenant, ref) / "manifest.json").is_file()

    @contextlib.contextmanager
    def _staged(self, tenant: str, ref: CheckpointRef, *, overwrite: bool, hint: str = ""):
        """A temporary folder beside ``ref``'s place; the caller fills it, then it is fsynced and
        renamed into place (over an old one: one atomic exchange, so a reader sees the old checkpoint
        or the new one, never neither). Removed on failure."""
        final = self._ckpt_dir(tenant, ref)
        if final.exists() and not overwrite:
            raise UserError(f"checkpoint {ref.path} already exists{hint}", field="path")
        self._check_quota(tenant, ref, 0, 0)  # already over: refuse before writing anything
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{ref.name}.tmp-"))
        try:
            yield tmp
            _fsync_dir(tmp)
            with self._lock:  # check and place as one step: two saves cannot both take the last room
                new, old = _folder_bytes(tmp), _folder_bytes(final)
                self._check_quota(tenant, ref, new, old, locked=True)
                if final.exists():
                    _exchange(tmp, final)  # tmp now holds the old checkpoint; removed below
                else:
                    os.replace(tmp, final)
                if tenant in self._usage:
                    self._usage[tenant] += new - old
                fsync_dir(final.parent)  # the rename survives a power cut too
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            self._changed(tenant, ref.run_id)

    def save(
        self,
        tenant: str,
        ref: CheckpointRef,
        *,
        adapter: dict[str, torch.Tensor],
        adapter_config: dict,
        optimizer: dict[str, torch.Tensor] | None,
        manifest: dict,
        overwrite: bool,
    ) -> Path:
        with self._staged(
            tenant, ref, overwrite=overwrite, hint="; pass overwrite=True to replace it"
        ) as tmp:
            weights_name, config_name = weight_files(manifest)
            write_tensors(tmp / weights_name, adapter, mode=0o644)
            (tmp / config_name).write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
            if optimizer is not None:
                write_tensors(tmp / "optimizer.safetensors", optimizer, mode=0o644)
            files = {p.name: file_sha256(p) for p in sorted(tmp.iterdir())}
            full = {
                "format_version": MANIFEST_VERSION,
                "kind": ref.kind,
                "name": ref.name,
                "run_id": ref.run_id,
                "tinker_path": ref.path,
                "created_at": time.time(),
                "has_optimizer": optimizer is not None,
                "files": files,
                "expires_at": None,
                "public": False,
                **manifest,
            }
            (tmp / "manifest.json").write_text(json.dumps(full, indent=2, sort_keys=True))
            crashpoints.hit("checkpoint_save")  # written, not yet in place (recovery tests)
        return self._ckpt_dir(tenant, ref)

    def manifest(self, tenant: str, ref: CheckpointRef) -> dict:
        """The checkpoint's manifest alone (cheap: no tensors); NotFound for foreign, absent or expired ones."""
        try:
            manifest = json.loads((self._ckpt_dir(tenant, ref) / "manifest.json").read_text())
        except (OSError, ValueError):
            raise NotFound(f"checkpoint {ref.path} not found", field="path") from None
        if _expired(manifest):
            raise NotFound(f"checkpoint {ref.path} not found (it expired)", field="path")
        return manifest

    def update_manifest(self, tenant: str, ref: CheckpointRef, **changes) -> dict:
        manifest = {**self.manifest(tenant, ref), **changes}
        # never recreates the folder: a checkpoint deleted meanwhile stays gone (FileNotFoundError)
        write_atomic(
            self._ckpt_dir(tenant, ref) / "manifest.json",
            json.dumps(manifest, indent=2, sort_keys=True),
            parents=False,
        )
        self._changed(tenant, ref.run_id)
        return manifest

    def delete(self, tenant: str, ref: CheckpointRef) -> None:
        self.manifest(tenant, ref)  # NotFound unless it is there
        d = self._ckpt_dir(tenant, ref)
        trash = d.parent / f".{ref.name}.deleted-{os.getpid()}-{time.monotonic_ns()}"
        with self._lock:
            size = _folder_bytes(d)
            os.replace(d, trash)
            if tenant in self._usage:
                self._usage[tenant] -= size
        self._changed(tenant, ref.run_id)
        shutil.rmtree(trash, ignore_errors=True)
        for listener in self.deleted_listeners:
            try:
                listener(tenant, ref)
            except Exception:  # noqa: BLE001 - the checkpoint is deleted; its exports' sweep catches up
                log.exception("after deleting %s", ref.path)

    def copy(self, tenant: str, src: CheckpointRef, dst: CheckpointRef, *, expires_at: float | None) -> dict:
        """Copy a checkpoint to another run/name (atomically); the copy is private and has its own TTL."""
        source = self.manifest(tenant, src)
        with self._staged(tenant, dst, overwrite=False) as tmp:
            for p in self._ckpt_dir(tenant, src).iterdir():
                if p.name != "manifest.json":
                    shutil.copy2(p, tmp / p.name)
            manifest = {
                **source,
                "run_id": dst.run_id,
                "kind": dst.kind,
                "name": dst.name,
                "tinker_path": dst.path,
                "created_at": time.time(),
                "expires_at": expires_at,
                "public": False,
                "copied_from": src.path,
            }
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        return manifest

    # -- listings -------------------------------------------------------------------------------
    def _changed(self, tenant: str, run_id: str) -> None:
        with self._lock:
            self._checkpoints.pop((tenant, run_id), None)
            self._changes += 1

    def list_runs(self, tenant: str) -> list[dict]:
        root = self._tenant_root(tenant) / "runs"
        return self._listing("runs", self._runs, tenant, lambda: (d / "run.json" for d in _dirs(root)))

    def _listing(self, what: str, records: dict, tenant: str, files) -> list[dict]:
        """Every record of a tenant: read from ``files()`` on the first call, from memory after it."""
        with self._lock:
            listed = (what, tenant) in self._listed
        if not listed:
            read = []
            for p in files():
                try:
                    read.append(json.loads(p.read_text()))
                except (OSError, ValueError):
                    continue
            key = "session_id" if what == "sessions" else "run_id"
            with self._lock:
                mine = records.setdefault(tenant, {})
                for record in read:  # what this process wrote meanwhile is newer than the disk read
                    mine.setdefault(record[key], record)
                self._listed.add((what, tenant))
        with self._lock:
            return [dict(r) for r in records.get(tenant, {}).values()]

    def list_checkpoints(self, tenant: str, run_id: str) -> list[dict]:
        """Live checkpoints of a run, each manifest with ``size_bytes``; expired ones are left out."""
        with self._lock:
            known = self._checkpoints.get((tenant, run_id))
            changes = self._changes
        if known is None:
            known = self._read_checkpoints(tenant, run_id)
            with self._lock:
                if self._changes == changes:  # else a checkpoint changed while we read: do not keep it
                    self._checkpoints[(tenant, run_id)] = known
        return [{**m} for m in known if not _expired(m)]

    def _read_checkpoints(self, tenant: str, run_id: str) -> list[dict]:
        out = []
        run = self.run_dir(tenant, run_id)
        for kind in KINDS:
            d = run / kind
            for ck in sorted(d.iterdir()) if d.is_dir() else ():
                if ck.name.startswith("."):
                    continue
                try:
                    m = json.loads((ck / "manifest.json").read_text())
                    size = sum(p.stat().st_size for p in ck.iterdir() if p.is_file())
                except (OSError, ValueError):
                    continue
                out.append({**m, "size_bytes": size})
        return out

    def sweep_expired(self, now: float | None = None) -> int:
        """Delete every expired checkpoint from disk; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        for mpath in self.root.glob("tenants/*/runs/*/*/*/manifest.json"):
            try:
                m = json.loads(mpath.read_text())
            except (OSError, ValueError):
                continue
            if _expired(m, now):
                shutil.rmtree(mpath.parent, ignore_errors=True)
                removed += 1
        if removed:
            with self._lock:
                self._checkpoints.clear()
                self._usage.clear()  # counted again on the next write
                self._changes += 1
        return removed

    # -- tenants ------------------------------------------------------------------------------------
    def tenant_folders(self) -> list[Path]:
        """Every tenant's folder under ``<data>/tenants`` (checkpoints, sessions, run records, jobs)."""
        return sorted(d for d in _dirs(self.root / "tenants") if not d.name.startswith("."))

    def forget_tenant(self, tenant: str, move_to: Path | None = None) -> int:
        """Remove every file of ``tenant`` (``<data>/tenants/<folder>`` and ``<data>/traces/<folder>``),
        or move them under ``move_to`` (same volume); returns the checkpoint bytes that left. The
        caller has ended the tenant's sessions and deleted its jobs."""
        folder = tenant_folder(tenant)
        with self._lock:
            freed = self._tenant_bytes_locked(tenant)
            self._sessions.pop(tenant, None)
            self._runs.pop(tenant, None)
            self._listed = {k for k in self._listed if k[1] != tenant}
            self._checkpoints = {k: v for k, v in self._checkpoints.items() if k[0] != tenant}
            self._usage.pop(tenant, None)
            self._changes += 1
            for sub in ("tenants", "traces"):
                src = self.root / sub / folder
                if not src.exists():
                    continue
                if move_to is not None and not (Path(move_to) / sub / folder).exists():
                    dst = Path(move_to) / sub / folder
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(src, dst)
                    continue
                trash = src.with_name(f".{folder}.removed-{os.getpid()}-{time.monotonic_ns()}")
                os.rename(src, trash)  # gone from every path at once; the files follow
                shutil.rmtree(trash, ignore_errors=True)
        return freed

    # -- quota --------------------------------------------------------------------------------------
    def tenant_bytes(self, tenant: str) -> int:
        """The bytes of every checkpoint ``tenant`` keeps (all runs, all kinds; expired ones until the
        sweep deletes them) and of its exports, counted from disk once and then kept current by this
        store's writes."""
        with self._lock:
            return self._tenant_bytes_locked(tenant)

    def _tenant_bytes_locked(self, tenant: str) -> int:
        if tenant not in self._usage:
            runs = self._tenant_root(tenant) / "runs"
            self._usage[tenant] = sum(
                _folder_bytes(ck)
                for run in _dirs(runs)
                for kind in KINDS
                for ck in _dirs(run / kind)
                if not ck.name.startswith(".")
            ) + _tree_bytes(self.exports_dir(tenant))
        return self._usage[tenant]

    def _check_quota(
        self,
        tenant: str,
        ref: CheckpointRef,
        new: int,
        old: int,
        *,
        locked: bool = False,
        what: str | None = None,
        field: str = "path",
    ) -> None:
        limit = self.limits.max_checkpoint_bytes_per_tenant if self.limits is not None else None
        if not limit:
            return
        used = self._tenant_bytes_locked(tenant) if locked else self.tenant_bytes(tenant)
        after = used - old + new
        if after > limit:
            raise QuotaExceeded(
                f"{what or f'checkpoint {ref.path}'} would bring this tenant's checkpoints and exports to "
                f"{after} bytes, over its quota of {limit} bytes (OPENRL_MAX_CHECKPOINT_BYTES_PER_TENANT; "
                f"{used} bytes in use): delete checkpoints you no longer need "
                "(RestClient.delete_checkpoint_from_tinker_path, "
                "DELETE /api/v1/training_runs/<run>/checkpoints/<kind>/<name>; their exports go with them) "
                "or save with a TTL",
                field=field,
            )

    # -- exports (engine/export.py builds them; their bytes count in the tenant's quota) ----------
    def exports_dir(self, tenant: str) -> Path:
        return self.root / "exports" / tenant_folder(tenant)

    def check_room(self, tenant: str, ref: CheckpointRef, need: int, *, what: str, field: str) -> None:
        """QuotaExceeded (naming the numbers) unless ``need`` more bytes fit the tenant's quota."""
        self._check_quota(tenant, ref, need, 0, what=what, field=field)

    def place_export(self, tenant: str, ref: CheckpointRef, built: Path, final: Path) -> bool:
        """Move a built export folder into place if the tenant's quota has room for it (else
        QuotaExceeded, naming the numbers); False when another request placed it first."""
        with self._lock:
            if final.exists():
                return False
            new = _folder_bytes(built)
            self._check_quota(
                tenant, ref, new, 0, locked=True, what=f"an export of {ref.path}", field="tinker_path"
            )
            try:
                built.rename(final)
            except OSError:
                return False
            if tenant in self._usage:
                self._usage[tenant] += new
            return True

    def remove_export(self, tenant: str | None, folder: Path) -> None:
        """Remove an export folder (``tenant`` None: one whose folder name does not say; every tenant is
        counted again on its next need)."""
        trash = folder.with_name(f".{folder.name}.removed-{os.getpid()}-{time.monotonic_ns()}")
        with self._lock:
            size = _folder_bytes(folder)
            try:
                os.replace(folder, trash)
            except OSError:
                return
            if tenant is None:
                self._usage.clear()
            elif tenant in self._usage:
                self._usage[tenant] -= size
        shutil.rmtree(trash, ignore_errors=True)

    # -- sessions -------------------------------------------------------------------------------
    def write_session(self, tenant: str, record: dict) -> None:
        d = self._tenant_root(tenant) / "sessions"
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / f"{record['session_id']}.json", json.dumps(record, indent=2, sort_keys=True))
        with self._lock:
            self._sessions.setdefault(tenant, {})[record["session_id"]] = dict(record)

    def list_sessions(self, tenant: str) -> list[dict]:
        d = self._tenant_root(tenant) / "sessions"
        return self._listing(
            "sessions", self._sessions, tenant, lambda: d.glob("*.json") if d.is_dir() else ()
        )

    def read_session(self, tenant: str, session_id: str) -> dict | None:
        if not _RUN_RE.match(session_id):
            return None
        with self._lock:
            known = self._sessions.get(tenant, {}).get(session_id)
        if known is not None:
            return dict(known)
        try:
            return json.loads((self._tenant_root(tenant) / "sessions" / f"{session_id}.json").read_text())
        except (OSError, ValueError):
            return None

    def load(
        self, tenant: str, ref: CheckpointRef, *, with_optimizer: bool = False
    ) -> tuple[dict, dict, dict | None]:
        """(manifest, adapter tensors, optimizer tensors or None); NotFound for foreign or absent ones,
        UserError naming the file for one whose bytes no longer match the manifest's digest."""
        for _ in range(3):
            try:
                return self._load_once(tenant, ref, with_optimizer)
            except FileNotFoundError:  # overwritten while we read, the old copy removed: read the new one
                continue
        raise NotFound(f"checkpoint {ref.path} not found", field="path")

    def verify(self, tenant: str, ref: CheckpointRef, *, with_optimizer: bool = False) -> int:
        """Hash the checkpoint's tensor files against its manifest now, on the calling thread (a
        request's, before its load is queued), so the load on the device worker reads them without
        hashing (a full run's checkpoint is the size of the model: seconds of hashing). Returns the
        bytes hashed (0 when every file was checked already). Raises as :meth:`load` does."""
        hashed = 0
        folder, manifest = self._open(tenant, ref)
        with folder:
            digests = manifest.get("files") or {}
            names = [weight_files(manifest)[0]]
            if with_optimizer and "optimizer.safetensors" in digests:
                names.append("optimizer.safetensors")
            for name in names:
                want = digests.get(name)
                if want is None:
                    continue
                with folder.open_file(name) as f:
                    if self._already_hashed(f, want):
                        continue
                    hashed += checkpoint_read.check_digest(f, want, name, ref)
                    with self._lock:
                        self._hashed[identity(os.fstat(f.fileno()))] = want
                        while len(self._hashed) > 4096:
                            self._hashed.popitem(last=False)
        return hashed

    def _already_hashed(self, f, want: str) -> bool:
        key = identity(os.fstat(f.fileno()))
        with self._lock:
            return self._hashed.get(key) == want

    def _open(self, tenant: str, ref: CheckpointRef) -> tuple[Folder, dict]:
        """The checkpoint's folder held open (the caller closes it) and its manifest; NotFound if absent."""
        folder = Folder.open(self._ckpt_dir(tenant, ref))
        if folder is None:
            raise NotFound(f"checkpoint {ref.path} not found", field="path")
        try:
            return folder, json.loads(folder.read("manifest.json"))
        except ValueError:
            folder.__exit__(None, None, None)
            raise NotFound(f"checkpoint {ref.path} not found", field="path") from None
        except BaseException:
            folder.__exit__(None, None, None)
            raise

    def _load_once(
        self, tenant: str, ref: CheckpointRef, with_optimizer: bool
    ) -> tuple[dict, dict, dict | None]:
        # Every file comes from the one directory opened here, so a concurrent overwrite (an atomic
        # exchange of directories) cannot mix an old manifest with new tensors.
        folder, manifest = self._open(tenant, ref)
        with folder:
            if _expired(manifest):
                raise NotFound(f"checkpoint {ref.path} not found (it expired)", field="path")
            digests = manifest.get("files") or {}
            weights_name, config_name = weight_files(manifest)
            verified(folder, config_name, digests, ref)
            adapter = tensors_of(folder, weights_name, digests, ref, self._already_hashed)
            optimizer = None
            if with_optimizer:
                if "optimizer.safetensors" not in digests:
                    raise UserError(
                        f"checkpoint {ref.path} holds no optimizer state (it is a {ref.kind} checkpoint); "
                        "load it without the optimizer",
                        field="path",
                    )
                optimizer = tensors_of(folder, "optimizer.safetensors", digests, ref, self._already_hashed)
        return manifest, adapter, optimizer

    def folder(self, tenant: str, ref: CheckpointRef) -> Path:
        d = self._ckpt_dir(tenant, ref)
        if not (d / "manifest.json").is_file():
            raise NotFound(f"checkpoint {ref.path} not found", field="path")
        return d


def _exchange(a: Path, b: Path) -> None:
    """Swap two directories in one atomic step (Linux renameat2 RENAME_EXCHANGE, macOS renamex_np
    RENAME_SWAP). Elsewhere two renames, with a moment in which ``b`` is absent."""
    libc = _libc()
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2
        if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # else: this filesystem cannot
            raise OSError(err, os.strerror(err), str(b))
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rename_swap = 2
        if libc.renamex_np(os.fsencode(a), os.fsencode(b), rename_swap) == 0:
            return
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(b))
    aside = b.parent / f".{b.name}.old-{os.getpid()}-{time.monotonic_ns()}"
    os.replace(b, aside)
    os.replace(a, b)
    os.replace(aside, a)


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def _dirs(root: Path):
    return (d for d in root.iterdir() if d.is_dir()) if root.is_dir() else ()


def _expired(manifest: dict, now: float | None = None) -> bool:
    exp = manifest.get("expires_at")
    return exp is not None and (time.time() if now is None else now) >= exp


def _fsync_dir(d: Path) -> None:
    for p in d.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
