"""External weights uploads (Tinker 0.39's ``RestClient.external_weights_upload_start`` / ``_finish``): a
PEFT adapter trained elsewhere comes in as an ``external_weights`` checkpoint, which then samples (``/v1``,
a sampling client) or trains (``load_state``, ``load_from``) like one saved here.

    POST /api/v1/external_weights_upload_start  {base_model, lora_config, destination_project_id?}
        → {upload_id, urls: {adapter_model.safetensors: url, adapter_config.json: url}, expires}
    PUT  <url>                                   each file's bytes (the URL is the capability)
    POST /api/v1/external_weights_upload_finish {upload_id} → {tinker_path}

The files are what ``save_weights_external`` exports for that base model and LoRA configuration; finish
refuses anything else naming the tensor and the shapes (the foreign-adapter check). A file's bytes go to
disk as they arrive, bounded by the adapter's exact size (plus its header), so an upload never holds
memory; an unfinished upload is forgotten after ``UPLOAD_TTL_S`` or a restart (start again).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import load_file

from openrl_service.config import tenant_folder
from openrl_service.errors import Gone, NotFound, PayloadTooLarge, UserError
from openrl_service.storage.checkpoints import CheckpointRef
from openrl_service.training.lora import LoraSpec, check_peft_shapes, peft_shapes

UPLOAD_TTL_S = 3600.0
MAX_OPEN_UPLOADS = 4  # per tenant: each holds a staging folder
CONFIG_MAX_BYTES = 64 * 1024
HEADER_SLACK_BYTES = 1 << 20  # a safetensors header names every tensor
FILES = ("adapter_model.safetensors", "adapter_config.json")


@dataclass
class Upload:
    upload_id: str
    tenant: str
    base_model: str
    spec: LoraSpec
    folder: Path
    expires_at: float
    limits: dict[str, int]  # file -> most bytes it may have
    project_id: str | None


def _spec(raw: Any, max_rank: int) -> LoraSpec:
    if not isinstance(raw, dict):
        raise UserError(
            "lora_config must be an object {rank, seed?, train_unembed, train_mlp, train_attn}",
            field="lora_config",
        )
    rank = raw.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise UserError(
            f"lora_config.rank must be an integer in [1, {max_rank}] (OPENRL_MAX_RANK); got {rank!r}",
            field="lora_config.rank",
        )
    flags = {}
    for key in ("train_unembed", "train_mlp", "train_attn"):
        value = raw.get(key, True)
        if not isinstance(value, bool):
            raise UserError(
                f"lora_config.{key} must be true or false; got {value!r}", field=f"lora_config.{key}"
            )
        flags[key] = value
    if not any(flags.values()):
        raise UserError(
            "lora_config: at least one of train_unembed, train_mlp, train_attn must be true",
            field="lora_config",
        )
    return LoraSpec(rank=rank, **flags)


class Uploads:
    """The open uploads of every tenant, and the three steps of one."""

    def __init__(self, svc: Any, sign: Any):
        self.svc = svc
        self.sign = sign  # the catalog's URL signer (the same secret as its downloads)
        self.root = Path(svc.store.root) / "uploads"
        self._open: dict[str, Upload] = {}
        self._lock = threading.Lock()

    def _sweep(self, now: float) -> None:
        with self._lock:
            gone = [u for u in self._open.values() if u.expires_at < now]
            for u in gone:
                self._open.pop(u.upload_id, None)
        for u in gone:
            shutil.rmtree(u.folder, ignore_errors=True)

    def start(self, tenant: str, body: dict, base_url: str) -> dict:
        now = time.time()
        self._sweep(now)
        model = self.svc.served(body.get("base_model"), "base_model")
        spec = _spec(body.get("lora_config"), self.svc.limits.max_rank)
        project = body.get("destination_project_id")
        if project is not None and not (isinstance(project, str) and 0 < len(project) <= 128):
            raise UserError(
                "destination_project_id must be a string of 1-128 characters", field="destination_project_id"
            )
        shapes = peft_shapes(spec, model.base.targets)
        weights_bytes = sum(4 * a * b for a, b in shapes.values()) + HEADER_SLACK_BYTES  # float32 at most
        with self._lock:
            mine = sum(u.tenant == tenant for u in self._open.values())
            if mine >= MAX_OPEN_UPLOADS:
                raise UserError(
                    f"at most {MAX_OPEN_UPLOADS} uploads may be open at once; finish one (or wait "
                    f"{UPLOAD_TTL_S:.0f} s for it to expire)",
                    field="upload_id",
                )
            upload_id = f"upl-{secrets.token_hex(12)}"
            folder = self.root / tenant_folder(tenant) / upload_id
            folder.mkdir(parents=True, mode=0o700)
            up = Upload(
                upload_id,
                tenant,
                model.name,
                spec,
                folder,
                now + UPLOAD_TTL_S,
                {FILES[0]: weights_bytes, FILES[1]: CONFIG_MAX_BYTES},
                project,
            )
            self._open[upload_id] = up
        urls = {
            f: f"{base_url}/api/v1/uploads/{self.sign({'what': 'upload', 'tenant': tenant, 'upload': upload_id, 'file': f, 'exp': up.expires_at})}"
            for f in FILES
        }
        expires = dt.datetime.fromtimestamp(up.expires_at, dt.timezone.utc).isoformat().replace("+00:00", "Z")
        return {"upload_id": upload_id, "urls": urls, "expires": expires}

    def target(self, payload: dict) -> tuple[Upload, str]:
        """The upload and file a signed URL's payload names (404 once the upload is finished or gone)."""
        with self._lock:
            up = self._open.get(payload.get("upload", ""))
        if up is None or up.tenant != payload.get("tenant") or payload.get("file") not in FILES:
            raise NotFound(
                "unknown upload (finished, expired, or the service restarted): start again", field="url"
            )
        if time.time() > up.expires_at:
            raise Gone("this upload has expired; start again", field="url")
        return up, payload["file"]

    async def receive(self, up: Upload, name: str, chunks: Any) -> int:
        """Write one file as its chunks arrive (an async iterator of bytes), refusing more than its
        bound (413 naming the numbers) without reading further; the file appears whole or not at all."""
        limit = up.limits[name]
        tmp = up.folder / f".{name}.part"
        size = 0
        try:
            with open(tmp, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(
                            f"{name}: more than {limit:,} bytes, the most a rank-{up.spec.rank} adapter on "
                            f"{up.base_model} can take",
                            field="body",
                        )
                    f.write(chunk)
            os.replace(tmp, up.folder / name)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    def finish(self, tenant: str, body: dict) -> dict:
        upload_id = body.get("upload_id")
        with self._lock:
            up = self._open.get(upload_id) if isinstance(upload_id, str) else None
        if up is None or up.tenant != tenant:
            raise NotFound(
                f"unknown upload {str(upload_id)[:80]!r} (finished, expired, or never started)",
                field="upload_id",
            )
        missing = [f for f in FILES if not (up.folder / f).is_file()]
        if missing:
            raise UserError(
                f"upload_id: {', '.join(missing)} not uploaded yet (PUT it to its URL)", field="upload_id"
            )
        try:
            config = json.loads((up.folder / FILES[1]).read_text())
        except (OSError, ValueError) as e:
            raise UserError(
                f"adapter_config.json is not JSON ({type(e).__name__})", field="adapter_config.json"
            ) from None
        if not isinstance(config, dict) or config.get("r") != up.spec.rank:
            got = config.get("r") if isinstance(config, dict) else None
            raise UserError(
                f"adapter_config.json: r is {got!r}; the upload was started with lora_config.rank {up.spec.rank}",
                field="adapter_config.json",
            )
        model = self.svc.served(up.base_model, "base_model")
        weights = str(up.folder / FILES[0])
        try:
            with safe_open(weights, "pt") as f:
                shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        except Exception as e:  # noqa: BLE001 - an unreadable file is the caller's bad input
            raise UserError(
                f"adapter_model.safetensors is not a safetensors file ({type(e).__name__})",
                field="adapter_model.safetensors",
            ) from None
        check_peft_shapes(
            up.spec, model.base.targets, shapes, model=up.base_model, field="adapter_model.safetensors"
        )
        tensors = {k: v.float() for k, v in load_file(weights).items()}
        run_id = f"upload-{up.upload_id.removeprefix('upl-')}"
        ref = CheckpointRef(run_id, "external_weights", "uploaded")
        now = time.time()
        self.svc.store.write_run_meta(
            tenant,
            run_id,
            {
                "run_id": run_id,
                "tenant": tenant,
                "session_id": None,
                "base_model": up.base_model,
                "lora": up.spec.to_json(),
                "seed": None,
                "created_at": now,
                "user_metadata": {"openrl.upload": up.upload_id},
                "project_id": up.project_id,
            },
        )
        self.svc.store.save(
            tenant,
            ref,
            adapter=tensors,
            adapter_config=config,
            optimizer=None,
            manifest={
                "base_model": up.base_model,
                "lora": up.spec.to_json(),
                "seed": None,
                "steps": 0,
                "user_metadata": None,
            },
            overwrite=False,
        )
        with self._lock:
            self._open.pop(up.upload_id, None)
        shutil.rmtree(up.folder, ignore_errors=True)
        return {"tinker_path": ref.path}
