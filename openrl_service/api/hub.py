"""A Hugging Face hub mirror of the served models' tokenizers, so ``get_tokenizer()`` works offline.

Clients set ``HF_ENDPOINT=http://<service>`` (before ``huggingface_hub`` is imported) and
``HF_TOKEN=<their API key>`` (sent as ``Authorization: Bearer``); ``AutoTokenizer.from_pretrained(
"<served model name>")`` then downloads from here. Three hub routes are enough for
``huggingface_hub`` 1.x and 2.x (see tinker-protocol.md §10):

    GET       /api/models/{repo}[/revision/{rev}]      model info: sha + siblings
    GET       /api/models/{repo}/tree/{rev}[/{path}]   a JSON list of files
    HEAD/GET  /{repo}/resolve/{rev}/{file}             the file, with X-Repo-Commit and ETag

``{repo}`` is ``org/name`` or ``name``: the name of one of the served models. Only tokenizer and config files are served, never weights.
The commit sha is the SHA-1 of the served files (names and bytes), so it is stable across restarts
and changes when a file does. Errors carry ``X-Error-Code`` (RepoNotFound, RevisionNotFound,
EntryNotFound) because that is how the hub client tells an absent optional file from a failure.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from openrl_service.api.http import json_response
from openrl_service.engine.service import TrainingService
from openrl_service.models.loading import BaseModel
from openrl_service.models.tiny import tiny_folder_name, tiny_variant

log = logging.getLogger("openrl_service")

# What a tokenizer (or AutoConfig) may read. Anything else, weights above all, is never served.
SERVED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
CHAT_TEMPLATE_DIR = "additional_chat_templates"
TIMESTAMP = "2026-01-01T00:00:00.000Z"  # the hub client parses it; the mirror has no history


def git_blob_sha1(data: bytes) -> str:
    """The id git (and the hub, for non-LFS files) gives a file's bytes: the ETag clients expect."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Snapshot:
    repo: str
    sha: str
    files: dict[str, bytes]  # repo path -> bytes
    oids: dict[str, str]


def _collect(folder: Path) -> dict[str, bytes]:
    files = {}
    for name in SERVED_FILES:
        path = folder / name
        if path.is_file():
            files[name] = path.read_bytes()
    templates = folder / CHAT_TEMPLATE_DIR
    if templates.is_dir():
        for path in sorted(templates.glob("*.jinja")):
            if path.is_file():
                files[f"{CHAT_TEMPLATE_DIR}/{path.name}"] = path.read_bytes()
    return files


