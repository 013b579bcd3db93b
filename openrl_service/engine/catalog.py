"""The catalogue behind Tinker's RestClient: training runs, checkpoints and sessions of one tenant.

Everything here is read back from storage (so it survives restarts and lists runs that are no
longer loaded) and is scoped to the caller's tenant: another tenant's object is simply not found.
Downloads (external weights, session traces) go through short-lived signed URLs that carry their
own authorisation, as Tinker's do, so a plain HTTP GET fetches them.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

from openrl_service.checks import integer
from openrl_service.config import tenant_folder
from openrl_service.engine.owner import LinkRun
from openrl_service.engine.service import TrainingService
from openrl_service.engine.uploads import Uploads
from openrl_service.errors import Gone, NotFound, UserError
from openrl_service.storage.checkpoints import (
    CHECKPOINT_TYPE,
    KINDS,
    CheckpointRef,
    check_name,
    parse_tinker_path,
)
from openrl_service.training.optim_params import optimizer_config

URL_TTL_S = 3600


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def page(items: list, limit: Any, offset: Any, *, max_limit: int = 1000) -> tuple[list, dict]:
    limit = integer(limit, "limit", 1, max_limit)
    offset = integer(offset, "offset", 0, 10**9)
    return items[offset : offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


class Catalog:
    def __init__(self, svc: TrainingService):
        self.svc = svc
        self.store = svc.store
        self._secret = secrets.token_bytes(32)
        self.exports = svc.exports
        self.uploads = Uploads(svc, self._sign)

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_json(self, m: dict) -> dict:
        return {
            "checkpoint_id": f"{m['kind']}/{m['name']}",
            "checkpoint_type": CHECKPOINT_TYPE[m["kind"]],
            "time": iso(m["created_at"]),
            "tinker_path": m["tinker_path"],
            "size_bytes": m.get("size_bytes"),
            "public": bool(m.get("public", False)),
            "user_metadata": m.get("user_metadata") or None,
            "expires_at": iso(m["expires_at"]) if m.get("expires_at") else None,
            "base_model": m.get("base_model"),  # Tinker 0.39's Checkpoint.base_model
        }

    def run_checkpoints(self, tenant: str, run_id: str) -> list[dict]:
        ckpts = [self.checkpoint_json(m) for m in self.store.list_checkpoints(tenant, run_id)]
        return sorted(ckpts, key=lambda c: c["time"], reverse=True)

    def list_checkpoints(self, tenant: str, run_id: str) -> dict:
        self.training_run(tenant, run_id)
        return {"checkpoints": self.run_checkpoints(tenant, run_id)}

    def list_user_checkpoints(self, tenant: str, limit: Any, offset: Any) -> dict:
        everything = [
            c for run in self.store.list_runs(tenant) for c in self.run_checkpoints(tenant, run["run_id"])
        ]
        everything.sort(key=lambda c: (c["time"], c["tinker_path"]), reverse=True)
        items, cursor = page(everything, limit, offset)
        return {"checkpoints": items, "cursor": cursor}

    def search_checkpoints(self, tenant: str, body: dict) -> dict:
        """Tinker 0.39's search: the caller's checkpoints, newest first, filtered by type, base model,
        exact user_metadata pairs and the run's project; a page of ``limit`` (1-200, default 50) and a
        cursor for the next. Other owners' checkpoints are never visible here (``owner`` "user" finds
        none; "accessible" is the caller's own)."""
        limit = integer(body.get("limit", 50), "limit", 1, 200)
        owner = (body.get("owner") or {"type": "own"}).get("type", "own")
        if owner not in ("own", "accessible"):
            return {"checkpoints": [], "next_cursor": None}
        kind = body.get("checkpoint_type")
        if kind is not None and kind not in CHECKPOINT_TYPE.values():
            raise UserError(
                f"checkpoint_type must be one of {', '.join(CHECKPOINT_TYPE.values())} or null; got {kind!r}",
                field="checkpoint_type",
            )
        meta = body.get("user_metadata") or {}
        if not isinstance(meta, dict):
            raise UserError("user_metadata must be an object of string pairs", field="user_metadata")
        bases, projects, cursor = body.get("base_models"), body.get("project_ids"), body.get("cursor")
        runs = {r["run_id"]: r for r in self.store.list_runs(tenant)}
        sessions = {r["session_id"]: r.get("project_id") for r in self._all_sessions(tenant)}
        found = []
        for run_id, run in runs.items():
            project = sessions.get(run.get("session_id"), run.get("project_id")) or "default"
            if projects is not None and project not in projects:
                continue
            for m in self.store.list_checkpoints(tenant, run_id):
                c = self.checkpoint_json(m)
                if kind is not None and c["checkpoint_type"] != kind:
                    continue
                if bases is not None and c["base_model"] not in bases:
                    continue
                if any((c["user_metadata"] or {}).get(k) != v for k, v in meta.items()):
                    continue
                found.append(c)
        found.sort(key=lambda c: (c["time"], c["tinker_path"]), reverse=True)
        if cursor is not None:
            if not isinstance(cursor, dict):
                raise UserError("cursor must be the next_cursor of the previous page", field="cursor")
            last = (cursor.get("last_created_at"), cursor.get("last_checkpoint_uuid"))
            found = [c for c in found if (c["time"], c["tinker_path"]) < last]
        page_ = found[:limit]
        more = len(found) > limit
        next_cursor = (
            {"last_created_at": page_[-1]["time"], "last_checkpoint_uuid": page_[-1]["tinker_path"]}
            if more
            else None
        )
        return {"checkpoints": page_, "next_cursor": next_cursor}

    def ref(self, run_id: str, kind: str, name: str) -> CheckpointRef:
        if kind not in KINDS:
            raise NotFound(f"unknown checkpoint {kind}/{name}", field="checkpoint_id")
        return CheckpointRef(run_id, kind, check_name(name, "checkpoint_id"))

    def delete(self, tenant: str, run_id: str, kind: str, name: str) -> None:
        self.store.delete(tenant, self.ref(run_id, kind, name))

    def set_public(self, tenant: str, run_id: str, kind: str, name: str, public: bool) -> None:
        self.store.update_manifest(tenant, self.ref(run_id, kind, name), public=public)

    def set_ttl(self, tenant: str, run_id: str, kind: str, name: str, ttl_seconds: Any) -> None:
        self.store.update_manifest(
            tenant, self.ref(run_id, kind, name), expires_at=self.svc.checks.expiry(ttl_seconds)
        )

    def weights_info(self, tenant: str, tinker_path: Any) -> dict:
        m = self.store.manifest(tenant, parse_tinker_path(tinker_path, "tinker_path"))
        lora = m["lora"]
        return {
            "base_model": m["base_model"],
            "is_lora": lora["rank"] > 0,  # rank 0: a full fine-tune
            "lora_rank": lora["rank"] or None,
            "optimizer_config": optimizer_config(lora.get("optimizer", "adamw")),
            "train_unembed": lora["train_unembed"],
            "train_mlp": lora["train_mlp"],
            "train_attn": lora["train_attn"],
        }

    def copy(self, tenant: str, body: dict) -> dict:
        """copy_weights: into a given session's run slot, or a new session of the destination project."""
        src = parse_tinker_path(body.get("source_path"), "source_path")
        expires_at = self.svc.checks.expiry(body.get("ttl_seconds"))
        session_id, seq = body.get("session_id"), body.get("model_seq_id")
        if session_id is not None:
            sess = self.svc.session(tenant, session_id, live=False)
            seq = integer(seq, "model_seq_id", 0)
            project_id = sess.project_id
        else:
            project_id = body.get("destination_project_id")
            if not isinstance(project_id, str) or not project_id:
                raise UserError(
                    "copy_weights needs destination_project_id or session_id + model_seq_id",
                    field="destination_project_id",
                )
            sess = self.svc.create_session(tenant, project_id=project_id, display_name=f"copy of {src.path}")
            self.svc.finish_session(tenant, sess.session_id)
            session_id, seq = sess.session_id, 0
        run_id = f"{session_id}:train:{seq}"
        source = self.store.manifest(tenant, src)
        if self.store.read_run_meta(tenant, run_id) is None:
            self.store.write_run_meta(
                tenant,
                run_id,
                {
                    "run_id": run_id,
                    "tenant": tenant,
                    "session_id": session_id,
                    "base_model": source["base_model"],
                    "lora": source["lora"],
                    "seed": source.get("seed", 0),
                    "created_at": time.time(),
                    "user_metadata": {},
                    "project_id": project_id,
                    "copied_from": src.path,
                },
            )
        self.svc.owner.apply(LinkRun(sess.session_id, run_id))  # writes the session's file if it changed
        dst = CheckpointRef(run_id, src.kind, src.name)
        self.store.copy(tenant, src, dst, expires_at=expires_at)
        return {"tinker_path": dst.path}

    # -- training runs --------------------------------------------------------------------------
    def training_run(self, tenant: str, run_id: str) -> dict:
        if run_id.startswith("tinker://"):
            run_id = parse_tinker_path(run_id).run_id
        meta = self.store.read_run_meta(tenant, run_id)
        if meta is None:
            raise NotFound(f"unknown training run {run_id!r}", field="run_id")
        return self._run_json(tenant, meta)

    def _run_json(self, tenant: str, meta: dict) -> dict:
        run_id = meta["run_id"]
        live = self.svc.runs.get(run_id)
        cks = self.run_checkpoints(tenant, run_id)
        return {
            "training_run_id": run_id,
            "base_model": meta["base_model"],
            "model_owner": tenant,
            "is_lora": meta["lora"]["rank"] > 0,
            "corrupted": False,
            "lora_rank": meta["lora"]["rank"] or None,
            "last_request_time": iso(live.last_request_time if live else meta["created_at"]),
            "last_checkpoint": next((c for c in cks if c["checkpoint_type"] == "training"), None),
            "last_sampler_checkpoint": next((c for c in cks if c["checkpoint_type"] == "sampler"), None),
            "user_metadata": meta.get("user_metadata") or None,
        }

    def list_training_runs(self, tenant: str, limit: Any, offset: Any, project_id: str | None) -> dict:
        runs = self.store.list_runs(tenant)
        if project_id is not None:
            # A run belongs to its session's current project: assigning a session moves its runs.
            projects = {r["session_id"]: r.get("project_id") for r in self._all_sessions(tenant)}
            runs = [r for r in runs if projects.get(r.get("session_id"), r.get("project_id")) == project_id]
        runs.sort(key=lambda r: (r["created_at"], r["run_id"]), reverse=True)
        items, cursor = page(runs, limit, offset)
        return {"training_runs": [self._run_json(tenant, m) for m in items], "cursor": cursor}

    # -- sessions -------------------------------------------------------------------------------
    def session_record(self, tenant: str, session_id: str) -> dict:
        live = self.svc.sessions.get(session_id)
        if live is not None and live.tenant == tenant:
            return live.record()
        record = self.store.read_session(tenant, session_id)
        if record is None:
            raise NotFound(f"unknown session_id {session_id!r}", field="session_id")
        return record

    def get_session(self, tenant: str, session_id: str) -> dict:
        r = self.session_record(tenant, session_id)
        return {
            "training_run_ids": r["training_run_ids"],
            "sampler_ids": r["sampler_ids"],
            "user_metadata": r.get("user_metadata") or None,
            "display_name": r.get("display_name"),
        }

    def _all_sessions(self, tenant: str) -> list[dict]:
        records = {r["session_id"]: r for r in self.store.list_sessions(tenant)}
        for sess in list(self.svc.sessions.values()):
            if sess.tenant == tenant:
                records[sess.session_id] = sess.record()
        return sorted(records.values(), key=lambda r: (r["created_at"], r["session_id"]), reverse=True)

    def list_sessions(self, tenant: str, limit: Any, offset: Any) -> dict:
        items, cursor = page(self._all_sessions(tenant), limit, offset)
        return {"sessions": [r["session_id"] for r in items], "cursor": cursor}

    def assign_project(self, tenant: str, session_id: str, project_id: Any) -> None:
        """Move a session, and with it every run it created, into a project."""
        if not isinstance(project_id, str) or not 0 < len(project_id) <= 256:
            raise UserError(
                "project_id must be a non-empty string of at most 256 characters", field="project_id"
            )
        live = self.svc.sessions.get(session_id)
        if live is not None and live.tenant == tenant:
            live.project_id = project_id
            self.store.write_session(tenant, live.record())
            return
        record = self.session_record(tenant, session_id)
        self.store.write_session(tenant, {**record, "project_id": project_id})

    def search_sessions(self, tenant: str, body: dict) -> dict:
        limit = integer(body.get("limit", 50), "limit", 1, 200)
        owner = (body.get("owner") or {"type": "own"}).get("type", "own")
        if owner not in ("own", "accessible"):
            return {"sessions": [], "next_cursor": None}  # other users' sessions are never visible
        want_id, want_name = body.get("session_id"), body.get("display_name")
        meta = body.get("user_metadata") or {}
        projects = body.get("project_ids")
        statuses = body.get("statuses")
        cursor = body.get("cursor")
        out = []
        for r in self._all_sessions(tenant):
            if want_id is not None or want_name is not None:
                name = (r.get("display_name") or "").lower()
                by_name = want_name is not None and all(w in name for w in str(want_name).lower().split())
                if not (r["session_id"] == want_id or by_name):
                    continue
            if any((r.get("user_metadata") or {}).get(k) != v for k, v in meta.items()):
                continue
            if projects is not None and self._project(r) not in projects:
                continue
            if statuses is not None and not _status_matches(r["status"], statuses):
                continue
            if cursor is not None:
                last = (cursor.get("last_created_at"), cursor.get("last_session_id"))
                if (iso(r["created_at"]), r["session_id"]) >= last:
                    continue
            out.append(r)
            if len(out) > limit:
                break
        more = len(out) > limit
        out = out[:limit]
        summaries = [self._summary(tenant, r) for r in out]
        next_cursor = (
            {"last_created_at": summaries[-1]["created_at"], "last_session_id": summaries[-1]["session_id"]}
            if more and summaries
            else None
        )
        return {"sessions": summaries, "next_cursor": next_cursor}

    @staticmethod
    def _project(record: dict) -> str:
        return record.get("project_id") or "default"

    def _summary(self, tenant: str, r: dict) -> dict:
        cks = [m for run in r["training_run_ids"] for m in self.store.list_checkpoints(tenant, run)]
        return {
            "session_id": r["session_id"],
            "created_at": iso(r["created_at"]),
            "owner": tenant,
            "project_id": self._project(r),
            "status": r["status"],
            "checkpoints_count": len(cks),
            "display_name": r.get("display_name"),
            "user_metadata": r.get("user_metadata") or None,
            "checkpoint_storage_bytes": sum(m["size_bytes"] for m in cks),
        }

    # -- signed downloads -----------------------------------------------------------------------
    def _sign(self, payload: dict) -> str:
        raw = base64.urlsafe_b64encode(json.dumps(payload, sort_keys=True).encode()).decode().rstrip("=")
        sig = hmac.new(self._secret, raw.encode(), hashlib.sha256).hexdigest()
        return f"{raw}.{sig}"

    def verify(self, token: str, what: str = "download") -> dict:
        """The payload of a valid, unexpired signed token (404 for a forged one, 410 once expired)."""
        raw, _, sig = token.partition(".")
        good = hmac.new(self._secret, raw.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()
        # bytes: compare_digest refuses a str with a non-ASCII character (a TypeError, a 500)
        if not sig or not hmac.compare_digest(sig.encode("utf-8", "surrogateescape"), good.encode()):
            raise NotFound(f"unknown {what} link", field="url")
        payload = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        if time.time() > payload["exp"]:
            raise Gone(f"this {what} link has expired; ask for a new one", field="url")
        if (payload.get("what") == "upload") != (what == "upload"):  # a download link uploads nothing
            raise NotFound(f"unknown {what} link", field="url")
        return payload

    def resolve_download(self, token: str) -> tuple[Path, str]:
        """(file, download name) for a valid, unexpired signed token."""
        payload = self.verify(token)
        tenant = payload["tenant"]
        if payload["what"] == "export":
            folder = self.exports.current(tenant, payload["export"])  # 404 once its checkpoint is gone
            return folder / payload["file"], payload["file"]
        if payload["what"] == "trace":
            return (
                self.store.root / "traces" / tenant_folder(tenant) / f"{payload['session_id']}.json",
                f"{payload['session_id']}.json",
            )
        ref = parse_tinker_path(payload["path"])
        folder = self.store.folder(tenant, ref)
        self.store.manifest(tenant, ref)  # refuses expired checkpoints
        return folder / payload["file"], payload["file"]

    def external_urls(self, tenant: str, run_id: str, kind: str, name: str, base_url: str) -> dict:
        ref = self.ref(run_id, kind, name)
        folder = self.store.folder(tenant, ref)
        self.store.manifest(tenant, ref)
        exp = time.time() + URL_TTL_S
        urls = {
            p.name: f"{base_url}/api/v1/downloads/{self._sign({'what': 'ckpt', 'tenant': tenant, 'path': ref.path, 'file': p.name, 'exp': exp})}"
            for p in sorted(folder.iterdir())
            if p.is_file()
        }
        return {"urls": urls, "expires": iso(exp)}

    def export(self, tenant: str, tinker_path: str, merged: bool, base_url: str) -> dict:
        """Build (or reuse) an export (engine/export.py) and sign a download URL for each of its files."""
        export_id, folder, info = self.exports.build(tenant, tinker_path, merged)
        exp = time.time() + URL_TTL_S
        files = []
        for p in sorted(folder.iterdir()):
            if not p.is_file():
                continue
            token = self._sign(
                {"what": "export", "tenant": tenant, "export": export_id, "file": p.name, "exp": exp}
            )
            files.append(
                {
                    "name": p.name,
                    "url": f"{base_url}/api/v1/downloads/{token}",
                    "size_bytes": p.stat().st_size,
                    "sha256": _file_sha256(p),
                }
            )
        return {**info, "files": files, "expires": iso(exp)}

    def trace_export(self, tenant: str, session_id: str, base_url: str) -> dict:
        """The session's executed ops as a Chrome/Perfetto trace-event JSON, behind a signed URL."""
        record = self.session_record(tenant, session_id)
        lanes = set(record["training_run_ids"]) | set(record["sampler_ids"])
        events = [
            {
                "name": op.kind,
                "cat": "openrl",
                "ph": "X",
                "ts": op.start * 1e6,
                "dur": op.duration_s * 1e6,
                "pid": 1,
                "tid": op.run,
                "args": {"tokens": op.tokens, "ok": op.ok} | _fused_args(op, lanes),
            }
            for op in self.svc.recorder.since(record["created_at"])
            if op.run in lanes
        ]
        folder = self.store.root / "traces" / tenant_folder(tenant)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{session_id}.{uuid.uuid4().hex}"
        tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        tmp.replace(folder / f"{session_id}.json")
        token = self._sign(
            {"what": "trace", "tenant": tenant, "session_id": session_id, "exp": time.time() + URL_TTL_S}
        )
        return {"status": "ready", "url": f"{base_url}/api/v1/downloads/{token}"}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _status_matches(status: dict, queries: list) -> bool:
    wanted = {q.get("type") if isinstance(q, dict) else q for q in queries}
    kind = status.get("type")
    return kind in wanted or ("finished" in wanted and kind == "client_finished")


def _fused_args(op, lanes: set[str]) -> dict:
    """A fused op's id and the session's other runs it covered; other sessions' runs (and how many
    there were: they may be other tenants') stay out."""
    if not op.fused_id:
        return {}
    return {"fused_id": op.fused_id, "fused_with": [r for r in op.fused_runs if r in lanes and r != op.run]}
