"""Tinker keys for JupyterHub users (``/api/v1/keys``): mint with the hub token, list, revoke.

    POST   /api/v1/keys       {"name": "laptop"}  → 201 {"id", "key": "tml-…", "tenant", "name", "created",
                              "prefix", "expires"}
    GET    /api/v1/keys       → {"keys": [{"id", "tenant", "name", "created", "prefix", "expires"}]}
    DELETE /api/v1/keys/{id}  → 204; the key is refused from then on

Minting needs the hub user's own token (not an API key, not a minted key): a key can never be used to
make more keys, and revoking the hub token leaves no way to mint. The key is shown once, in the reply
to POST. It works until ``expires`` (OPENRL_MINTED_KEY_TTL_S after minting) and only while the hub
account it was minted for exists: the record keeps that account's name and ``created`` time. See
api/hubauth.py.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool as off

from openrl_service.api import schemas as S
from openrl_service.api.http import json_response, read_model, tenant
from openrl_service.api.hubauth import MintedKeys
from openrl_service.api.openapi_bodies import body
from openrl_service.errors import Conflict, Forbidden, NotFound


def build_keys_router(minted: MintedKeys, max_body: int) -> APIRouter:
    r = APIRouter(prefix="/api/v1", tags=["keys"], generate_unique_id_function=S.operation_ids("keys"))

    @r.post("/keys", status_code=201, openapi_extra=body(S.MintKey, required=False))
    async def mint(request: Request):
        if getattr(request.state, "auth_via", None) != "hub":
            raise Forbidden(
                "minting a Tinker key needs a JupyterHub user's own token ($JUPYTERHUB_API_TOKEN), "
                "and this service must be started with --hub-api-url",
                field="X-API-Key",
            )
        name = (await read_model(request, S.MintKey, max_body)).name
        try:
            rec, key = await off(
                minted.mint,
                tenant(request),
                name,
                getattr(request.state, "hub_user", None),
                getattr(request.state, "hub_created", None),  # the account the key lives no longer than
            )
        except OverflowError as e:
            raise Conflict(str(e), field="keys") from None
        return json_response({**rec, "key": key}, status=201)

    @r.get("/keys")
    async def list_keys(request: Request):
        return json_response({"keys": minted.list(tenant(request))})

    @r.delete("/keys/{key_id}", status_code=204)
    async def revoke(request: Request, key_id: str):
        if not await off(minted.revoke, tenant(request), key_id):
            raise NotFound(f"no key {key_id!r} of yours", field="key_id")
        return Response(status_code=204)

    return r
