"""Tenant folders: every tenant's data lives in a folder no other tenant's name maps to.

``tenant_folder`` must be injective over everything a tenant can be called (an API-key tenant's name,
any JupyterHub user name), also where the file system ignores case (macOS, Windows): the attacks are a
crafted short hub name equal to a long name's digest form, and names that differ only in case.
A data dir written by an older release (the earlier mapping) is migrated at start, or refused with a
message when two tenants' folders would merge.
"""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openrl_service.config import HUB_TENANT_PREFIX, TENANT_RE, hub_tenant, tenant_folder
from tests._support.jhub import FakeHub
from tests.conftest import start_server

api_tenants = st.from_regex(TENANT_RE, fullmatch=True)
hub_names = st.text(min_size=1, max_size=120) | st.text(
    alphabet=st.sampled_from("aAzZ09~%._-/ é"), min_size=1, max_size=300
)
tenants = api_tenants | hub_names.map(hub_tenant)


def _portable(folder: str) -> None:
    """A single, portable path component: ASCII, no separator, not . or .., short enough."""
    assert folder.isascii() and folder.isprintable(), folder
    assert "/" not in folder and "\\" not in folder and "\0" not in folder
    assert folder not in (".", "..") and 0 < len(folder) <= 255


@settings(max_examples=2000, suppress_health_check=[HealthCheck.too_slow])
@given(tenants, tenants)
def test_two_tenants_never_share_a_folder_even_ignoring_case(a, b):
    fa, fb = tenant_folder(a), tenant_folder(b)
    _portable(fa)
    _portable(fb)
    if a != b:
        assert fa.casefold() != fb.casefold(), (a, b, fa)
    else:
        assert fa == fb


@settings(max_examples=1000)
@given(tenants, st.data())
def test_a_name_that_differs_only_in_case_gets_another_folder(a, data):
    flips = data.draw(st.lists(st.booleans(), min_size=len(a), max_size=len(a)))
    b = "".join(c.swapcase() if flip and ":" not in c else c for c, flip in zip(a, flips, strict=True))
    if b != a and (TENANT_RE.fullmatch(b) or b.startswith(HUB_TENANT_PREFIX)):
        assert tenant_folder(a).casefold() != tenant_folder(b).casefold(), (a, b)


@pytest.mark.parametrize(
    ("victim", "attacker"),
    [
        # a long hub name is stored under a digest: a short name spelled like that digest must not land there
        ("hub:" + "x" * 300, "hub:~" + hashlib.sha256(("hub:" + "x" * 300).encode()).hexdigest()),
        ("alice", "Alice"),  # API-key tenants that differ in case (one folder on macOS/Windows)
        ("hub:alice", "hub:Alice"),
        ("hub:a/b", "hub:a%2Fb"),  # an encoded separator vs the same characters typed
        ("hub:a/b", "hub:a%2fb"),
        ("hub:é", "hub:%C3%A9"),
        ("hub:~", "hub:%7E"),
        ("hub:alice", "hub:alice "),
    ],
)
def test_crafted_names_do_not_collide(victim, attacker):
    assert tenant_folder(victim).casefold() != tenant_folder(attacker).casefold()


def test_lowercase_names_keep_their_folders():
    """Existing data of the usual names stays where it is (no migration for them)."""
    assert tenant_folder("alice") == "alice"
    assert tenant_folder("hub:alice") == "hub~alice"
    assert tenant_folder("hub:a.b-c_d") == "hub~a.b-c_d"


def test_malformed_tenants_are_refused():
    for bad in ("", "hub:", "a/b", "../x", "a:b", "-a", ".", ".."):
        with pytest.raises(ValueError, match="invalid tenant"):
            tenant_folder(bad)


@pytest.fixture
def hub_server(tmp_path, tiny_model_dir):
    with FakeHub() as hub:
        live = start_server(tmp_path / "data", tiny_model_dir, hub_api_url=hub.api_url, hub_cache_ttl_s=60)
        live.hub = hub
        yield live
        live.stop()


