"""At `serve --world-size 2` a tenant's device time is what both ranks spent on its ops: each op's
time on rank 0 plus the busy time rank 1 reported for it (engine/usage.py), so a training step on two
devices costs about twice its wall time. The admission side of the quota is the same at any world
size (tests/security/test_device_quota.py)."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import ALICE_KEY
from tests.service.test_world_size import batch, serving


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"X-API-Key": ALICE_KEY}, timeout=30).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_a_tenants_device_time_is_summed_over_the_ranks(tmp_path, tiny_model_dir):
    env = {"OPENRL_MAX_DEVICE_SECONDS_PER_TENANT": "3600", "OPENRL_SNAPSHOT_INTERVAL_S": "3600"}
    with serving(tmp_path / "data", tiny_model_dir, "--world-size", "2", env=env) as s:
        sc = tinker.ServiceClient(base_url=s.url, api_key=ALICE_KEY)
        tc = sc.create_lora_training_client(base_model="openrl/tiny", rank=8, seed=0).result()
        for k in range(4):  # each batch's datums split over the two ranks
            tc.forward_backward(batch(k, 6), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        got = scrape(s.url)
        sc.close("success").result()
    device = got["openrl_tenant_device_seconds_total"]
    rank0 = got["openrl_engine_busy_seconds_total"]  # her ops' time on rank 0 (she is the only tenant)
    rank1 = got['openrl_rank_busy_seconds_total{rank="1"}']  # rank 1's part of every command
    assert got["openrl_world_size"] == 2 and got["openrl_tenant_device_seconds_limit"] == 3600
    seen = f"tenant {device:.3f} s, rank 0 {rank0:.3f} s, rank 1 {rank1:.3f} s"
    assert rank1 > 0.2 * rank0, seen  # rank 1 did a real share of the work...
    assert device == pytest.approx(rank0 + rank1, rel=0.05, abs=0.02), seen  # ...and it is counted
    assert got["openrl_device_seconds_total"] == pytest.approx(device)
