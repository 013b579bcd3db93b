"""An httpx client for the service's notebook API (``/openrl/v1``), sync and async.

    from openrl_jupyter.client import Client

    with Client("http://127.0.0.1:8000", token=key) as c:
        run = c.create_run(name="quick")
        out = c.sample(run["run_id"], ["Name a colour"], num_samples=8, max_tokens=16)
        c.train_step(run["run_id"], [{"sample_id": s["sample_id"], "advantage": 0.5} for s in out["samples"]])
        for event in c.events():        # SSE: telemetry ticks and run events
            ...

Works in a plain script: no IPython, no torch. Retries with exponential backoff on connection
errors, 429 and 5xx for idempotent calls (GET, DELETE); a POST is retried only when the connection
failed before the request was sent, so a train step is never applied twice. The key is sent as
``X-API-Key`` and never appears in a repr or an error message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from openrl_jupyter._exceptions import (
    AuthenticationError,
    NotFoundError,
    RequestError,
    ServerError,
    ServiceUnavailable,
)

API = "/openrl/v1"
RETRY_STATUS = {429, 500, 502, 503, 504}
IDEMPOTENT = {"GET", "HEAD", "DELETE", "PUT"}
SSE_READ_TIMEOUT_S = 30.0  # the service sends a tick every second: silence this long means a dead stream


def _short(text: str, limit: int = 160) -> str:
    """One short line of a reply body (an HTML error page must not fill the screen)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


class _Base:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 120.0,
        retries: int = 4,
        backoff_s: float = 0.5,
    ):
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s

    def __repr__(self) -> str:  # never the key
        return f"{type(self).__name__}(url={self.url!r})"

    def _headers(self) -> dict[str, str]:
        return {"X-API-Key": self._token} if self._token else {}

    def _should_retry(self, method: str, attempt: int, exc: Exception | None, status: int | None) -> bool:
        if attempt >= self.retries:
            return False
        if isinstance(exc, httpx.ConnectError):
            return True  # nothing was sent: safe for any method
        if method not in IDEMPOTENT:
            return False
        return exc is not None or status in RETRY_STATUS

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        if response is not None and response.headers.get("retry-after", "").isdigit():
            return float(response.headers["retry-after"])
        return min(8.0, self.backoff_s * 2**attempt)

    def _raise_for(self, method: str, path: str, response: httpx.Response) -> None:
        status = response.status_code
        if 300 <= status < 400:
            raise RequestError(
                f"{method} {path} on {self.url}: HTTP {status} redirect to "
                f"{response.headers.get('location', '?')}; this does not look like an openrl service "
                "(a login page or a proxy?)",
                status=status,
            )
        if status < 400:
            return
        try:
            body = response.json()
            message, field = body.get("error") or body.get("detail") or response.text, body.get("field")
        except (ValueError, AttributeError):
            message, field = _short(response.text) or response.reason_phrase, None
        where = f"{method} {path} on {self.url}"
        if status == 401:
            raise AuthenticationError(
                f"{where}: {message} (check the key: OPENRL_TOKEN or connect(token=...))",
                status=status,
                field=field,
            )
        if status == 404:
            raise NotFoundError(f"{where}: {message}", status=status, field=field)
        if status == 503:
            raise ServiceUnavailable(f"{where}: the service is not ready ({message}); retry shortly")
        if status >= 500:
            raise ServerError(f"{where}: the service failed ({message}); see the service log")
        raise RequestError(f"{where}: {message}", status=status, field=field)

    def _next_attempt(
        self, method: str, path: str, attempt: int, response: httpx.Response | None, exc: Exception | None
    ) -> float | None:
        """After one attempt: the delay before the next one, or None when done (errors raised here)."""
        if self._should_retry(method, attempt, exc, response.status_code if response is not None else None):
            return self._delay(attempt, response)
        if exc is not None:
            raise self._unreachable(method, path, exc) from None
        self._raise_for(method, path, response)
        return None

    def _decode(self, method: str, path: str, response: httpx.Response) -> Any:
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise RequestError(
                f"{method} {path} on {self.url}: the reply is not JSON ({_short(response.text)!r}); "
                "this does not look like an openrl service",
                status=response.status_code,
            ) from None

    def _unreachable(self, method: str, path: str, exc: Exception) -> ServiceUnavailable:
        return ServiceUnavailable(
            f"{method} {path}: cannot reach the openrl service at {self.url} ({type(exc).__name__}: {exc}); "
            "is it running? (`openrl-service serve`, or connect(local=True))"
        )


