"""An httpx client for the service's notebook API (``/openrl/v1``), sync and async.

    from openrl_jupyter.client import Client

    with Client("http://127.0.0.1:8000", token=key) as c:
        run = c.create_run(name="quick")
        out = c.sample(run["run_id"], ["Name a colour"], num_samples=8, max_tokens=16)
        c.train_step(run["run_id"], [{"sample_id": s["sample_id"], "advantage": 0.5} for s in out["samples"]])
        for event in c.events():        # SSE: telemetry ticks and run events
            ...

The API is one table (``REQUESTS``: a function per call that says which request it is); ``Client``
and ``AsyncClient`` get one method per entry, so the two cannot drift apart. Works in a plain
script: no IPython, no torch. Retries with exponential backoff (or the reply's
``Retry-After``, at most ``MAX_RETRY_AFTER_S``) on connection errors, 429 and 5xx for reads (GET, DELETE), and on connection
errors, 429 and 503 for a POST: every POST carries an ``X-Idempotency-Key``, one per logical call
and the same on each retry, so the service applies a train step once even when its reply was lost.
The API key is sent as ``X-API-Key`` and never appears in a repr or an error message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import email.utils
import functools
import json
import numbers
import operator
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from urllib.parse import quote

import httpx
import tenacity

from openrl_jupyter._exceptions import (
    AuthenticationError,
    NotFoundError,
    RequestError,
    ServerError,
    ServiceUnavailable,
)

API = "/openrl/v1"
RETRY_STATUS = {429, 500, 502, 503, 504}  # reads are retried on these
POST_RETRY_STATUS = {429, 503}  # a POST only on these: the service did not do the work (nor keep its reply)
IDEMPOTENT = {"GET", "HEAD", "DELETE", "PUT"}
SSE_READ_TIMEOUT_S = 30.0  # the service sends a tick every second: silence this long means a dead stream
MAX_RETRY_AFTER_S = 60.0  # a Retry-After longer than this (a proxy's "in a day") is waited this long


PREFLIGHT_S = 5.0  # connect() says nothing answers at a URL after this long, not after the retries' minutes


def preflight(
    url: str, *, within_s: float = PREFLIGHT_S, sleep: Callable[[float], None] = time.sleep
) -> None:
    """Check that something answers HTTP at ``url`` (any status will do) within ``within_s``, trying
    again after a refused connection; a ServiceUnavailable naming the URL, what was tried and how to
    start a service otherwise. The clients' own retries (minutes, with backoff) are for a service
    that answered once and restarts, not for a URL nothing listens on."""
    url = url.rstrip("/")
    start = time.monotonic()
    tries, last = 0, None
    with httpx.Client(timeout=within_s) as http:
        while True:
            tries += 1
            left = within_s - (time.monotonic() - start)
            try:
                http.get(f"{url}/readyz", timeout=max(0.5, left))
                return
            except httpx.TransportError as exc:
                last = exc
            if time.monotonic() - start + 0.5 >= within_s:
                break
            sleep(0.5)
    waited = time.monotonic() - start
    why = f"{type(last).__name__}: {last}" if str(last) else type(last).__name__
    raise ServiceUnavailable(
        f"nothing answers at {url}: tried GET {url}/readyz {tries} time{'s' if tries > 1 else ''} over "
        f"{waited:.1f} s ({why}). Check the URL (OPENRL_URL, TINKER_BASE_URL or the one given), or start "
        "a service there: `openrl-service serve` prints its URL and key; connect(local=True) "
        "(%openrl connect --local) starts one in this kernel"
    )


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header's wait in seconds, within [0, MAX_RETRY_AFTER_S]: delay-seconds or an
    HTTP-date (RFC 9110 §10.2.3); None when absent or neither (the caller's own backoff then)."""
    value = (value or "").strip()
    if value.isascii() and value.isdigit():  # "-5", "1e9" and "²" are not delay-seconds
        return MAX_RETRY_AFTER_S if len(value) > 6 else min(MAX_RETRY_AFTER_S, float(value))
    if not value:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # RFC 850 / asctime forms carry no zone: HTTP-dates are GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, min(MAX_RETRY_AFTER_S, when.timestamp() - time.time()))


