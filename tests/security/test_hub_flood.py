"""A flood of made-up hub tokens cannot flush the identity cache, nor turn every request into a hub
round trip: refusals are cached apart from identities, failed lookups are counted per client address,
and past OPENRL_HUB_FAILED_LOOKUPS_PER_MIN a minute that address gets 429 + Retry-After without the
hub being asked, while a credential already known valid keeps working (the same address included).

The hub here is tests/_support/jhub.py's FakeHub, a real HTTP server on loopback that counts the
requests it gets; the service is a real ``openrl-service serve``. Sources are distinct loopback
addresses (127.0.0.2, 127.0.0.3, ...): the service sees each as another client.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time

import httpx
import pytest

from openrl_service.api import hubauth
from tests._support.jhub import FakeHub
from tests._support.serve import serving

V1 = "/openrl/v1"
LIMIT = 25  # OPENRL_HUB_FAILED_LOOKUPS_PER_MIN in these tests (the default is in docs/reference/settings.md)
CHUNK = 1000  # flood requests between two checks of the hub's count
# Made-up tokens in the flood: 3,000 in `make test` (the bound is LIMIT a minute whatever the size);
# OPENRL_HUB_FLOOD_TOKENS=20000 replays the size (about 2 minutes here).
FLOOD = int(os.environ.get("OPENRL_HUB_FLOOD_TOKENS", "3000"))


@pytest.fixture
def hub():
    with FakeHub() as h:
        yield h


def serve_with(hub: FakeHub, tmp_path, tiny_model_dir, **env: str):
    return serving(
        tmp_path / "data",
        tiny_model_dir,
        "--hub-api-url",
        hub.api_url,
        env={"OPENRL_HUB_CACHE_TTL_S": "3600", **env},
    )


async def _send(url: str, tokens: list[str], source: str, concurrency: int = 32) -> list[httpx.Response]:
    transport = httpx.AsyncHTTPTransport(local_address=source, retries=0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, transport=transport, limits=limits, timeout=60) as c:
        sem = asyncio.Semaphore(concurrency)

        async def one(token: str) -> httpx.Response:
            async with sem:
                return await c.get(f"{V1}/runs", headers={"X-API-Key": token})

        return await asyncio.gather(*(one(t) for t in tokens))


def send(url: str, tokens: list[str], source: str = "127.0.0.1") -> list[httpx.Response]:
    """GET /openrl/v1/runs with each token, 32 at a time, from the loopback address ``source``."""
    return asyncio.run(_send(url, tokens, source))


def random_tokens(n: int) -> list[str]:
    return [secrets.token_hex(16) for _ in range(n)]


def test_a_flood_from_one_address_asks_the_hub_a_bounded_number_of_times_and_valid_users_keep_working(
    hub, tmp_path, tiny_model_dir
):
    alice, bob = hub.add_user("alice"), hub.add_user("bob")
    with serve_with(hub, tmp_path, tiny_model_dir, OPENRL_HUB_FAILED_LOOKUPS_PER_MIN=str(LIMIT)) as s:
        assert [r.status_code for r in send(s.url, [alice])] == [200]
        statuses: dict[int, int] = {}
        began = time.monotonic()
        for n in range(max(1, FLOOD // CHUNK)):
            # alice's token from the flooding address, in among the flood
            replies = send(s.url, random_tokens(CHUNK) + [alice])
            assert replies[-1].status_code == 200, replies[-1].text
            for r in replies[:-1]:
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert r.status_code in (401, 429), r.text
                if r.status_code == 429:
                    assert 1 <= int(r.headers["retry-after"]) <= 60, r.headers
                    assert "OPENRL_HUB_FAILED_LOOKUPS_PER_MIN" in r.json()["error"], r.text
            # asked about at most LIMIT made-up tokens a minute (+ alice's once), whatever the flood's
            # size: the window slides, so a flood that lasts past a minute earns LIMIT more
            asked = hub.asked_user() - hub.asked_user(alice)
            bound = LIMIT * (1 + int((time.monotonic() - began) // 60))
            assert asked <= bound, f"after {(n + 1) * CHUNK} made-up tokens the hub was asked {asked} times"
        assert statuses[429] >= max(1, FLOOD // CHUNK) * CHUNK - bound, statuses
        assert hub.asked_user(alice) == 1  # alice was never fetched again

        # another address is not throttled by this one's flood: its wrong token is a plain 401, and a
        # new valid token from there works
        other = send(s.url, [secrets.token_hex(16), bob], source="127.0.0.2")
        assert [r.status_code for r in other] == [401, 200], [r.text for r in other]
        # a token never seen before, from the throttled address, waits (429) without reaching the hub
        fresh = hub.add_token("bob")
        (r,) = send(s.url, [fresh])
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
        assert hub.asked_user(fresh) == 0


def test_refusals_never_evict_a_valid_identity(hub, monkeypatch):
    # HubAuth itself against the counting hub, its caches made small (the service remembers 10,000
    # identities): 1,000 refused tokens, each one hub lookup (no address given: no throttle), leave
    # alice's identity in place, and the refusals they leave behind are bounded.
    monkeypatch.setattr(hubauth, "CACHE_SIZE", 100)
    monkeypatch.setattr(hubauth, "REFUSED_CACHE_SIZE", 50, raising=False)
    alice = hub.add_user("alice")

    async def flood():
        auth = hubauth.HubAuth(hub.api_url, "openrl", 3600)
        try:
            first = await auth.resolve(alice)
            for _ in range(1000):
                assert isinstance(await auth.resolve(secrets.token_hex(16)), hubauth.Refusal)
            return first, await auth.resolve(alice), len(getattr(auth, "_refused", ()))
        finally:
            await auth.aclose()

    first, again, refusals_kept = asyncio.run(flood())
    assert first == again and again.tenant == "hub:alice"
    assert hub.asked_user() - hub.asked_user(alice) == 1000  # every refusal came from the hub
    assert hub.asked_user(alice) == 1, "alice's identity was evicted by refused tokens and fetched again"
    assert refusals_kept <= 50


def test_a_known_valid_token_is_not_throttled_when_its_answer_is_refreshed(hub, tmp_path, tiny_model_dir):
    # The address is over its limit; alice's cached answer expires (1 s) and is fetched again from
    # the hub rather than refused with 429: a credential known valid is never throttled.
    alice = hub.add_user("alice")
    with serving(
        tmp_path / "data",
        tiny_model_dir,
        "--hub-api-url",
        hub.api_url,
        env={"OPENRL_HUB_CACHE_TTL_S": "1", "OPENRL_HUB_FAILED_LOOKUPS_PER_MIN": "5"},
    ) as s:
        assert [r.status_code for r in send(s.url, [alice])] == [200]
        replies = send(s.url, random_tokens(50))
        assert sum(r.status_code == 429 for r in replies) >= 45, [r.status_code for r in replies]
        deadline = time.monotonic() + 60  # a hang guard: the refresh is due after 1 s
        while hub.asked_user(alice) < 2:
            (r,) = send(s.url, [alice])
            assert r.status_code == 200, r.text
            assert time.monotonic() < deadline, "alice's answer was never refreshed"
            time.sleep(0.05)
        (r,) = send(s.url, [alice])
        assert r.status_code == 200, r.text