class Client(_Base):
    """Blocking client; one connection pool, closed by ``close()`` or a ``with`` block."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 120.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        transport: httpx.BaseTransport | None = None,
    ):
        super().__init__(url, token=token, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, json: Any = None, params: dict | None = None) -> Any:
        attempt = 0
        while True:
            response, exc = None, None
            try:
                response = self._http.request(method, path, json=json, params=params, headers=self._headers())
            except httpx.TransportError as e:
                exc = e
            delay = self._next_attempt(method, path, attempt, response, exc)
            if delay is None:
                return self._decode(method, path, response)
            time.sleep(delay)
            attempt += 1

    # -- the API --------------------------------------------------------------------------------
    def ready(self) -> dict:
        return self.request("GET", "/readyz")

    def capabilities(self) -> list[dict]:
        return self.request("GET", "/api/v1/get_server_capabilities")["supported_models"]

    def create_run(self, **fields: Any) -> dict:
        return self.request("POST", f"{API}/runs", json=fields)

    def list_runs(self) -> list[dict]:
        return self.request("GET", f"{API}/runs")["runs"]

    def get_run(self, run_id: str) -> dict:
        return self.request("GET", f"{API}/runs/{run_id}")

    def delete_run(self, run_id: str) -> dict:
        return self.request("DELETE", f"{API}/runs/{run_id}")

    def sample(self, run_id: str, prompts: list, **params: Any) -> dict:
        return self.request("POST", f"{API}/runs/{run_id}/sample", json={"prompts": prompts, **params})

    def train_step(
        self,
        run_id: str,
        samples: list[dict],
        *,
        loss: str = "importance_sampling",
        loss_config: dict | None = None,
        optimizer: dict | None = None,
    ) -> dict:
        body = {
            "samples": samples,
            "loss": loss,
            "loss_config": loss_config or {},
            "optimizer": optimizer or {},
        }
        return self.request("POST", f"{API}/runs/{run_id}/train_step", json=body)

    def save(self, run_id: str, name: str, **fields: Any) -> str:
        return self.request("POST", f"{API}/runs/{run_id}/checkpoints", json={"name": name, **fields})["path"]

    def checkpoints(self, run_id: str) -> list[dict]:
        return self.request("GET", f"{API}/runs/{run_id}/checkpoints")["checkpoints"]

    def add_metrics(self, run_id: str, step: int, **metrics: Any) -> dict:
        return self.request("POST", f"{API}/runs/{run_id}/metrics", json={"step": step, **metrics})

    def metrics(self, run_id: str) -> list[dict]:
        return self.request("GET", f"{API}/runs/{run_id}/metrics")["metrics"]

    def events(self) -> Iterator[dict]:
        """Telemetry ticks and run events as dicts (``type`` is "tick" or "run"), until closed."""
        from httpx_sse import connect_sse

        try:
            with connect_sse(
                self._http,
                "GET",
                f"{API}/events",
                headers=self._headers(),
                timeout=httpx.Timeout(self.timeout_s, read=SSE_READ_TIMEOUT_S),
            ) as source:
                self._raise_for("GET", f"{API}/events", source.response)
                for sse in source.iter_sse():
                    if sse.data:  # a bare "retry:" field carries no event
                        yield sse.json()
        except httpx.TransportError as e:
            raise self._unreachable("GET", f"{API}/events", e) from None


class AsyncClient(_Base):
    """The same API for asyncio code (the notebook runner's loop)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 120.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        super().__init__(url, token=token, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, json: Any = None, params: dict | None = None) -> Any:
        attempt = 0
        while True:
            response, exc = None, None
            try:
                response = await self._http.request(
                    method, path, json=json, params=params, headers=self._headers()
                )
            except httpx.TransportError as e:
                exc = e
            delay = self._next_attempt(method, path, attempt, response, exc)
            if delay is None:
                return self._decode(method, path, response)
            await asyncio.sleep(delay)
            attempt += 1

    async def create_run(self, **fields: Any) -> dict:
        return await self.request("POST", f"{API}/runs", json=fields)

    async def list_runs(self) -> list[dict]:
        return (await self.request("GET", f"{API}/runs"))["runs"]

    async def get_run(self, run_id: str) -> dict:
        return await self.request("GET", f"{API}/runs/{run_id}")

    async def delete_run(self, run_id: str) -> dict:
        return await self.request("DELETE", f"{API}/runs/{run_id}")

    async def sample(self, run_id: str, prompts: list, **params: Any) -> dict:
        return await self.request("POST", f"{API}/runs/{run_id}/sample", json={"prompts": prompts, **params})

    async def train_step(
        self,
        run_id: str,
        samples: list[dict],
        *,
        loss: str = "importance_sampling",
        loss_config: dict | None = None,
        optimizer: dict | None = None,
    ) -> dict:
        body = {
            "samples": samples,
            "loss": loss,
            "loss_config": loss_config or {},
            "optimizer": optimizer or {},
        }
        return await self.request("POST", f"{API}/runs/{run_id}/train_step", json=body)

    async def save(self, run_id: str, name: str, **fields: Any) -> str:
        return (
            await self.request("POST", f"{API}/runs/{run_id}/checkpoints", json={"name": name, **fields})
        )["path"]

    async def add_metrics(self, run_id: str, step: int, **metrics: Any) -> dict:
        return await self.request("POST", f"{API}/runs/{run_id}/metrics", json={"step": step, **metrics})

    async def metrics(self, run_id: str) -> list[dict]:
        return (await self.request("GET", f"{API}/runs/{run_id}/metrics"))["metrics"]

    async def events(self) -> AsyncIterator[dict]:
        """Telemetry ticks and run events as dicts, until the caller stops iterating."""
        from httpx_sse import aconnect_sse

        try:
            async with aconnect_sse(
                self._http,
                "GET",
                f"{API}/events",
                headers=self._headers(),
                timeout=httpx.Timeout(self.timeout_s, read=SSE_READ_TIMEOUT_S),
            ) as source:
                self._raise_for("GET", f"{API}/events", source.response)
                async for sse in source.aiter_sse():
                    if sse.data:
                        yield sse.json()
        except httpx.TransportError as e:
            raise self._unreachable("GET", f"{API}/events", e) from None