def _plain(value: Any) -> Any:
    """JSON for what ``json`` cannot encode itself: numpy numbers and arrays (a grid or a seed made
    with numpy) as plain ints, floats and lists; anything else is a TypeError naming its type."""
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    if isinstance(value, numbers.Real):
        return float(value)
    tolist = getattr(value, "tolist", None)  # numpy arrays and bools, without importing numpy
    if callable(tolist):
        return tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def json_body(data: Any) -> bytes:
    """A request body as httpx's ``json=`` would encode it (compact, UTF-8, no NaN), numpy included."""
    return json.dumps(
        data, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=_plain
    ).encode()


def _short(text: str, limit: int = 160) -> str:
    """One short line of a reply body (an HTML error page must not fill the screen)."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


class _Base:
    _http_class: type[httpx.Client] | type[httpx.AsyncClient]

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 120.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
        guard: Callable[[bool], None] | None = None,
    ):
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        # ``guard(suspect)`` runs before each request leaves (its key with it) and raises to stop it:
        # an embedded service checks that its process lives, and after a connection failure
        # (``suspect``) that the URL still answers as that service (local.LocalService.check)
        self._guard = guard
        self._suspect = False
        hooks = {"request": [self._on_request]} if guard is not None else None
        self._http = self._http_class(
            base_url=self.url, timeout=timeout_s, transport=transport, event_hooks=hooks
        )

    def _check_guard(self) -> None:
        if self._guard is not None:
            self._guard(self._suspect)
            self._suspect = False

    def __repr__(self) -> str:  # never the key
        return f"{type(self).__name__}(url={self.url!r})"

    def _headers(self, call: Call | None = None) -> dict[str, str]:
        headers = {"X-API-Key": self._token} if self._token else {}
        if call is not None and call.method == "POST":
            headers["X-Idempotency-Key"] = call.key
        return headers

    def _request(self, call: Call) -> dict[str, Any]:
        """httpx arguments of ``call``: its JSON body (numpy values as plain JSON), query, headers."""
        headers = self._headers(call)
        if call.json is None:
            return {"params": call.params, "headers": headers}
        headers["Content-Type"] = "application/json"
        return {"content": json_body(call.json), "params": call.params, "headers": headers}

    def _should_retry(self, method: str, attempt: int, exc: Exception | None, status: int | None) -> bool:
        if attempt >= self.retries:
            return False
        if exc is not None:
            return True  # the connection failed; a POST carries its key, so a re-send is applied once
        return status in (RETRY_STATUS if method in IDEMPOTENT else POST_RETRY_STATUS)

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        """The reply's Retry-After (at most MAX_RETRY_AFTER_S), else exponential backoff."""
        told = retry_after_s(response.headers.get("retry-after")) if response is not None else None
        if told is not None:
            return told
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
            if isinstance(message, dict):  # the OpenAI-compatible routes: {"error": {"message", "param"}}
                message, field = message.get("message") or response.text, message.get("param")
        except (ValueError, AttributeError):
            message, field = _short(response.text) or response.reason_phrase, None
        where = f"{method} {path} on {self.url}"
        if status == 401:
            # the service's own message may already say which key to check: say it once
            told = "OPENRL_TOKEN" in str(message)
            hint = (
                ", or the one given to connect(token=...)"
                if told
                else " (check the key: OPENRL_TOKEN or connect(token=...))"
            )
            raise AuthenticationError(
                f"{where}: {message}{hint}",
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

    def _policy(self, call: Call) -> dict[str, Any]:
        """tenacity's rules for sending ``call``: which outcome is tried again (``_should_retry``), after
        how long (``_delay``: the reply's Retry-After, else the backoff), and that the last failure
        is raised as itself (a connection error) or returned (a reply, checked by ``_result``)."""

        def outcome(state: tenacity.RetryCallState) -> tuple[httpx.Response | None, BaseException | None]:
            assert state.outcome is not None  # decided after an attempt
            exc = state.outcome.exception()
            return (None, exc) if exc is not None else (state.outcome.result(), None)

        def retry(state: tenacity.RetryCallState) -> bool:
            response, exc = outcome(state)
            if exc is not None and not isinstance(exc, httpx.TransportError):
                return False  # a bug (or the guard's refusal), not the network: raised at once
            if exc is not None:
                self._suspect = True  # the next attempt checks who answers there before it sends
            attempt = _attempt(self, call, state.attempt_number - 1, exc)
            status = response.status_code if response is not None else None
            return self._should_retry(call.method, attempt, exc, status)

        def wait(state: tenacity.RetryCallState) -> float:
            return self._delay(state.attempt_number - 1, outcome(state)[0])

        return {"retry": retry, "wait": wait, "reraise": True}

    def _result(self, call: Call, response: httpx.Response) -> Any:
        self._raise_for(call.method, call.path, response)
        body = self._decode(call.method, call.path, response)
        return body[call.field] if call.field is not None else body

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


# -- the API: one table of requests, sent by both clients ------------------------------------------
@dataclasses.dataclass(frozen=True)
class Call:
    """One request of the API: what to send, and which part of the JSON reply the caller gets."""

    method: str
    path: str
    json: Any = None
    params: dict | None = None
    field: str | None = None  # return reply[field] instead of the whole reply
    # Sent as X-Idempotency-Key with a POST: one per logical call, the same on each of its retries,
    # so the service does the work once however often the request arrives.
    key: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    # False: never re-sent after a connection error that may have reached the service (the jobs
    # API's POSTs are not idempotent: a re-send could duplicate a payload version or fail with 409/401);
    # a connection that was never made is still retried
    resend: bool = True


def _attempt(client: _Base, call: Call, attempt: int, exc: Exception | None) -> int:
    """The attempt number that decides a retry: past the limit for a call that must not be re-sent."""
    if call.resend or exc is None or isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return attempt
    return client.retries


def ready() -> Call:
    """The service's readiness (``{"status": "ready", ...}``)."""
    return Call("GET", "/readyz")


def capabilities() -> Call:
    """The served models, each with its training defaults."""
    return Call("GET", "/api/v1/get_server_capabilities", field="supported_models")


def create_run(**fields: Any) -> Call:
    """Create a run (name, rank, base_model, seed...); returns its description."""
    return Call("POST", f"{API}/runs", json=fields)


def list_runs(include: str | None = None) -> Call:
    """This key's notebook runs; ``include="all"`` adds its Tinker-SDK training runs."""
    return Call("GET", f"{API}/runs", params={"include": include} if include else None, field="runs")


def get_run(run_id: str) -> Call:
    """One run's description."""
    return Call("GET", f"{API}/runs/{run_id}")


def delete_run(run_id: str) -> Call:
    """Forget a run (its saved checkpoints stay)."""
    return Call("DELETE", f"{API}/runs/{run_id}")


def heartbeat(run_id: str, state: str | None = None) -> Call:
    """Keep the run alive while the notebook is idle (``idle_timeout_s`` in its description);
    ``state`` reports the Run's state. The reply carries the run's ``control`` (the panel's word)."""
    return Call("POST", f"{API}/runs/{run_id}/heartbeat", json={"state": state} if state else None)


def control(run_id: str, action: str, reason: str | None = None) -> Call:
    """Pause, resume or stop a run (``action``), as the side panel does; returns its entry."""
    body = {"action": action, **({"reason": reason} if reason else {})}
    return Call("POST", f"{API}/runs/{run_id}/control", json=body)


def sample(run_id: str, prompts: list, **params: Any) -> Call:
    """Sample completions of ``prompts`` from the run's current weights."""
    return Call("POST", f"{API}/runs/{run_id}/sample", json={"prompts": prompts, **params})


def train_step(
    run_id: str,
    samples: list[dict],
    *,
    loss: str = "importance_sampling",
    loss_config: dict | None = None,
    optimizer: dict | None = None,
    idempotency_key: str | None = None,
    kl_coef: float | None = None,
) -> Call:
    """One RL update from sampled ``{"sample_id", "advantage"}`` pairs; returns its statistics.
    ``kl_coef``: adds that times KL(policy ‖ the run's starting weights) to the loss (reply: kl_ref).
    Sent again with the same ``idempotency_key`` (e.g. after a lost reply), it is applied once."""
    body = {"samples": samples, "loss": loss, "loss_config": loss_config or {}, "optimizer": optimizer or {}}
    if kl_coef:
        body["kl_coef"] = kl_coef
    call = Call("POST", f"{API}/runs/{run_id}/train_step", json=body)
    return dataclasses.replace(call, key=idempotency_key) if idempotency_key else call


def sft_step(
    run_id: str,
    examples: list[dict],
    *,
    optimizer: dict | None = None,
    idempotency_key: str | None = None,
) -> Call:
    """One supervised step on ``{"prompt", "completion"}`` examples (a warm start before RL); returns
    its loss per trained token. Sent again with the same ``idempotency_key``, it is applied once."""
    body = {"examples": examples, "optimizer": optimizer or {}}
    call = Call("POST", f"{API}/runs/{run_id}/sft_step", json=body)
    return dataclasses.replace(call, key=idempotency_key) if idempotency_key else call


def render(messages: list[dict], tools: list | None = None, model: str | None = None) -> Call:
    """Chat messages (and tools) as the model's template renders them: ``{tokens, stop_tokens,
    tool_family}`` (an environment's next observation)."""
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    if model:
        body["model"] = model
    return Call("POST", f"{API}/render", json=body)


def decode(tokens: list[int], model: str | None = None) -> Call:
    """Token ids as the model's text (``{text}``)."""
    return Call("POST", f"{API}/decode", json={"tokens": tokens, **({"model": model} if model else {})})


def save(run_id: str, name: str, **fields: Any) -> Call:
    """Save the run's weights as checkpoint ``name``; returns its tinker:// path."""
    return Call("POST", f"{API}/runs/{run_id}/checkpoints", json={"name": name, **fields}, field="path")


def checkpoints(run_id: str) -> Call:
    """The run's saved checkpoints."""
    return Call("GET", f"{API}/runs/{run_id}/checkpoints", field="checkpoints")


def add_metrics(run_id: str, step: int, **metrics: Any) -> Call:
    """Store one step's statistics with the run."""
    return Call("POST", f"{API}/runs/{run_id}/metrics", json={"step": step, **metrics})


def metrics(run_id: str) -> Call:
    """The statistics stored with the run, one row per step."""
    return Call("GET", f"{API}/runs/{run_id}/metrics", field="metrics")


# -- detached runs (jobs): a payload is opaque to the service, which never unpickles it ----------------
def create_job(**fields: Any) -> Call:
    """Submit a job (name, kind, where, payload, payload_sha256, reward, meta, k8s); its entry (with
    the job key only for where="local")."""
    return Call("POST", f"{API}/jobs", json=fields, resend=False)


def list_jobs() -> Call:
    """This key's jobs (a job key sees only its own)."""
    return Call("GET", f"{API}/jobs", field="jobs")


def get_job(job: str) -> Call:
    """One job's entry, by job id or (the newest job of that) name."""
    return Call("GET", f"{API}/jobs/{quote(job, safe='')}")


def job_state(job_id: str, state: str, **fields: Any) -> Call:
    """Report a job's state (running, finished, failed, stopped) with pid, host, message."""
    return Call("POST", f"{API}/jobs/{job_id}/state", json={"state": state, **fields}, resend=False)


def job_control(job_id: str, action: str, reason: str | None = None) -> Call:
    """Pause, resume or stop every run of a job; its entry."""
    body = {"action": action, **({"reason": reason} if reason else {})}
    return Call("POST", f"{API}/jobs/{job_id}/control", json=body)


def add_payload(job_id: str, payload: str, payload_sha256: str, reward: str | None = None) -> Call:
    """Send a job a new payload version (a new reward version: hot swap); ``{"version"}``."""
    body = {"payload": payload, "payload_sha256": payload_sha256, "reward": reward}
    return Call("POST", f"{API}/jobs/{job_id}/payloads", json=body, resend=False)


def payloads(job_id: str, after: int = 0) -> Call:
    """A job's payload versions after ``after`` (each with its base64 ``payload``)."""
    return Call("GET", f"{API}/jobs/{job_id}/payloads", params={"after": after}, field="payloads")


def delete_job(job_id: str) -> Call:
    """Revoke a job's key and delete its Kubernetes Job, if any (its runs stay)."""
    return Call("DELETE", f"{API}/jobs/{job_id}")


REQUESTS: dict[str, Callable[..., Call]] = {
    f.__name__: f
    for f in (
        ready,
        capabilities,
        create_run,
        list_runs,
        get_run,
        delete_run,
        heartbeat,
        control,
        sample,
        train_step,
        sft_step,
        render,
        decode,
        save,
        checkpoints,
        add_metrics,
        metrics,
        create_job,
        list_jobs,
        get_job,
        job_state,
        job_control,
        add_payload,
        payloads,
        delete_job,
    )
}


def _sync_method(build: Callable[..., Call]) -> Callable:
    @functools.wraps(build)
    def method(self: Client, *args: Any, **kwargs: Any) -> Any:
        return self.send(build(*args, **kwargs))

    method.__annotations__ = {k: v for k, v in build.__annotations__.items() if k != "return"}
    return method


def _async_method(build: Callable[..., Call]) -> Callable:
    @functools.wraps(build)
    async def method(self: AsyncClient, *args: Any, **kwargs: Any) -> Any:
        return await self.send(build(*args, **kwargs))

    method.__annotations__ = {k: v for k, v in build.__annotations__.items() if k != "return"}
    return method


class Client(_Base):
    """Blocking client; one connection pool, closed by ``close()`` or a ``with`` block.
    Its API methods are those of ``REQUESTS`` (``create_run``, ``sample``, ``train_step``...)."""

    _http_class = httpx.Client  # ``transport``: an httpx.BaseTransport

    def _on_request(self, request: httpx.Request) -> None:
        self._check_guard()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def send(self, call: Call) -> Any:
        """Send one request of the API (retried as the class docstring says); the decoded reply."""
        retrying = tenacity.Retrying(sleep=lambda s: time.sleep(s), **self._policy(call))
        try:
            response = retrying(self._http.request, call.method, call.path, **self._request(call))
        except httpx.TransportError as e:
            raise self._unreachable(call.method, call.path, e) from None
        return self._result(call, response)

    def request(self, method: str, path: str, json: Any = None, params: dict | None = None) -> Any:
        """Any path of the service, with the same retries and errors as the API methods."""
        return self.send(Call(method, path, json, params))

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
                if source.response.status_code >= 300:
                    source.response.read()  # the error's JSON body, for the message
                self._raise_for("GET", f"{API}/events", source.response)
                for sse in source.iter_sse():
                    if sse.data:  # a bare "retry:" field carries no event
                        yield sse.json()
        except httpx.TransportError as e:
            self._suspect = True
            raise self._unreachable("GET", f"{API}/events", e) from None


class AsyncClient(_Base):
    """The same API for asyncio code (the notebook runner's loop)."""

    _http_class = httpx.AsyncClient  # ``transport``: an httpx.AsyncBaseTransport

    async def _on_request(self, request: httpx.Request) -> None:
        self._check_guard()  # blocking, briefly: a process check, a proof only after a failure

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def send(self, call: Call) -> Any:
        """Send one request of the API (retried as ``Client.send``); the decoded reply."""
        retrying = tenacity.AsyncRetrying(sleep=lambda s: asyncio.sleep(s), **self._policy(call))
        try:
            response = await retrying(self._http.request, call.method, call.path, **self._request(call))
        except httpx.TransportError as e:
            raise self._unreachable(call.method, call.path, e) from None
        return self._result(call, response)

    async def request(self, method: str, path: str, json: Any = None, params: dict | None = None) -> Any:
        """Any path of the service, with the same retries and errors as the API methods."""
        return await self.send(Call(method, path, json, params))

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
                if source.response.status_code >= 300:
                    await source.response.aread()  # the error's JSON body, for the message
                self._raise_for("GET", f"{API}/events", source.response)
                async for sse in source.aiter_sse():
                    if sse.event == "error":  # the service ended the stream: its credential stopped working
                        raise AuthenticationError(
                            f"GET {API}/events on {self.url}: {sse.json().get('error', sse.data)}", status=401
                        )
                    if sse.data:
                        yield sse.json()
        except httpx.TransportError as e:
            self._suspect = True
            raise self._unreachable("GET", f"{API}/events", e) from None


for _name, _build in REQUESTS.items():
    setattr(Client, _name, _sync_method(_build))
    setattr(AsyncClient, _name, _async_method(_build))
del _name, _build
