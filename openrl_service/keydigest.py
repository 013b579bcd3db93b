"""How the service keeps a credential: never the key or token itself, only this digest.

API keys (api/auth.py), the admin key (api/admin.py), minted keys and hub-token cache entries
(api/hubauth.py) and job keys (engine/jobs.py, stored in each job.json) all go through
:func:`key_digest`; compare two digests with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib


def key_digest(key: str) -> str:
    """SHA-256 of ``key`` (UTF-8; a character that cannot be encoded becomes "?"), in hex."""
    return hashlib.sha256(key.encode("utf-8", "replace")).hexdigest()
