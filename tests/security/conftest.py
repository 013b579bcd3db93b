"""The adversarial suite's shared parts: one private service per module, and the victim's state.

Every attack in tests/security/ is made by a second tenant (bob, or a hub user with a crafted name)
against the first (alice). An attack holds only if it is refused with a 4xx whose body carries no
data (:func:`refused`) AND the victim's state is the same afterwards (:func:`state_of`): her files
on disk, her live runs' weights and control state, her runs, checkpoints, jobs and metric rows as
the API lists them. Each module starts its own service (a second or two): tests here may wind a
clock forward or keep state that another module's assertions must not see.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest

from openrl_service.config import tenant_folder
from tests.conftest import ALICE_KEY, BOB_KEY, LiveServer, start_server

V1 = "/openrl/v1"
ERROR_FIELDS = {"error", "category", "field"}  # everything an error body may hold: no data


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model_dir) -> LiveServer:
    """This module's own service, tenants alice and bob."""
    server = start_server(tmp_path_factory.mktemp("security"), tiny_model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def alice(live):
    with live.client(ALICE_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def bob(live):
    with live.client(BOB_KEY) as c:
        yield c


def refused(r: httpx.Response, *statuses: int) -> dict:
    """``r`` is a refusal with one of ``statuses`` (any 4xx if none given) whose JSON body is an
    error and nothing else. Returns the body."""
    if statuses:
        assert r.status_code in statuses, (r.request.method, r.request.url, r.status_code, r.text[:500])
    else:
        assert 400 <= r.status_code < 500, (r.request.method, r.request.url, r.status_code, r.text[:500])
    body = r.json()
    assert isinstance(body, dict) and set(body) <= ERROR_FIELDS and body.get("error"), body
    return body


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def files_of(live: LiveServer, tenant: str) -> dict[str, str]:
    """Every file under the tenant's data folder, by relative path, with its SHA-256."""
    root = Path(live.data_dir) / "tenants" / tenant_folder(tenant)
    if not root.is_dir():
        return {}
    return {str(p.relative_to(root)): digest(p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


def weights_of(live: LiveServer, tenant: str) -> dict[str, str]:
    """The live runs of the tenant: a digest of each run's adapter weights and optimizer step."""
    out = {}
    for run_id, run in sorted(live.service.runs.items()):
        if run.tenant != tenant or run.state is None:
            continue
        h = hashlib.sha256()
        for p in run.state.adapter.parameters():
            h.update(p.detach().cpu().float().numpy().tobytes())
        out[run_id] = f"{h.hexdigest()} steps={run.state.steps}"
    return out


# A run's device share and orphan flag move with the wall clock; its last activity with the heartbeats
# a Tinker SDK client sends in the background (a refused request is asserted on its own reply).
VOLATILE = {"share", "orphaned", "last_activity"}


def state_of(live: LiveServer, tenant: str, key: str) -> dict:
    """What the victim would notice if an attack had worked, read from disk, memory and her API."""
    with live.client(key) as c:
        runs = c.get(f"{V1}/runs", params={"include": "all"}).json()["runs"]
        metrics = {r["run_id"]: c.get(f"{V1}/runs/{r['run_id']}/metrics").json() for r in runs}
        sdk_runs = c.get("/api/v1/training_runs", params={"limit": 1000}).json()["training_runs"]
        checkpoints = c.get("/api/v1/checkpoints", params={"limit": 1000}).json()["checkpoints"]
        sessions = c.get("/api/v1/sessions", params={"limit": 1000}).json()["sessions"]
        jobs = c.get(f"{V1}/jobs").json()["jobs"]
    return {
        "files": files_of(live, tenant),
        "weights": weights_of(live, tenant),
        "runs": sorted(
            json.dumps({k: v for k, v in r.items() if k not in VOLATILE}, sort_keys=True) for r in runs
        ),
        "metrics": metrics,
        "training_runs": sdk_runs,
        "checkpoints": checkpoints,
        "sessions": sessions,
        "jobs": jobs,
    }


@pytest.fixture
def alice_unchanged(live):
    """Asserts, after the test, that alice's state is what it was before it."""
    before = state_of(live, "alice", ALICE_KEY)
    yield
    after = state_of(live, "alice", ALICE_KEY)
    for part in before:
        assert after[part] == before[part], f"alice's {part} changed"


def sse_until(lines, stop) -> tuple[list[tuple[str, dict]], str]:
    """Read an SSE stream's lines (``response.iter_lines()``, one iterator per stream) until
    ``stop(kind, data)`` is true: ([(kind, data)], raw text)."""
    events, raw, kind = [], [], None
    for line in lines:
        raw.append(line)
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data = json.loads(line[5:])
            events.append((kind, data))
            if stop(kind, data):
                break
    return events, "\n".join(raw)
