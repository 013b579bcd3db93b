"""Tenant folders in a data dir, and moving a data dir an older release wrote to today's names.

Releases before the shared-hub fixes named a tenant's folder with a mapping that was not 1:1: a hub
user's name was percent-encoded with upper-case hex and ``~`` kept, an API-key tenant kept its case,
and a long hub name became ``hub~~<digest>``, which a short name spelled ``~<digest>`` also gave
(:func:`openrl_service.config.tenant_folder` is 1:1 now, also ignoring case). At start, before
anything reads a tenant's data, :func:`migrate_tenant_folders` renames each folder of the old form
to its new name; when two folders would end up as one (two tenants that differed only in case on a
file system that ignores it can never have been two folders, but an old and a new folder of one
tenant can both exist), it refuses to start and names them, so the operator merges or removes one
by hand instead of the service silently mixing two tenants' files. ``hub~~<digest>`` folders keep
their name: the digest is computed as before, and the long-named user they were made for keeps them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from urllib.parse import quote, unquote

from openrl_service.config import (
    HUB_FOLDER_PREFIX,
    HUB_TENANT_PREFIX,
    TENANT_RE,
    folder_tenant,
    tenant_folder,
)

log = logging.getLogger("openrl_service")

TENANT_PARENTS = ("tenants", "traces")  # the folders of <data> that hold one folder per tenant


class LayoutError(RuntimeError):
    """The data dir holds folders that cannot be moved to today's names without merging tenants."""


def old_folder_tenant(folder: str) -> str | None:
    """The tenant an older release's folder name stood for, or None if it is not one."""
    if folder.startswith(HUB_FOLDER_PREFIX + "~"):
        return None  # a digest: the same name today
    if folder.startswith(HUB_FOLDER_PREFIX):
        encoded = folder[len(HUB_FOLDER_PREFIX) :]
        name = unquote(encoded, errors="strict") if encoded else ""
        return HUB_TENANT_PREFIX + name if name and quote(name, safe="") == encoded else None
    return folder if TENANT_RE.match(folder) else None


def _moves(parent: Path) -> dict[Path, Path]:
    moves: dict[Path, Path] = {}
    for entry in sorted(parent.iterdir()):
        name = entry.name
        if not entry.is_dir() or name.startswith("."):
            continue
        if folder_tenant(name) is not None or name.startswith(HUB_FOLDER_PREFIX + "~"):
            continue  # today's name (the two mappings agree wherever both apply)
        tenant = old_folder_tenant(name)
        if tenant is None:
            log.warning("%s: not a tenant folder; no tenant can reach it, left as it is", entry)
            continue
        moves[entry] = parent / tenant_folder(tenant)
    return moves


def migrate_tenant_folders(data_dir: str | os.PathLike[str]) -> list[tuple[Path, Path]]:
    """Rename every old-form tenant folder under ``<data>/tenants`` and ``<data>/traces`` to today's
    name; returns the moves made. Raises :class:`LayoutError` (naming the folders) and moves nothing
    when a new name is taken or two folders would get the same one."""
    planned: list[tuple[Path, Path]] = []
    clashes: list[str] = []
    for sub in TENANT_PARENTS:
        parent = Path(data_dir) / sub
        if not parent.is_dir():
            continue
        existing = {p.name.casefold(): p for p in parent.iterdir()}
        targets: dict[str, Path] = {}
        for src, dst in _moves(parent).items():
            key = dst.name.casefold()
            other = targets.get(key) or (existing.get(key) if existing.get(key) != src else None)
            if other is not None:
                clashes.append(f"{src} and {other} (both would be {dst})")
            targets[key] = src
            planned.append((src, dst))
    if clashes:
        raise LayoutError(
            "this data dir was written by an older openrl-service whose tenant folder names were not "
            "one to one, and moving them to today's names would merge two folders: "
            + "; ".join(clashes)
            + ". Keep one of each pair (move the other out of the data dir) and start again."
        )
    for src, dst in planned:
        os.rename(src, dst)
        log.warning("tenant folder %s moved to %s (tenant folder names changed)", src, dst.name)
    for parent in {dst.parent for _, dst in planned}:
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return planned
