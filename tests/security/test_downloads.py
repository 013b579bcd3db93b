"""Signed download URLs (/api/v1/downloads/<token>) and the tokenizer mirror: what a link holder, or
anyone guessing at links, can fetch without a key.

A download link is a bearer capability by design (Tinker's are too): whoever holds a valid, unexpired
link to a live checkpoint gets its file, with no key. Everything else must be refused: a forged or
tampered token, a token bent to another tenant's file, an expired one, one replayed after its
checkpoint was deleted or expired, and path tricks in the token. Already held elsewhere: another
tenant gets no link for my checkpoint (tests/service/test_rest.py::test_another_tenant_gets_404_for_every_rest_object),
a forged signature is 404 (tests/service/test_rest.py::test_signed_download_links_work_without_a_key_and_expire_when_forged),
tokens never reach the access log (tests/service/test_auth.py::test_cli_access_log_never_shows_a_download_token),
the mirror serves no weights, no unknown repo and no `..%2F` file name
(tests/service/test_tokenizer_mirror.py::test_absent_files_weights_unknown_repos_and_revisions_are_404).
"""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest
import tinker

from openrl_service.api.hub import SERVED_FILES
from openrl_service.engine import catalog
from openrl_service.storage.checkpoints import parse_tinker_path
from tests.conftest import ALICE_KEY, BOB_KEY, TINY
from tests.security.conftest import refused

PREFIX = "/api/v1/downloads/"


def external(live, key: str, name: str) -> tuple[str, dict[str, str]]:
    """A fresh external-weights checkpoint of the key's tenant: (its tinker:// path, its file links)."""
    sc = tinker.ServiceClient(base_url=live.url, api_key=key)
    try:
        path = (
            sc.create_lora_training_client(base_model=TINY, rank=4)
            .result()
            .save_weights_external(name)
            .result()
            .path
        )
    finally:
        sc.close("success").result()
    rest = tinker.RestClient(base_url=live.url, api_key=key)
    return path, rest.get_external_weights_urls(path).result().urls


def split(url: str) -> tuple[dict, str, str]:
    """A link's token as (its signed payload, the payload's text as sent, the signature)."""
    raw, _, sig = url.rsplit("/", 1)[1].partition(".")
    return json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))), raw, sig


def token_of(payload: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(payload, sort_keys=True).encode()).decode().rstrip("=")


@pytest.fixture(scope="module")
def links(live):
    """alice's and bob's external checkpoints and their links."""
    return {"alice": external(live, ALICE_KEY, "alice-e"), "bob": external(live, BOB_KEY, "bob-e")}


def anonymous(live, path: str) -> httpx.Response:
    """A GET with no key, from a fresh connection (a refused one may close it)."""
    with httpx.Client(base_url=live.url, timeout=30) as c:
        return c.get(path)


def test_a_valid_link_is_a_bearer_capability_for_that_one_file(live, links):
    """Not an attack: the baseline the others bend. A link fetches its own file with no key."""
    _, urls = links["alice"]
    r = httpx.get(urls["adapter_config.json"], timeout=30)
    assert r.status_code == 200 and b'"peft_type": "LORA"' in r.content


def test_a_link_bent_to_another_tenants_file_is_refused(live, links):
    """Attack: bob takes a link to his own file and rewrites its payload (tenant, checkpoint path,
    file name) to name alice's, keeping his valid signature."""
    alice_path, _ = links["alice"]
    _, bob_urls = links["bob"]
    payload, _, sig = split(bob_urls["adapter_config.json"])
    for bent in (
        {**payload, "tenant": "alice", "path": alice_path},
        {**payload, "tenant": "alice"},
        {**payload, "path": alice_path},
        {**payload, "file": "adapter_model.safetensors"},
        {**payload, "exp": payload["exp"] + 86_400},
        {**payload, "what": "trace", "session_id": alice_path.split("/")[2].split(":")[0]},
    ):
        refused(anonymous(live, f"{PREFIX}{token_of(bent)}.{sig}"), 404)


