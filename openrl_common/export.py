"""Download an export of a checkpoint from a running openrl-service: ``openrl-service export``,
``run.export`` and ``%openrl export`` call :func:`download_export`. Standard library only (urllib, as all
of openrl_common): the service builds the folder (engine/export.py), this fetches its files through
signed URLs, checks each file's SHA-256 and puts the folder in place only when every file arrived whole.

    openrl-service export tinker://<run>/sampler_weights/<name> ./my-adapter            # PEFT folder
    openrl-service export tinker://<run>/sampler_weights/<name> ./my-model --merged     # HF model folder

The service and key are found as the Tinker SDK finds them: ``--base-url`` / ``TINKER_BASE_URL`` and
``--api-key`` / ``TINKER_API_KEY`` (``OPENRL_URL`` / ``OPENRL_TOKEN`` also work).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any


class ExportError(Exception):
    """The service refused the export, or a file did not arrive whole."""


def _find(base_url: str | None, api_key: str | None) -> tuple[str, str]:
    """The service and key: as given, else as the Tinker SDK finds them. A key from the environment
    goes only to the URL it came with (TINKER_API_KEY to TINKER_BASE_URL, OPENRL_TOKEN to OPENRL_URL);
    "" sends none (a service without keys)."""
    pairs = [("TINKER_BASE_URL", "TINKER_API_KEY"), ("OPENRL_URL", "OPENRL_TOKEN")]
    url = base_url or next((os.environ[u] for u, _ in pairs if os.environ.get(u)), None)
    if not url:
        raise ExportError("no service to export from: pass --base-url or set TINKER_BASE_URL")
    url = url.rstrip("/")
    if api_key is None:
        api_key = next(
            (
                os.environ.get(k)
                for u, k in pairs
                if (os.environ.get(u) or "").rstrip("/") == url and os.environ.get(k)
            ),
            "",
        )
    return url, api_key


def download_export(
    tinker_path: str,
    dest: str | os.PathLike,
    *,
    merged: bool = False,
    base_url: str | None = None,
    api_key: str | None = None,
    overwrite: bool = False,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Export ``tinker_path`` into the folder ``dest`` (created; an existing non-empty one only with
    ``overwrite``). Returns the export's description: format, base model, base weights' SHA-256, files."""
    url, key = _find(base_url, api_key)
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())) and not overwrite:
        raise ExportError(f"{dest} exists and is not empty; choose another folder or overwrite it")
    body = json.dumps({"tinker_path": tinker_path, "merged": bool(merged)}).encode()
    request = urllib.request.Request(
        f"{url}/api/v1/exports",
        data=body,
        headers={"Content-Type": "application/json", **({"X-API-Key": key} if key else {})},
        method="POST",
    )
    try:
        with _opener().open(request, timeout=timeout) as r:
            info = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read().decode("utf-8", "replace")
        try:
            why = json.loads(raw).get("error", raw)
        except ValueError:
            why = raw
        raise ExportError(f"the service refused the export of {tinker_path} ({e.code}): {why}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ExportError(f"cannot reach the service at {url}: {getattr(e, 'reason', e)}") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for f in info["files"]:
            name = Path(f["name"]).name  # a file name, never a path
            h = hashlib.sha256()
            try:
                with _opener().open(f["url"], timeout=timeout) as resp, (tmp / name).open("wb") as out:
                    while chunk := resp.read(1 << 20):
                        h.update(chunk)
                        out.write(chunk)
            except urllib.error.HTTPError as e:
                raise ExportError(f"downloading {name} failed ({e.code})") from None
            except (urllib.error.URLError, OSError) as e:
                raise ExportError(f"downloading {name} failed: {getattr(e, 'reason', e)}") from None
            if h.hexdigest() != f["sha256"]:
                raise ExportError(f"{name} arrived damaged (its SHA-256 does not match); export again")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {k: v for k, v in info.items() if k != "files"} | {"files": [f["name"] for f in info["files"]]}


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """The key goes to the service named, never to where a redirect points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, PLR0913
        return None


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(_NoRedirect)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="openrl-service export",
        description="Download a checkpoint as a PEFT adapter folder, or with --merged as a Hugging Face model "
        "folder, from a running openrl-service (found as the Tinker SDK finds it: TINKER_BASE_URL, "
        "TINKER_API_KEY).",
    )
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("tinker_path", help="tinker://<run>/<sampler_weights|weights|external_weights>/<name>")
    p.add_argument("dir", type=Path, help="the folder to create")
    p.add_argument("--merged", action="store_true", help="a full model folder with the adapter merged in")
    p.add_argument("--base-url", default=None, help="the service (default: TINKER_BASE_URL)")
    p.add_argument("--api-key", default=None, help="the key (default: TINKER_API_KEY)")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")


def run(args: argparse.Namespace) -> int:
    try:
        info = download_export(
            args.tinker_path,
            args.dir,
            merged=args.merged,
            base_url=args.base_url,
            api_key=args.api_key,
            overwrite=args.force,
        )
    except ExportError as e:
        print(f"openrl-service export: {e}", file=sys.stderr)
        return 1
    print(
        f"{args.dir}: {info['format']} export of {info['tinker_path']} on {info['base_model']} "
        f"(base weights sha256 {info['base_weights_sha256'][:16]}…): {', '.join(info['files'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
