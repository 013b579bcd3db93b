"""What a job request must be (``/openrl/v1/jobs``) beyond its body's shape (the request models of
:mod:`openrl_service.api.schemas` check that): the payload decoded and matching its digest, k8s
settings only with where=k8s, the job label of a run's ``user_metadata``.

Each check raises a UserError (400) or PayloadTooLarge (413) naming the field and the limit; the
registry (jobs.py) stores only what passed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from typing import Any

from openrl_service.errors import Forbidden, PayloadTooLarge, UserError

JOB_META_KEY = "openrl.job"  # user_metadata key of a job's runs
SHA_RE = re.compile(r"^[0-9a-fA-F]{64}$")


def decode_payload(value: Any, sha: Any, limit: int, field: str = "payload") -> bytes:
    """A base64 payload decoded, at most ``limit`` bytes (413 naming it), matching ``sha`` (400)."""
    if not isinstance(value, str) or not value:
        raise UserError(f"{field} is required: the job's payload as a base64 string", field=field)
    if len(value) > (limit + 2) // 3 * 4 + 4:  # refused before decoding
        raise PayloadTooLarge(
            f"{field} decodes to more than {limit} bytes (OPENRL_MAX_JOB_PAYLOAD_BYTES={limit})", field=field
        )
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise UserError(f"{field} must be standard base64 (RFC 4648)", field=field) from None
    if len(data) > limit:
        raise PayloadTooLarge(
            f"{field} is {len(data)} bytes; at most {limit} (OPENRL_MAX_JOB_PAYLOAD_BYTES={limit})",
            field=field,
        )
    if not isinstance(sha, str) or not SHA_RE.match(sha):
        raise UserError(
            "payload_sha256 is required: the SHA-256 of the decoded payload, 64 hex digits",
            field="payload_sha256",
        )
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha.lower():
        raise UserError(
            f"payload_sha256 does not match the payload: got {sha.lower()[:16]}…, the payload's is "
            f"{actual[:16]}… (damaged in transit?)",
            field="payload_sha256",
        )
    return data


def check_unlabelled(meta: Any, field: str = "user_metadata") -> None:
    """``user_metadata`` keys starting "openrl.job" are the service's label of a job's runs: only a
    job's own key gets them (403 otherwise; "openrl.sweep" and every other key stay free)."""
    if isinstance(meta, dict):
        for k in meta:
            if isinstance(k, str) and k.startswith(JOB_META_KEY):
                raise Forbidden(
                    f'{field}["{k[:64]}"] is reserved: the service labels a job\'s runs with their job '
                    "(only that job's key creates them)",
                    field=f"{field}.{JOB_META_KEY}",
                )


def check_submit(body: dict, max_payload_bytes: int) -> dict:
    """A submit body (its fields already checked by the route's request model,
    :class:`openrl_service.api.schemas.Bodies` ``.SubmitJob``), its payload decoded."""
    k8s = body.get("k8s")
    if k8s is not None and body["where"] != "k8s":
        raise UserError("k8s settings apply only with where=k8s", field="k8s")
    return {
        "name": body["name"],
        "kind": body["kind"],
        "where": body["where"],
        "payload": decode_payload(body["payload"], body["payload_sha256"], max_payload_bytes),
        "reward": body.get("reward"),
        "meta": dict(body.get("meta") or {}),
        "k8s": dict(k8s or {}),
    }


def job_label(meta: dict, job: str | None) -> dict:
    """A run created by a job's key carries ``user_metadata["openrl.job"] = job``; another job's
    label is refused (403)."""
    if job is None:
        check_unlabelled(meta)
        return meta
    claimed = meta.get(JOB_META_KEY, job)
    if claimed != job:
        raise Forbidden(
            f'user_metadata["{JOB_META_KEY}"] is {repr(claimed)[:100]}, but this key belongs to job {job}: '
            "its runs are labelled with that job",
            field=f"user_metadata.{JOB_META_KEY}",
        )
    return {**meta, JOB_META_KEY: job}
