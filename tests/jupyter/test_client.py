"""openrl_jupyter.client against the real service on loopback: sync, async, SSE, errors, retries."""

import asyncio
import subprocess
import sys

import httpx
import pytest

import openrl_jupyter
from openrl_jupyter import (
    AsyncClient,
    AuthenticationError,
    Client,
    NotFoundError,
    RequestError,
    ServerError,
    ServiceUnavailable,
)
from tests._support.transports import DropReply
from tests.conftest import ALICE_KEY, free_port


def test_public_names_are_pinned():
    assert sorted(openrl_jupyter.__all__) == [
        "AsyncClient",
        "AuthenticationError",
        "Client",
        "NotFoundError",
        "OpenRLError",
        "RequestError",
        "Run",
        "RunState",
        "ServerError",
        "ServiceError",
        "ServiceUnavailable",
        "Session",
        "UsageError",
        "__version__",
        "connect",
        "disconnect",
        "env",
        "get_session",
        "reward",
    ]


def test_imports_and_works_without_torch(server):
    """The client, the magics, a background run and its dashboard, with torch blocked."""
    code = (
        "import os, sys; sys.modules['torch'] = None\n"
        "from openrl_jupyter import Client\n"
        f"c = Client({server.url!r}, token={ALICE_KEY!r})\n"
        "print(c.capabilities()[0]['model_name'])\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'openrl_jupyter')\n"
        f"os.environ['OPENRL_TOKEN'] = {ALICE_KEY!r}\n"
        f"ip.run_line_magic('openrl', 'connect {server.url}')\n"
        "ip.run_cell_magic('openrl', 'reward nt', 'def reward(prompt, completion, **info):\\n    return len(completion) / 10')\n"
        "ip.user_ns['P'] = ['hi']\n"
        "run = ip.run_line_magic('openrl', 'train --reward nt --prompts P --steps 2 --group 2 --batch 1 --max-tokens 4')\n"
        "board = run.dashboard()\n"
        "print(run.wait(120).state, len(run.history))\n"
        "ip.run_line_magic('openrl', 'disconnect')\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "openrl/tiny" and "finished 2" in lines


def test_sync_client_drives_a_run(server):
    with Client(server.url, token=ALICE_KEY) as c:
        assert ALICE_KEY not in repr(c)
        run = c.create_run(name="client-test", seed=1)
        rid = run["run_id"]
        out = c.sample(rid, ["Say hi"], num_samples=4, max_tokens=6, seed=0)
        assert len(out["samples"]) == 4 and all(s["sample_id"] for s in out["samples"])
        step = c.train_step(
            rid, [{"sample_id": s["sample_id"], "advantage": (-1) ** i} for i, s in enumerate(out["samples"])]
        )
        assert step["step"] == 1 and step["grad_norm"] > 0
        c.add_metrics(rid, 1, reward_mean=0.5, reward_name="letters", reward_version=1)
        assert c.metrics(rid) == [
            {"step": 1, "reward_mean": 0.5, "reward_name": "letters", "reward_version": 1}
        ]
        path = c.save(rid, "ck")
        assert [ck["tinker_path"] for ck in c.checkpoints(rid)] == [path]
        assert c.get_run(rid)["step"] == 1 and rid in [r["run_id"] for r in c.list_runs()]
        ticks = c.events()
        first = next(ticks)
        ticks.close()
        assert first["schema"] == 2 and first["type"] == "tick"
        c.delete_run(rid)
        with pytest.raises(NotFoundError, match="unknown run"):
            c.get_run(rid)


def test_async_client_drives_a_run(server):
    async def main():
        async with AsyncClient(server.url, token=ALICE_KEY) as c:
            run = await c.create_run(name="async-test")
            out = await c.sample(run["run_id"], ["Hello"], num_samples=2, max_tokens=4)
            step = await c.train_step(
                run["run_id"], [{"sample_id": s["sample_id"], "advantage": 1.0} for s in out["samples"]]
            )
            events = c.events()
            first = await events.__anext__()
            await events.aclose()
            await c.delete_run(run["run_id"])
            return step, first

    step, first = asyncio.run(main())
    assert step["step"] == 1 and first["type"] == "tick"


def test_errors_say_what_failed_and_never_show_the_key(server):
    wrong = "tml-wrong-key-0000000000"
    with Client(server.url, token=wrong) as c, pytest.raises(AuthenticationError) as e:
        c.list_runs()
    assert "check the key" in str(e.value) and wrong not in str(e.value) and server.url in str(e.value)
    # the service's message names the keys to check; the notebook adds its own way once, not a second hint
    assert str(e.value).count("check the key") == 1 and str(e.value).count("OPENRL_TOKEN") == 1, e.value
    assert str(e.value).endswith(
        "check the key you exported (TINKER_API_KEY or OPENRL_TOKEN), or the one given to connect(token=...)"
    ), e.value
    with Client(server.url, token=ALICE_KEY) as c:
        rid = c.create_run()["run_id"]
        with pytest.raises(RequestError) as e:
            c.sample(rid, [], max_tokens=4)
        assert e.value.status == 400 and e.value.field == "prompts"
        c.delete_run(rid)


def test_unreachable_service_is_one_clear_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with Client(url, retries=1, backoff_s=0.01) as c, pytest.raises(ServiceUnavailable) as e:
        c.list_runs()
    assert url in str(e.value) and "openrl-service serve" in str(e.value)


def _flaky(status_first: int, times: int, headers: dict | None = None):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append((request.method, request.headers.get("x-idempotency-key")))
        if len(calls) <= times:
            return httpx.Response(status_first, json={"error": "busy"}, headers=headers)
        return httpx.Response(200, json={"runs": [], "step": 1})

    return calls, httpx.MockTransport(handler)


def test_gets_retry_and_posts_retry_with_one_idempotency_key_per_call(monkeypatch):
    import openrl_jupyter.client as client_module

    sleeps: list[float] = []
    monkeypatch.setattr(client_module, "time", type("Clock", (), {"sleep": staticmethod(sleeps.append)}))
    calls, transport = _flaky(503, 2)
    with Client("http://svc", retries=3, backoff_s=0.5, transport=transport) as c:
        assert c.list_runs() == []
    assert [m for m, _ in calls] == ["GET", "GET", "GET"] and sleeps == [0.5, 1.0]  # backoff
    # A POST (a train step) is retried on 429 and 503, always with the same key, so the service
    # applies it once; Retry-After is honoured.
    for status in (429, 503):
        sleeps.clear()
        calls, transport = _flaky(status, 2, headers={"Retry-After": "7"})
        with Client("http://svc", retries=3, transport=transport) as c:
            assert c.train_step("r", [{"sample_id": "s", "advantage": 1.0}])["step"] == 1
        keys = {k for _, k in calls}
        assert [m for m, _ in calls] == ["POST"] * 3 and len(keys) == 1 and None not in keys
        assert sleeps == [7.0, 7.0]
    # Each logical call has its own key; a failure the service answered (500) is not re-sent.
    calls, transport = _flaky(500, 1)
    with Client("http://svc", retries=3, backoff_s=0.0, transport=transport) as c:
        with pytest.raises(ServerError):
            c.sample("r", ["a"])
        c.sample("r", ["a"])
    assert len(calls) == 2 and calls[0][1] != calls[1][1]


@pytest.mark.parametrize(
    ("retry_after", "slept"),
    [
        ("7", 7.0),  # seconds, as the service sends it
        ("86400", 60.0),  # a day: capped at MAX_RETRY_AFTER_S
        ("Thu, 01 Jan 2099 00:00:30 GMT", 30.0),  # an HTTP-date 30 s ahead of the (fake) clock
        ("Thu, 01 Jan 2099 01:00:00 GMT", 60.0),  # an hour ahead: capped
        ("Wed, 31 Dec 2098 23:00:00 GMT", 0.0),  # already past: retry now
        ("soon", 0.5),  # garbage: the client's own backoff
        ("-5", 0.5),
        ("1e9", 0.5),
        ("9" * 400, 60.0),  # a number too big for a float is still only the cap
    ],
)
def test_retry_after_is_obeyed_within_a_bound(monkeypatch, retry_after, slept):
    """A 429/503's Retry-After (seconds or an HTTP-date) is waited, but never longer than
    MAX_RETRY_AFTER_S (60 s): a proxy's or a broken service's "retry in a day" must not freeze a
    notebook. A value that is neither falls back to the client's exponential backoff."""
    import datetime

    import openrl_jupyter.client as client_module

    now = datetime.datetime(2099, 1, 1, tzinfo=datetime.timezone.utc).timestamp()
    sleeps: list[float] = []
    clock = type("Clock", (), {"sleep": staticmethod(sleeps.append), "time": staticmethod(lambda: now)})
    monkeypatch.setattr(client_module, "time", clock)
    calls, transport = _flaky(503, 1, headers={"Retry-After": retry_after})
    with Client("http://svc", retries=3, backoff_s=0.5, transport=transport) as c:
        assert c.list_runs() == []
    assert sleeps == [slept] and len(calls) == 2
    assert client_module.MAX_RETRY_AFTER_S == 60.0  # the documented bound


def test_a_post_whose_reply_is_lost_is_retried_with_its_key_and_applied_once(server):
    """A train step whose reply never arrives (the connection drops after the service did the work)
    is re-sent with the same X-Idempotency-Key: the service answers the original reply."""
    lossy = DropReply("/train_step")
    with Client(server.url, token=ALICE_KEY, backoff_s=0.0, transport=lossy) as c:
        rid = c.create_run(name="lost-reply")["run_id"]
        try:
            out = c.sample(rid, ["Say hi"], num_samples=4, max_tokens=6, seed=0)
            items = [
                {"sample_id": s["sample_id"], "advantage": (-1) ** i} for i, s in enumerate(out["samples"])
            ]
            assert c.train_step(rid, items)["step"] == 1
            assert lossy.dropped == 1 and c.get_run(rid)["step"] == 1  # one update, not two
            steps = [k for path, k in lossy.sent if path.endswith("/train_step")]
            assert len(steps) == 2 and steps[0] == steps[1] and steps[0]
        finally:
            c.delete_run(rid)


def test_client_and_async_client_expose_the_same_api():
    """Both are built from one table of requests, so neither can lack a call the other has."""
    import inspect

    from openrl_jupyter.client import REQUESTS

    def api(cls):
        return {
            name: inspect.signature(getattr(cls, name)).parameters
            for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name))
        }

    lifecycle = {"close", "aclose"}
    sync_api, async_api = api(Client), api(AsyncClient)
    assert set(sync_api) - lifecycle == set(async_api) - lifecycle
    assert {"ready", "capabilities", "checkpoints"} <= set(async_api) and set(REQUESTS) <= set(async_api)
    for name in set(sync_api) - lifecycle:
        assert sync_api[name] == async_api[name], name
        assert inspect.iscoroutinefunction(getattr(AsyncClient, name)) or inspect.isasyncgenfunction(
            getattr(AsyncClient, name)
        ), name


def test_an_event_stream_the_service_ends_for_its_credential_is_an_authentication_error():
    """The service ends a stream whose credential stopped working with an ``error`` event
    (tests/security/test_crafted_tenants.py holds that for a revoked minted key); the notebook's client
    raises AuthenticationError for it, which the EventFeed answers by reconnecting with backoff."""
    import asyncio

    from openrl_jupyter._exceptions import AuthenticationError
    from openrl_jupyter.client import AsyncClient

    body = (
        b"retry: 2000\n\n"
        b'event: tick\ndata: {"type": "tick"}\n\n'
        b'event: error\ndata: {"error": "the credential of this stream no longer works"}\n\n'
    )

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def main():
        client = AsyncClient("http://openrl.test", token="tml-x", transport=httpx.MockTransport(handler))
        seen = []
        with pytest.raises(AuthenticationError, match="no longer works"):
            async for event in client.events():
                seen.append(event)
        await client.aclose()
        return seen

    assert asyncio.run(main()) == [{"type": "tick"}]