def test_a_token_with_its_signature_moved_or_truncated_is_refused(live, links):
    """Attack: splice the signature of one link onto another's payload, drop it, double it, or
    send the payload alone."""
    _, alice_urls = links["alice"]
    _, bob_urls = links["bob"]
    _, alice_raw, alice_sig = split(alice_urls["adapter_model.safetensors"])
    _, bob_raw, bob_sig = split(bob_urls["adapter_model.safetensors"])
    for token in (
        f"{alice_raw}.{bob_sig}",
        f"{bob_raw}.{alice_sig}",
        alice_raw,
        f"{alice_raw}.",
        f".{alice_sig}",
        f"{alice_raw}.{alice_sig}.{alice_sig}",
        f"{alice_raw}.{alice_sig.upper()}",
    ):
        refused(anonymous(live, PREFIX + token), 404)


@pytest.mark.parametrize(
    "token",
    ["..%2F..%2F..%2Fminted-keys.json", "%2e%2e%2f%2e%2e%2fjournal", "....", "~", "%00", "a" * 5000, "x.y.z"],
)
def test_path_tricks_in_a_token_are_refused(live, token):
    """Attack: a token that is a relative path (encoded slashes and dots), a NUL, or an overlong
    string, hoping the service opens it as a file."""
    r = anonymous(live, PREFIX + token)
    assert r.status_code in (404, 414), (r.status_code, r.text[:200])
    if r.status_code == 404:
        refused(r, 404)


@pytest.mark.parametrize("token", ["abc.%C3%A9", "x.%E2%82%AC" + "0" * 63])
def test_a_token_with_non_ascii_characters_is_refused_not_a_500(live, token):
    """Attack: a token whose signature part is not ASCII (anonymous: no key needed on this route)."""
    refused(anonymous(live, PREFIX + token), 404)


def test_an_expired_link_is_gone(live, links, monkeypatch):
    """Attack: replay a link after its hour (URL_TTL_S) is over. Links are made here already
    expired rather than waited on: the service's own clock check decides."""
    alice_path, _ = links["alice"]
    monkeypatch.setattr(catalog, "URL_TTL_S", -1)
    rest = tinker.RestClient(base_url=live.url, api_key=ALICE_KEY)
    urls = rest.get_external_weights_urls(alice_path).result().urls
    for url in urls.values():
        body = refused(httpx.get(url, timeout=30), 410)
        assert "expired" in body["error"]


def test_a_link_replayed_after_its_checkpoint_is_deleted_is_refused(live):
    """Attack: keep a link, let the owner delete the checkpoint, fetch again."""
    path, urls = external(live, ALICE_KEY, "deleted-later")
    assert httpx.get(urls["adapter_config.json"], timeout=30).status_code == 200
    tinker.RestClient(base_url=live.url, api_key=ALICE_KEY).delete_checkpoint_from_tinker_path(path).result()
    for url in urls.values():
        refused(httpx.get(url, timeout=30), 404)


def test_a_link_replayed_after_its_checkpoint_expired_is_refused(live):
    """Attack: keep a link to a checkpoint with a TTL and fetch it once the TTL is over (before the
    sweep has deleted the files). Its manifest's expiry is moved to the past, as time would."""
    path, urls = external(live, ALICE_KEY, "expires-later")
    live.service.store.update_manifest("alice", parse_tinker_path(path), expires_at=time.time() - 1)
    for url in urls.values():
        refused(httpx.get(url, timeout=30), 404)


# -- the tokenizer mirror (api/hub.py): never weights, never outside the served files ---------------
# Dots percent-encoded: httpx would resolve a literal "/../" before sending; the service decodes
# these into the path it routes, which is the attack.
@pytest.mark.parametrize(
    "sub",
    [
        "%2E%2E",
        "%2E%2E/%2E%2E",
        "%2E%2E%2F%2E%2E%2F%2E%2E",
        "additional_chat_templates/%2E%2E",
        "additional_chat_templates/%2E%2E/%2E%2E/%2E%2E",
        "%2Fetc",
    ],
)
def test_the_mirrors_tree_lists_only_served_files_under_any_subpath(live, sub):
    """Attack: list the mirror's tree below a parent-folder path, hoping it walks the model folder
    (weights) or the data folder."""
    with live.client(BOB_KEY) as c:
        r = c.get(f"/api/models/{TINY}/tree/main/{sub}", params={"recursive": "true"})
    if r.status_code == 200:
        assert isinstance(r.json(), list), r.json()
        names = {e["path"] for e in r.json() if e["type"] == "file"}
        assert all(n in SERVED_FILES or n.startswith("additional_chat_templates/") for n in names), names
    else:
        assert r.status_code == 404, (r.status_code, r.text)


