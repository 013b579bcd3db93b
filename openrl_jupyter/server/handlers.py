"""The routes under ``<base_url>openrl/``: one APIHandler per route, every verb authenticated and
authorized (resource "openrl"), POSTs under jupyter_server's XSRF rules. Each forwards to the
service with the key added here; replies carry the service's data, never the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import Any
from urllib.parse import quote

import httpx
from httpx_sse import SSEError, aconnect_sse
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.iostream import StreamClosedError

from openrl_common.protocol import control_problem
from openrl_jupyter.server.connection import (
    NOT_CONFIGURED,
    ServiceError,
    Target,
    decode,
    headers,
    refused,
    unreachable,
)

API = "/openrl/v1"
RUN_ID = r"[A-Za-z0-9_.:%\-]{1,300}"  # ":" may come percent-encoded
EVENTS_READ_TIMEOUT_S = 30.0  # the service ticks every second: this long silent means a dead stream
MAX_SAMPLES = 20


class OpenRLHandler(APIHandler):
    """Base of the openrl routes: the extension, the current service, JSON errors naming it."""

    auth_resource = "openrl"
    # The panel polls: that is not the user's activity (JupyterHub's idle culler must still see an
    # idle server as idle). A control POST is activity (see ControlHandler).
    _track_activity = False

    def initialize(self, ext: Any) -> None:  # the OpenRLServer extension (app.py)
        self.ext = ext

    def target(self) -> Target:
        target = self.ext.target()
        if target is None:
            raise ServiceError(503, NOT_CONFIGURED)
        return target

    def reply(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(body))

    def fail(self, err: ServiceError) -> None:
        self.reply({"error": err.message}, err.status)

    async def call(
        self, target: Target, method: str, path: str, *, extra: dict | None = None, **kw: Any
    ) -> Any:
        """``method path`` on the service with the key; its JSON, or a ServiceError."""
        try:
            response = await self.ext.http.request(
                method, target.url + path, headers={**headers(target), **(extra or {})}, **kw
            )
        except httpx.HTTPError as exc:
            raise unreachable(target, exc) from None
        return decode(target, response)


class HealthHandler(OpenRLHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        """Whether the service answers (with this server's key), its model(s) and device load."""
        target = self.ext.target()
        out: dict[str, Any] = {
            "connected": False,
            "url": None,
            "source": None,
            "model": None,
            "models": [],
            "health": None,
            "device": {"utilization": None, "label": None, "name": None},
            "refresh_s": self.ext.refresh_s,
            "error": None,
        }
        if target is None:
            out["error"] = NOT_CONFIGURED
            return self.reply(out)
        out.update(url=target.url, source=target.source)
        try:
            ready, tick = await asyncio.gather(self.readiness(target), self.first_tick(target))
        except ServiceError as err:
            out["error"] = err.message
            return self.reply(out)
        if not isinstance(ready, dict):
            out["error"] = (
                f"openrl service at {target.url}: /readyz is not an object; is this an openrl service?"
            )
            return self.reply(out)
        util = (tick or {}).get("utilisation") or {}
        out.update(
            connected=ready.get("status") == "ready",
            health=ready.get("status"),
            model=ready.get("model"),
            models=[m.get("name") for m in ready.get("models") or [] if isinstance(m, dict)],
            device={
                "utilization": util.get("value"),
                "label": util.get("label"),
                "name": util.get("device") or ready.get("device"),
            },
        )
        if not out["connected"]:
            out["error"] = f"openrl service at {target.url}: not ready ({ready.get('status')})"
        self.reply(out)

    async def readiness(self, target: Target) -> dict:
        """``/readyz``'s body (also when it says 503: not ready yet is a state, not a failure)."""
        try:
            response = await self.ext.http.get(target.url + "/readyz")
        except httpx.HTTPError as exc:
            raise unreachable(target, exc) from None
        if response.status_code == 503:
            try:
                return dict(response.json())
            except (ValueError, TypeError):
                pass
        return decode(target, response)

    async def first_tick(self, target: Target) -> dict | None:
        """The event stream's first telemetry tick (it also proves the key is accepted)."""
        try:
            async with aconnect_sse(
                self.ext.http, "GET", target.url + API + "/events", headers=headers(target)
            ) as source:
                if source.response.status_code != 200:
                    await source.response.aread()
                    raise refused(target, source.response)
                async for sse in source.aiter_sse():
                    if sse.event == "tick":
                        return json.loads(sse.data)
        except SSEError:
            return None
        except httpx.HTTPError as exc:
            raise unreachable(target, exc) from None
        except ValueError:
            return None
        return None


class RunsHandler(OpenRLHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        """The tenant's runs: notebook runs and Tinker-SDK training runs."""
        try:
            target = self.target()
            self.reply(await self.call(target, "GET", API + "/runs", params={"include": "all"}))
        except ServiceError as err:
            self.fail(err)


class RunHandler(OpenRLHandler):
    @web.authenticated
    @authorized
    async def get(self, run_id: str) -> None:
        """One run (notebook or Tinker SDK), its metrics history and its recent samples (where its
        metrics rows carry some)."""
        try:
            target = self.target()
            path = f"{API}/runs/{checked(run_id)}"
            run, metrics = await asyncio.gather(
                self.call(target, "GET", path), self.call(target, "GET", path + "/metrics")
            )
        except ServiceError as err:
            return self.fail(err)
        rows = list((metrics or {}).get("metrics") or [])
        samples = [s for row in rows if isinstance(row, dict) for s in row.get("samples") or []]
        self.reply({"run": run, "metrics": rows, "samples": samples[-MAX_SAMPLES:]})


class ControlHandler(OpenRLHandler):
    _track_activity = True  # a person pressed pause / resume / stop

    @web.authenticated
    @authorized
    async def post(self, run_id: str) -> None:
        """Pause, resume or stop a run: ``{"action": ..., "reason": ...}``; the run's entry."""
        try:
            target = self.target()
            body = control_body(self.request.body)
            self.ext.log.info("openrl: %s run %s on %s", body["action"], run_id, target.url)
            reply = await self.call(
                target,
                "POST",
                f"{API}/runs/{checked(run_id)}/control",
                json=body,
                extra={"X-Idempotency-Key": uuid.uuid4().hex},
            )
        except ServiceError as err:
            return self.fail(err)
        self.reply(reply)


class EventsHandler(OpenRLHandler):
    """Server-Sent Events: the service's stream relayed event by event (ticks, run and control
    events). The upstream stream closes when the browser goes."""

    _gone = False

    def on_connection_close(self) -> None:
        self._gone = True

    @web.authenticated
    @authorized
    async def get(self) -> None:
        try:
            target = self.target()
        except ServiceError as err:
            return self.fail(err)
        timeout = httpx.Timeout(self.ext.timeout_s, read=EVENTS_READ_TIMEOUT_S)
        request = self.ext.http.build_request(
            "GET", target.url + API + "/events", headers=headers(target), timeout=timeout
        )
        try:
            response = await self.ext.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            return self.fail(unreachable(target, exc))
        try:
            if response.status_code != 200:
                await response.aread()
                return self.fail(refused(target, response))
            self.set_header("Content-Type", "text/event-stream")
            self.set_header("Cache-Control", "no-cache")
            self.set_header("X-Accel-Buffering", "no")  # proxies (nginx, the hub's) must not buffer
            await self.relay(response)
        finally:
            await response.aclose()
            self.log.debug("openrl: event stream from %s closed", target.url)
        with contextlib.suppress(StreamClosedError):
            self.finish(set_content_type="text/event-stream")

    async def relay(self, response: httpx.Response) -> None:
        """Copy events through, one flush per event, until either side goes."""
        lines: list[str] = []
        try:
            async for line in response.aiter_lines():
                if self._gone:
                    return
                if line:
                    lines.append(line)
                    continue
                if lines:
                    self.write("\n".join(lines) + "\n\n")
                    lines = []
                    await self.flush()
        except StreamClosedError:  # the browser went away
            self._gone = True
        except httpx.HTTPError:  # the service went away (or stopped): the browser's EventSource retries
            pass


def checked(run_id: str) -> str:
    """A run id safe to put in the service's path (no "..", no slashes: the route allows neither)."""
    if run_id in (".", ".."):
        raise ServiceError(400, f"run id must be a run's id; got {run_id!r}")
    return quote(run_id, safe="")


def control_body(raw: bytes) -> dict:
    """The checked ``{"action", "reason"}`` of a control request (errors name the field)."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise ServiceError(400, 'the body must be JSON: {"action": "pause"|"resume"|"stop"}') from None
    if not isinstance(body, dict):
        raise ServiceError(400, f"the body must be a JSON object; got {type(body).__name__}")
    control = {"action": body.get("action")}
    reason = body.get("reason") or None  # an empty reason box: the service's default reason
    if reason is not None:
        control["reason"] = reason
    problem = control_problem(control)
    if problem is not None:
        raise ServiceError(400, problem[1])
    return control


def routes(ext: Any) -> list[tuple]:  # ext: the OpenRLServer extension (app.py)
    """The extension's routes (ExtensionApp puts the server's base URL in front)."""
    kw = {"ext": ext}
    return [
        (url_path_join("openrl", "health"), HealthHandler, kw),
        (url_path_join("openrl", "runs"), RunsHandler, kw),
        (url_path_join("openrl", "runs", f"({RUN_ID})"), RunHandler, kw),
        (url_path_join("openrl", "runs", f"({RUN_ID})", "control"), ControlHandler, kw),
        (url_path_join("openrl", "events"), EventsHandler, kw),
    ]