def test_a_crafted_hub_name_cannot_reach_a_long_named_users_runs(hub_server):
    """The hole: hub user '~<sha256 of another user's tenant>' shared the folder of that long-named
    user (checkpoints, run records, job folders). Through the API, the crafted user sees nothing."""
    victim = "v" * 250
    crafted = "~" + hashlib.sha256((HUB_TENANT_PREFIX + victim).encode()).hexdigest()
    url = hub_server.url
    as_victim = {"Authorization": f"token {hub_server.hub.add_user(victim)}"}
    as_crafted = {"Authorization": f"token {hub_server.hub.add_user(crafted)}"}
    run = httpx.post(
        f"{url}/openrl/v1/runs", headers=as_victim, json={"name": "secret", "rank": 2}, timeout=60
    )
    assert run.status_code == 201, run.text
    run_id = run.json()["run_id"]
    saved = httpx.post(
        f"{url}/openrl/v1/runs/{run_id}/checkpoints", headers=as_victim, json={"name": "ck"}, timeout=60
    )
    assert saved.status_code in (200, 201), saved.text
    path = saved.json()["path"]

    # the crafted user lists (read from its folder on disk), loads and downloads: nothing of the victim's
    runs = httpx.get(f"{url}/api/v1/training_runs", headers=as_crafted, timeout=60)
    assert runs.status_code == 200 and run_id not in runs.text, runs.text
    ckpts = httpx.get(f"{url}/api/v1/checkpoints", headers=as_crafted, timeout=60)
    assert ckpts.status_code in (200, 404) and path not in ckpts.text, ckpts.text
    load = httpx.post(
        f"{url}/openrl/v1/runs",
        headers=as_crafted,
        json={"name": "steal", "rank": 2, "load_from": path},
        timeout=60,
    )
    assert load.status_code in (403, 404), load.text
    folders = sorted(p.name for p in (hub_server.data_dir / "tenants").iterdir())
    assert tenant_folder(hub_tenant(victim)) in folders
    assert len({f.casefold() for f in folders}) == len(folders)


def _old_folder(tenant: str) -> str:
    """The mapping of releases before the fix (percent-encoding that kept case and '~')."""
    from urllib.parse import quote

    if TENANT_RE.match(tenant):
        return tenant
    name = quote(tenant[len(HUB_TENANT_PREFIX) :], safe="")
    return "hub~" + name if len(name) <= 200 else "hub~~" + hashlib.sha256(tenant.encode()).hexdigest()


def _plant_run(data_dir, folder: str, run_id: str) -> None:
    d = data_dir / "tenants" / folder / "runs" / run_id
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"training_run_id": run_id, "base_model": "openrl/tiny"}))


def test_an_old_data_dir_is_migrated_at_start(tmp_path, tiny_model_dir):
    """Folders named by the old mapping move to the new names; their owners keep their data."""
    data = tmp_path / "data"
    moved = {"Carol": "r-carol", "hub:Dave": "r-dave", "hub:e/f": "r-ef"}
    for tenant, run_id in moved.items():
        assert _old_folder(tenant) != tenant_folder(tenant)
        _plant_run(data, _old_folder(tenant), run_id)
    _plant_run(data, "alice", "r-alice")  # unchanged names stay
    live = start_server(data, tiny_model_dir)
    try:
        folders = {p.name for p in (data / "tenants").iterdir()}
        assert folders >= {tenant_folder(t) for t in moved} | {"alice"}
        assert not folders & {_old_folder(t) for t in moved}
        for tenant, run_id in moved.items():
            assert (data / "tenants" / tenant_folder(tenant) / "runs" / run_id / "run.json").is_file()
    finally:
        live.stop()


def test_an_old_data_dir_whose_folders_would_merge_is_refused(tmp_path, tiny_model_dir):
    """Two old folders that map to one new name (or a new name already taken): the service refuses to
    start and says which folders, instead of merging two tenants' data."""
    data = tmp_path / "data"
    _plant_run(data, _old_folder("Carol"), "r-1")
    _plant_run(data, tenant_folder("Carol"), "r-2")  # as if someone already made the new folder
    with pytest.raises(Exception, match=r"(?s)Carol.*%43arol|%43arol.*Carol"):
        from openrl_service.config import Settings
        from openrl_service.engine.service import TrainingService

        TrainingService(Settings(data_dir=data, port=1, api_keys={}))