@pytest.mark.parametrize(
    "name",
    [
        "additional_chat_templates/%2E%2E/model.safetensors",
        "additional_chat_templates/..%2F..%2Fminted-keys.json",
        "%2E/tokenizer.json/%2E%2E/model.safetensors",
        "tokenizer.json%00.safetensors",
        "TOKENIZER.JSON",
        "model.safetensors.index.json",
    ],
)
def test_the_mirror_resolves_no_file_but_a_served_one(live, name):
    """Attack: resolve a weights or data file through the chat-template folder, dot segments, a NUL
    or another case of a served name."""
    with live.client(BOB_KEY) as c:
        r = c.get(f"/{TINY}/resolve/main/{name}")
    assert r.status_code == 404, (r.status_code, r.content[:200])
    assert r.headers.get("x-error-code") in ("EntryNotFound", None), r.headers


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/downloads/%2E%2E/training_runs",
        "/api/v1/downloads/%2E%2E/%2E%2E/%2E%2E/openrl/v1/runs",
        "/api/v1/downloads/%2E%2E%2Fcheckpoints",
        "/api/v1/downloads/x/%2E%2E/%2E%2E/sessions",
        "/api/v1/downloads//%2E%2E/%2E%2E/%2E%2E/metrics",
        "/api/v1/downloads/x/resolve/main/tokenizer.json",
        "/api/v1/downloads/",
    ],
)
def test_the_keyless_download_prefix_reaches_no_other_route(live, path):
    """Attack: the service skips the key check for any path under /api/v1/downloads/ (links carry
    their own signature); wrap another route in that prefix with encoded dot segments, hoping the
    router resolves them after the check."""
    for method in ("GET", "POST", "DELETE"):
        with httpx.Client(base_url=live.url, timeout=30) as c:
            r = c.request(method, path)
        assert r.status_code in (404, 405), (method, path, r.status_code, r.text[:300])
        refused(r, 404, 405)


@pytest.mark.parametrize(
    "headers", [{"Host": "evil.example"}, {"Origin": "http://evil.example"}, {"Origin": "null"}]
)
def test_a_rebinding_or_cross_origin_page_cannot_fetch_a_link(live, links, headers):
    """Attack: a web page that learned a link (or guesses at one) fetches it from the user's browser:
    through DNS rebinding (its own Host name) or cross-origin (its Origin). A link needs no key, so
    the Host/Origin check is all that stands between it and the page."""
    _, urls = links["alice"]
    r = httpx.get(urls["adapter_config.json"], headers=headers, timeout=30)
    refused(r, 400, 403)
    assert not any(h.lower().startswith("access-control-") for h in r.headers)


def test_an_export_link_ends_when_its_checkpoint_is_deleted_or_overwritten(live):
    """Attack: keep an export's link (a copy of the checkpoint's weights) and fetch it after the owner
    overwrote or deleted the checkpoint. The link ends with the checkpoint it was built from, and a
    deleted checkpoint's exports leave the disk."""
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=4).result()
    path = tc.save_weights_for_sampler("exported").result().path
    with live.client(ALICE_KEY) as alice:

        def export() -> dict[str, str]:
            r = alice.post("/api/v1/exports", json={"tinker_path": path, "merged": False})
            assert r.status_code == 200, r.text
            return {f["name"]: f["url"] for f in r.json()["files"]}

        first = export()
        assert httpx.get(first["adapter_model.safetensors"], timeout=30).status_code == 200
        tc.forward_backward(
            [
                tinker.types.Datum(
                    model_input=tinker.types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
                )
            ],
            "cross_entropy",
        ).result()
        tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
        tc.save_weights_for_sampler("exported").result()  # the same name: overwritten
        for url in first.values():
            assert "overwritten" in refused(httpx.get(url, timeout=30), 404)["error"]
        second = export()
        assert httpx.get(second["adapter_model.safetensors"], timeout=30).status_code == 200
        folders = live.service.store.exports_dir("alice")
        assert [p for p in folders.iterdir() if not p.name.startswith(".")]
        tinker.RestClient(base_url=live.url, api_key=ALICE_KEY).delete_checkpoint_from_tinker_path(
            path
        ).result()
        for url in second.values():
            assert "go with their checkpoint" in refused(httpx.get(url, timeout=30), 404)["error"]
        kept = [
            json.loads((p / "openrl_export.json").read_text())
            for p in folders.iterdir()
            if not p.name.startswith(".")
        ]
        assert not [info for info in kept if info["tinker_path"] == path]
    sc.close("success").result()