def _save_tokenizer(base, target: Path) -> Path:
    """Write the loaded tokenizer (and the model config, minus quantisation) once; reuse it later."""
    if (target / "tokenizer_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".hub-"))
    try:
        base.tokenizer.save_pretrained(staging)
        config = getattr(base.model, "config", None)
        if config is not None and not (staging / "config.json").exists():
            data = json.loads(config.to_json_string(use_diff=False))
            data.pop("quantization_config", None)  # a GGUF model is dequantised once loaded
            data["_name_or_path"] = base.name
            (staging / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        try:
            os.replace(staging, target)
        except OSError:  # another thread or process wrote it first
            pass
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def tokenizer_folder(svc: TrainingService, base: BaseModel | None = None) -> Path:
    """Where a served model's tokenizer files live (default: the default model's): its own folder,
    or a cache the mirror fills."""
    base = base or svc.require_ready()
    source = str(base.source)
    safe = base.name.replace("/", "--")
    if base.tools_template:  # the folder's template lacks the tools block the service installed
        digest = hashlib.sha256(base.tokenizer.chat_template.encode()).hexdigest()[:12]
        return _save_tokenizer(base, Path(svc.settings.data_dir) / "hub" / f"{safe}-tools-{digest}")
    if tiny_variant(source):
        folder = Path(svc.settings.data_dir) / "models" / tiny_folder_name(tiny_variant(source))
        if (folder / "tokenizer_config.json").is_file():
            return folder
    elif not source.endswith(".gguf"):
        folder = Path(source).expanduser()
        if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
            return folder
    return _save_tokenizer(base, Path(svc.settings.data_dir) / "hub" / safe)


def build_snapshot(svc: TrainingService, base: BaseModel | None = None) -> Snapshot:
    base = base or svc.require_ready()
    files = _collect(tokenizer_folder(svc, base))
    h = hashlib.sha1()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return Snapshot(
        repo=base.name, sha=h.hexdigest(), files=files, oids={n: git_blob_sha1(b) for n, b in files.items()}
    )


def _error(status: int, code: str, message: str) -> Response:
    return Response(
        json.dumps({"error": message}).encode(),
        status_code=status,
        media_type="application/json",
        # Names in the message come from the URL: repr() and ASCII keep the header well-formed.
        headers={
            "X-Error-Code": code,
            "X-Error-Message": message.encode("ascii", "backslashreplace").decode(),
        },
    )


def build_hub_router(svc: TrainingService) -> APIRouter:
    r = APIRouter(tags=["hub mirror"])
    lock = threading.Lock()
    cached: dict[str, Snapshot] = {}  # model name -> its snapshot, built on first use

    def lookup(repo: str, revision: str | None) -> Snapshot | Response:
        svc.require_ready()
        model = svc.models.get(repo)
        if model is None:
            served = ", ".join(repr(n) for n in svc.models)
            return _error(404, "RepoNotFound", f"Repository {repo!r} not found: this service serves {served}")
        with lock:
            if repo not in cached:
                cached[repo] = build_snapshot(svc, model.base)
            snap = cached[repo]
        if revision not in (None, "main", snap.sha):
            return _error(404, "RevisionNotFound", f"Revision {revision!r} not found in {repo!r}")
        return snap

    def model_info(repo: str, revision: str | None) -> Response:
        snap = lookup(repo, revision)
        if isinstance(snap, Response):
            return snap
        return json_response(
            {
                "_id": snap.sha[:24],
                "id": snap.repo,
                "modelId": snap.repo,
                "author": snap.repo.split("/")[0] if "/" in snap.repo else None,
                "sha": snap.sha,
                "lastModified": TIMESTAMP,
                "createdAt": TIMESTAMP,
                "private": False,
                "disabled": False,
                "gated": False,
                "downloads": 0,
                "likes": 0,
                "tags": ["transformers"],
                "library_name": "transformers",
                "pipeline_tag": "text-generation",
                "siblings": [{"rfilename": name} for name in sorted(snap.files)],
            }
        )

    def tree(repo: str, revision: str, sub: str, recursive: bool) -> Response:
        snap = lookup(repo, revision)
        if isinstance(snap, Response):
            return snap
        prefix = sub.strip("/")
        prefix = f"{prefix}/" if prefix else ""
        entries, dirs = [], set()
        for name in sorted(snap.files):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/", 1)[0])
                continue
            entries.append(
                {"type": "file", "oid": snap.oids[name], "size": len(snap.files[name]), "path": name}
            )
        folders = [
            {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
            for d in sorted(dirs)
        ]
        return json_response(folders + entries)

    def resolve(repo: str, revision: str, filename: str) -> Response:
        snap = lookup(repo, revision)
        if isinstance(snap, Response):
            return snap
        data = snap.files.get(filename)
        if data is None:
            return _error(404, "EntryNotFound", f"{filename!r} does not exist on {revision!r} of {repo!r}")
        media = "application/json" if filename.endswith(".json") else "application/octet-stream"
        return Response(
            data,
            media_type=media,
            headers={"X-Repo-Commit": snap.sha, "ETag": f'"{snap.oids[filename]}"'},
        )

    # org/name repos
    @r.get("/api/models/{org}/{name}")
    def info2(org: str, name: str):
        return model_info(f"{org}/{name}", None)

    @r.get("/api/models/{org}/{name}/revision/{revision}")
    def info2_rev(org: str, name: str, revision: str):
        return model_info(f"{org}/{name}", revision)

    @r.get("/api/models/{org}/{name}/tree/{revision}")
    def tree2(org: str, name: str, revision: str, recursive: bool = False):
        return tree(f"{org}/{name}", revision, "", recursive)

    @r.get("/api/models/{org}/{name}/tree/{revision}/{sub:path}")
    def tree2_sub(org: str, name: str, revision: str, sub: str, recursive: bool = False):
        return tree(f"{org}/{name}", revision, sub, recursive)

    def resolve2(org: str, name: str, revision: str, filename: str):
        return resolve(f"{org}/{name}", revision, filename)

    # One route per method (each needs its own OpenAPI operation id); HEAD, bodiless by definition,
    # stays out of the schema like every framework's implicit HEAD. Auth covers both alike.
    for method in ("GET", "HEAD"):
        r.add_api_route(
            "/{org}/{name}/resolve/{revision}/{filename:path}",
            resolve2,
            methods=[method],
            operation_id=f"hub_resolve_{method.lower()}",
            include_in_schema=method == "GET",
        )

    # single-segment repos (a model served as e.g. "Qwen2.5-0.5B-Instruct")
    @r.get("/api/models/{name}")
    def info1(name: str):
        return model_info(name, None)

    @r.get("/api/models/{name}/revision/{revision}")
    def info1_rev(name: str, revision: str):
        return model_info(name, revision)

    @r.get("/api/models/{name}/tree/{revision}")
    def tree1(name: str, revision: str, recursive: bool = False):
        return tree(name, revision, "", recursive)

    def resolve1(name: str, revision: str, filename: str):
        return resolve(name, revision, filename)

    for method in ("GET", "HEAD"):
        r.add_api_route(
            "/{name}/resolve/{revision}/{filename:path}",
            resolve1,
            methods=[method],
            operation_id=f"hub_resolve_single_{method.lower()}",
            include_in_schema=method == "GET",
        )

    return r
