"""httpx transports for tests: a real loopback connection that misbehaves once."""

from __future__ import annotations

import httpx


class DropReply(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """A real loopback connection that loses the first reply to a path ending in ``suffix``: the
    service got the request and did the work, the client sees a reset connection."""

    def __init__(self, suffix: str):
        self.suffix, self.dropped, self.sent = suffix, 0, []
        self._sync, self._async = httpx.HTTPTransport(), httpx.AsyncHTTPTransport()

    def _lose(self, request: httpx.Request) -> bool:
        self.sent.append((request.url.path, request.headers.get("x-idempotency-key")))
        if request.url.path.endswith(self.suffix) and not self.dropped:
            self.dropped += 1
            return True
        return False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._sync.handle_request(request)
        if self._lose(request):
            response.read()
            response.close()
            raise httpx.ReadError("connection reset before the reply arrived", request=request)
        return response

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._async.handle_async_request(request)
        if self._lose(request):
            await response.aread()
            await response.aclose()
            raise httpx.ReadError("connection reset before the reply arrived", request=request)
        return response

    def close(self) -> None:
        self._sync.close()

    async def aclose(self) -> None:
        await self._async.aclose()
