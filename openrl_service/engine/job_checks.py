"""What a job request must be (``/openrl/v1/jobs``): the submit body, its payload, its meta and control.

Each check raises a UserError (400) or PayloadTooLarge (413) naming the field and the limit; the
registry (jobs.py) stores only what passed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from typing import Any

from openrl_common.protocol import JOB_NAME_RE, control_problem
from openrl_service.errors import Forbidden, PayloadTooLarge, UserError

JOB_META_KEY = "openrl.job"  # user_metadata key of a job's runs
KINDS = ("run", "sweep")
WHERES = ("local", "k8s")
K8S_FIELDS = ("image", "volumes", "cpu", "memory")
MAX_META_VALUES = 32
MAX_META_KEY_CHARS = 64
MAX_META_STR_CHARS = 256
MAX_REWARD_CHARS = 128
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


def check_reward(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REWARD_CHARS:
        raise UserError(
            f"reward must be a string of 1-{MAX_REWARD_CHARS} characters or null; got {repr(value)[:100]}",
            field="reward",
        )
    return value


def check_meta(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"meta must be an object of scalar values; got {type(value).__name__}", field="meta")
    if len(value) > MAX_META_VALUES:
        raise UserError(f"meta: at most {MAX_META_VALUES} values; got {len(value)}", field="meta")
    for k, v in value.items():
        if len(k) > MAX_META_KEY_CHARS:
            raise UserError(
                f"meta: the name {k[:32]!r}… has {len(k)} characters; at most {MAX_META_KEY_CHARS}",
                field="meta",
            )
        if isinstance(v, str):
            if len(v) > MAX_META_STR_CHARS:
                raise UserError(
                    f"meta.{k}: a string of at most {MAX_META_STR_CHARS} characters; got {len(v)}",
                    field=f"meta.{k}",
                )
        elif v is not None and not isinstance(v, (bool, int, float)):
            raise UserError(
                f"meta.{k} must be a string, number, boolean or null; got {type(v).__name__}",
                field=f"meta.{k}",
            )
    return dict(value)


def choice(body: dict, name: str, choices: tuple[str, ...]) -> str:
    value = body.get(name)
    if value not in choices:
        raise UserError(f"{name} must be one of {', '.join(choices)}; got {repr(value)[:100]}", field=name)
    return value


def check_submit(body: dict, max_payload_bytes: int) -> dict:
    """A submit body checked (each error names its field and limit), the payload decoded."""
    name = body.get("name")
    if not isinstance(name, str) or not JOB_NAME_RE.match(name):
        raise UserError(
            f"name must be 1-64 characters of A-Z a-z 0-9 . _ -; got {repr(name)[:100]}", field="name"
        )
    kind = choice(body, "kind", KINDS)
    where = choice(body, "where", WHERES)
    payload = decode_payload(body.get("payload"), body.get("payload_sha256"), max_payload_bytes)
    k8s = body.get("k8s")
    if k8s is not None:
        if where != "k8s":
            raise UserError("k8s settings apply only with where=k8s", field="k8s")
        if not isinstance(k8s, dict):
            raise UserError(f"k8s must be an object; got {type(k8s).__name__}", field="k8s")
        for k in k8s:
            if k not in K8S_FIELDS:
                raise UserError(
                    f"k8s.{k[:64]} is not a setting; k8s takes {', '.join(K8S_FIELDS)}",
                    field=f"k8s.{k[:64]}",
                )
    return {
        "name": name,
        "kind": kind,
        "where": where,
        "payload": payload,
        "reward": check_reward(body.get("reward")),
        "meta": check_meta(body.get("meta")),
        "k8s": dict(k8s or {}),
    }


def check_control(body: dict) -> dict:
    """A control body (action, reason) checked the way openrl_common.protocol defines it."""
    problem = control_problem(body)
    if problem is not None:
        raise UserError(problem[1], field=problem[0])
    return {"action": body["action"], "reason": body.get("reason")}


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
