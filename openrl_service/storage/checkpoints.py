"""Checkpoints on disk: ``tinker://<run>/<kind>/<name>`` ↔ a folder under the tenant's own root.

Layout (every name below is chosen by the service, never by a client):

    <data>/tenants/<tenant>/runs/<run-dir>/run.json                 run metadata
    <data>/tenants/<tenant>/runs/<run-dir>/<kind>/<name>/
        adapter_model.safetensors   PEFT layout, loadable by PEFT and vLLM
        adapter_config.json
        optimizer.safetensors       ("weights" checkpoints only: AdamW moments and step)
        manifest.json               kind, run, base model, LoRA spec, steps, file digests

A checkpoint is written into a temporary folder beside its final place and renamed into it, so a
reader never sees a half-written one. Only safetensors and JSON are read back: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from openrl_service.config import TENANT_RE
from openrl_service.errors import NotFound, UserError

KINDS = ("weights", "sampler_weights")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._-]{0,127}$")
MANIFEST_VERSION = 1


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
            f"{field}: expected tinker://<run_id>/<weights|sampler_weights>/<name>; got {path!r}", field=field
        )
    return CheckpointRef(parts[0], parts[1], check_name(parts[2], field))


def _digest(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class CheckpointStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    # -- locations ---------------------------------------------------------------------------
    def _tenant_root(self, tenant: str) -> Path:
        if not TENANT_RE.match(tenant):  # tenant names come from the key configuration, checked there too
            raise ValueError(f"invalid tenant name {tenant!r}")
        return self.root / "tenants" / tenant

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
        _atomic_write_text(d / "run.json", json.dumps(meta, indent=2, sort_keys=True))

    def read_run_meta(self, tenant: str, run_id: str) -> dict | None:
        p = self.run_dir(tenant, run_id) / "run.json"
        try:
            return json.loads(p.read_text()) if p.is_file() else None
        except OSError:
            return None

    # -- checkpoints ----------------------------------------------------------------------------
    def exists(self, tenant: str, ref: CheckpointRef) -> bool:
        return (self._ckpt_dir(tenant, ref) / "manifest.json").is_file()

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
        final = self._ckpt_dir(tenant, ref)
        if final.exists() and not overwrite:
            raise UserError(
                f"checkpoint {ref.path} already exists; pass overwrite=True to replace it", field="path"
            )
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{ref.name}.tmp-"))
        try:
            save_file(adapter, str(tmp / "adapter_model.safetensors"))
            (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
            if optimizer is not None:
                save_file(optimizer, str(tmp / "optimizer.safetensors"))
            files = {p.name: _digest(p) for p in sorted(tmp.iterdir())}
            full = {
                "format_version": MANIFEST_VERSION,
                "kind": ref.kind,
                "name": ref.name,
                "run_id": ref.run_id,
                "tinker_path": ref.path,
                "created_at": time.time(),
                "has_optimizer": optimizer is not None,
                "files": files,
                **manifest,
            }
            (tmp / "manifest.json").write_text(json.dumps(full, indent=2, sort_keys=True))
            _fsync_dir(tmp)
            if final.exists():
                trash = final.parent / f".{ref.name}.old-{os.getpid()}-{time.monotonic_ns()}"
                os.replace(final, trash)
                os.replace(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final

    def manifest(self, tenant: str, ref: CheckpointRef) -> dict:
        """The checkpoint's manifest alone (cheap: no tensors); NotFound for foreign or absent ones."""
        try:
            return json.loads((self._ckpt_dir(tenant, ref) / "manifest.json").read_text())
        except (OSError, ValueError):
            raise NotFound(f"checkpoint {ref.path} not found", field="path") from None

    def load(
        self, tenant: str, ref: CheckpointRef, *, with_optimizer: bool = False
    ) -> tuple[dict, dict, dict | None]:
        """(manifest, adapter tensors, optimizer tensors or None); NotFound for foreign or absent ones."""
        manifest = self.manifest(tenant, ref)
        d = self._ckpt_dir(tenant, ref)
        adapter = load_file(str(d / "adapter_model.safetensors"))
        optimizer = None
        if with_optimizer:
            opath = d / "optimizer.safetensors"
            if not opath.is_file():
                raise UserError(
                    f"checkpoint {ref.path} holds no optimizer state (it is a {ref.kind} checkpoint); "
                    "load it without the optimizer",
                    field="path",
                )
            optimizer = load_file(str(opath))
        return manifest, adapter, optimizer

    def folder(self, tenant: str, ref: CheckpointRef) -> Path:
        d = self._ckpt_dir(tenant, ref)
        if not (d / "manifest.json").is_file():
            raise NotFound(f"checkpoint {ref.path} not found", field="path")
        return d


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _fsync_dir(d: Path) -> None:
    for p in d.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
