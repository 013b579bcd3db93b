"""Exports: a checkpoint as a folder other tools load, built by the service and downloaded through the API
(``POST /api/v1/exports``; ``openrl-service export`` and ``run.export`` download it, needing neither
torch nor the base weights).

    peft     adapter_model.safetensors (the checkpoint's bytes) + adapter_config.json: what
             ``PeftModel.from_pretrained(base, DIR)`` and ``vllm serve --enable-lora --lora-modules``
             load
    merged   a Hugging Face model folder: the base weights with the adapter added in
             (W + s·B·A, in fp32, stored in the base's dtype), config, generation config and
             tokenizer: what ``AutoModelForCausalLM.from_pretrained(DIR)`` loads. An adapter on an
             ``lm_head`` tied to the input embeddings unties them (``tie_word_embeddings: false``) so
             the embeddings keep the base's values and only the output layer changes.

Both carry ``openrl_export.json``: the checkpoint, the base model's name and source, and the SHA-256 of
the exact base weights the adapter was trained on (as the service holds them: a GGUF base is
dequantised, so its digest is not the digest of the model it names). Exports live under
``<data>/exports/<tenant>/`` for an hour (their download links' lifetime); a tenant keeps at most
``MAX_PER_TENANT``, the oldest going first. Their bytes count in the tenant's checkpoint quota
(OPENRL_MAX_CHECKPOINT_BYTES_PER_TENANT); deleting the checkpoint removes its exports, and a link to an
export answers only while its checkpoint is the one it was built from (not deleted, expired or
overwritten).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from openrl_service.config import folder_tenant
from openrl_service.engine import inference
from openrl_service.engine.state import ServedModel, spec_from_manifest
from openrl_service.errors import NotFound, UserError
from openrl_service.storage.checkpoints import file_sha256, parse_tinker_path
from openrl_service.storage.tensorfile import Deferred, write_tensors

log = logging.getLogger(__name__)

EXPORT_TTL_S = 3600.0
MAX_PER_TENANT = 4
FORMAT_VERSION = 1


def base_state(model: ServedModel) -> dict[str, torch.Tensor]:
    """The base model's weights under their Hugging Face names: the router's record of the base's own
    tensors, never the modules' slots (a neighbour's full run is swapped into those during its ops)."""
    return dict(model.base.router.base_weights)


class Exports:
    def __init__(self, svc: Any):  # the TrainingService (typed loosely: it imports this module)
        self.svc = svc
        self.store = svc.store
        self.root = Path(svc.store.root) / "exports"
        svc.sweepers.append(self.sweep)
        svc.tenant_forgetters.append(
            lambda tenant: shutil.rmtree(self._tenant_dir(tenant), ignore_errors=True)
        )
        svc.store.deleted_listeners.append(self.forget_checkpoint)
        self._lock = threading.Lock()
        self._builds: dict[str, threading.Lock] = {}  # tenant -> held while one of its exports is built

    def _tenant_dir(self, tenant: str) -> Path:
        return self.store.exports_dir(tenant)

    def folder(self, tenant: str, export_id: str) -> Path:
        if not export_id.isalnum():
            raise NotFound("unknown export", field="url")
        return self._tenant_dir(tenant) / export_id

    def current(self, tenant: str, export_id: str) -> Path:
        """The export's folder while its checkpoint is still the one it was built from (else 404: a
        link to an export ends when its checkpoint is deleted, expires or is overwritten)."""
        folder = self.folder(tenant, export_id)
        try:
            info = json.loads((folder / "openrl_export.json").read_text())
        except (OSError, ValueError):
            raise NotFound(
                "this export is gone (exports are kept for an hour, and go with their checkpoint); "
                "export again",
                field="url",
            ) from None
        try:
            manifest = self.store.manifest(tenant, parse_tinker_path(info["tinker_path"]))
        except NotFound:
            raise NotFound(
                f"the checkpoint {info['tinker_path']} of this export was deleted or expired: its links "
                "have ended",
                field="url",
            ) from None
        if inference.adapter_digest(manifest) != info.get("adapter_sha256"):
            raise NotFound(
                f"the checkpoint {info['tinker_path']} was overwritten since this export: its links have "
                "ended; export it again",
                field="url",
            )
        return folder

    def forget_checkpoint(self, tenant: str, ref) -> None:
        """A deleted checkpoint's exports go with it (and their bytes leave the tenant's quota)."""
        d = self._tenant_dir(tenant)
        for folder in list(d.iterdir()) if d.is_dir() else ():
            if folder.name.startswith("."):
                continue
            try:
                info = json.loads((folder / "openrl_export.json").read_text())
            except (OSError, ValueError):
                continue
            if info.get("tinker_path") == ref.path:
                self.store.remove_export(tenant, folder)

    def build(self, tenant: str, tinker_path: object, merged: object) -> tuple[str, Path, dict]:
        """(export id, its folder, its provenance) for ``tenant``'s checkpoint; reused while fresh. A
        tenant's exports are built one at a time, each only when its quota has room for it (so no
        tenant fills the disk with builds it would be refused)."""
        with self._building(tenant):
            return self._build(tenant, tinker_path, merged)

    def _building(self, tenant: str) -> threading.Lock:
        with self._lock:
            return self._builds.setdefault(tenant, threading.Lock())

    def _build(self, tenant: str, tinker_path: object, merged: object) -> tuple[str, Path, dict]:
        if not isinstance(merged, bool):
            raise UserError(
                "merged must be true (a full model folder) or false (a PEFT adapter)", field="merged"
            )
        ref, manifest, model = self.svc.inference.checkpoint(tenant, tinker_path, "tinker_path")
        spec = spec_from_manifest(manifest)
        if spec.full and not merged:
            raise UserError(
                f"merged: {ref.path} is a full fine-tune, not a LoRA adapter, so it has no PEFT export; "
                "export it with merged=true (`openrl-service export --merged`, run.export(DIR, merged=True)): "
                "a Hugging Face model folder",
                field="merged",
            )
        adapter_digest = inference.adapter_digest(manifest)
        fmt = "merged" if merged else "peft"
        export_id = hashlib.sha256(f"{ref.path}|{adapter_digest}|{fmt}".encode()).hexdigest()[:32]
        final = self._tenant_dir(tenant) / export_id
        info_file = final / "openrl_export.json"
        if info_file.is_file():
            final.touch()  # used again: the newest
            return export_id, final, json.loads(info_file.read_text())
        # the bytes it will take, before any is written: the model's for a merged (or full) one
        need = (
            sum(t.numel() * model.base.dtype.itemsize for t in base_state(model).values())
            if merged
            else (self.store.folder(tenant, ref) / "adapter_model.safetensors").stat().st_size
        )
        self.store.check_room(tenant, ref, need, what=f"an export of {ref.path}", field="tinker_path")
        info = {
            "format_version": FORMAT_VERSION,
            "format": fmt,
            "tinker_path": ref.path,
            "base_model": model.name,
            "base_model_source": model.base.source,
            "base_weights_sha256": model.base.weights_sha256,
            "base_weights_dtype": str(model.base.dtype).removeprefix("torch."),
            "base_dequantized_from_gguf": str(model.base.source).endswith(".gguf"),
            "lora": spec.to_json(),
            "adapter_sha256": adapter_digest,
            "exported_at": time.time(),
        }
        tmp = self._tenant_dir(tenant) / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir(parents=True)
        try:
            src = self.svc.store.folder(tenant, ref)
            if spec.full:
                self._full(tenant, ref, model, tmp)
            elif merged:
                self._merged(tenant, ref, model, tmp)
            else:
                shutil.copyfile(src / "adapter_model.safetensors", tmp / "adapter_model.safetensors")
                config = json.loads((src / "adapter_config.json").read_text())
                config["base_model_name_or_path"] = model.name
                config["revision"] = None
                (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            (tmp / "README.md").write_text(_card(info))
            (tmp / "openrl_export.json").write_text(json.dumps(info, indent=2, sort_keys=True))
            if not self.store.place_export(tenant, ref, tmp, final):  # QuotaExceeded if no room
                shutil.rmtree(tmp, ignore_errors=True)  # built meanwhile by another request: keep that one
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._keep_newest(tenant)
        return export_id, final, json.loads(info_file.read_text())

    def _merged(self, tenant: str, ref, model: ServedModel, out: Path) -> None:
        manifest, tensors, _ = self.svc.store.load(tenant, ref)
        spec = spec_from_manifest(manifest)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            body = key[len("base_model.model.") : -len(".weight")]
            name, _, which = body.rpartition(".")
            pairs.setdefault(name, {})[which] = t
        state = base_state(model)
        config = copy.deepcopy(model.base.model.config)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        # Each weight is made when the writer reaches it (Deferred) and dropped once written: the base's
        # own tensors are read where they are, a merged one (base + B @ A) exists one at a time, never
        # the merged model (nor, for a model on a GPU, its host copy) in memory at once.
        weights: dict[str, torch.Tensor | Deferred] = {}
        for name, value in state.items():
            weights[name] = Deferred(tuple(value.shape), value.dtype, lambda v=value: _host(v))
        for name, ab in pairs.items():
            key = f"{name}.weight"
            if key not in weights:
                raise UserError(
                    f"tinker_path: the adapter names {name!r}, which the base model lacks",
                    field="tinker_path",
                )

            def merged(w=state[key], a=ab["lora_A"], b=ab["lora_B"]) -> torch.Tensor:
                delta = (b.to(torch.float32) @ a.to(torch.float32)) * spec.scale
                return (_host(w).to(torch.float32) + delta).to(w.dtype).contiguous()

            weights[key] = Deferred(tuple(state[key].shape), state[key].dtype, merged)
        if tied:
            if "lm_head" in pairs:
                config.tie_word_embeddings = False  # the output layer changed, the embeddings did not
            else:
                weights.pop("lm_head.weight", None)  # tied again on load
        write_tensors(out / "model.safetensors", weights, metadata={"format": "pt"}, mode=0o644)
        config.save_pretrained(out)
        gen = getattr(model.base.model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(out)
        model.base.tokenizer.save_pretrained(out)

    def _full(self, tenant: str, ref, model: ServedModel, out: Path) -> None:
        """A full fine-tune's checkpoint (already the whole model) in the base's dtype, with the
        served model's config, generation config and tokenizer."""
        dtype = model.base.dtype
        src = self.svc.store.folder(tenant, ref) / "model.safetensors"
        from safetensors import safe_open

        with safe_open(str(src), framework="pt") as f:
            stored = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
        if stored == {SAFETENSORS_DTYPES.get(dtype)}:
            # already the base's dtype (a float32 model): the file as it is, copied by the OS in
            # blocks (never the model in this process's memory), and checked against the manifest
            shutil.copyfile(src, out / "model.safetensors")
            want = (self.svc.store.manifest(tenant, ref).get("files") or {}).get("model.safetensors")
            if want is not None and file_sha256(out / "model.safetensors") != want:
                raise UserError(
                    f"tinker_path: {ref.path} is corrupt: model.safetensors does not match the SHA-256 in "
                    "its manifest; save the checkpoint again",
                    field="tinker_path",
                )
        else:
            _, tensors, _ = self.svc.store.load(tenant, ref)
            weights = {n: t.to(dtype) for n, t in tensors.items()}
            write_tensors(out / "model.safetensors", weights, metadata={"format": "pt"}, mode=0o644)
        model.base.model.config.save_pretrained(out)
        gen = getattr(model.base.model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(out)
        model.base.tokenizer.save_pretrained(out)

    def _keep_newest(self, tenant: str) -> None:
        d = self._tenant_dir(tenant)
        done = sorted(
            (p for p in d.iterdir() if not p.name.startswith(".")),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        for old in done[MAX_PER_TENANT:]:
            self.store.remove_export(tenant, old)

    def sweep(self, now: float) -> None:
        """Remove exports (and abandoned partial builds) older than their links' hour, and exports
        whose checkpoint has expired or gone."""
        if not self.root.is_dir():
            return
        for tenant_dir in self.root.iterdir():
            tenant = folder_tenant(tenant_dir.name)
            for p in tenant_dir.iterdir() if tenant_dir.is_dir() else ():
                try:
                    if now - p.stat().st_mtime > EXPORT_TTL_S or (
                        tenant is not None and not p.name.startswith(".") and not self._current(tenant, p)
                    ):
                        self.store.remove_export(tenant, p)
                except FileNotFoundError:
                    continue

    def _current(self, tenant: str, folder: Path) -> bool:
        try:
            self.current(tenant, folder.name)
        except NotFound:
            return False
        return True


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _card(info: dict) -> str:
    how = (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained(DIR)\ntokenizer = AutoTokenizer.from_pretrained(DIR)\n"
        if info["format"] == "merged"
        else "from peft import PeftModel\nmodel = PeftModel.from_pretrained(base_model, DIR)\n"
        f"# base_model: {info['base_model']} (its weights' SHA-256 is in openrl_export.json)\n"
    )
    rank = info["lora"]["rank"]
    trained = "a full fine-tune" if rank == 0 else f"LoRA rank {rank}"
    return (
        f"# {info['tinker_path']}\n\n"
        f"Exported by openrl-service as a {'merged Hugging Face model' if info['format'] == 'merged' else 'PEFT LoRA adapter'} "
        f"of `{info['base_model']}` ({trained}).\n\n```python\n{how}```\n"
    )


def _host(t: torch.Tensor) -> torch.Tensor:
    """A base weight as the writer reads it: on the host, contiguous (a CPU model's own tensor, no copy)."""
    return t.detach().to("cpu").contiguous()
