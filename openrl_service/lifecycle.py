"""The service's lifecycle: the state ``/readyz`` reports, and the drain on SIGTERM or SIGINT.

    starting ──▶ recovering ──▶ ready ──▶ draining ──▶ stopped
        └──▶ failed (the model did not load)

**Starting, recovering**: the model loads, then the journal's newest snapshot is restored and the
records after it are re-queued (see :mod:`openrl_service.engine.durability`). Until then routes
that queue work answer 503 + Retry-After (the Tinker SDK retries them), ``retrieve_future`` of a
request the service does not know yet answers ``try_again`` (its record may be about to be
replayed), and a session heartbeat is answered without looking the session up. ``/readyz`` says
``starting`` then ``recovering``.

**Draining** (``serve`` gets SIGTERM, e.g. a pod's preStop, or Ctrl-C): the service keeps its port
open and stops taking new work. Every route that would queue work (Tinker ``create_session``,
``create_model``, ``forward_backward``, ``optim_step``, ``asample``, the saves and loads, the
notebook API's POSTs) answers 503 with ``Retry-After`` and a JSON error saying the service is
shutting down; ``/readyz`` answers 503 with ``"state": "draining"``, so a load balancer stops
routing; ``/healthz`` stays 200, so the kubelet does not kill it early. The device worker runs
every op already accepted; ``retrieve_future`` keeps answering (``try_again`` while an op is queued
or running, never a 5xx) and the drain waits until the clients have fetched the results handed out
to them. Then the process exits with code 0.

With the journal on (the default), what has not run when the grace is nearly over is not failed: it
is journaled already, so the worker stops starting ops, the state is snapshotted (when the device
is between ops in time) and the process exits; the restarted service runs those ops, and their
clients, still polling, get their results then. With ``--durability none`` they are failed as below.

It exits within the grace (``--drain-grace-s`` / ``OPENRL_DRAIN_GRACE_S``, 25 s by default) plus
the second or two it takes to close connections: at ``grace - reserve`` (reserve = min(2 s, a
quarter of the grace)), whatever has not run is failed with a "service shutting down" error result,
the op running on the device included (its result is then never delivered), and the reserve lets
polling clients fetch those errors. A second SIGTERM or SIGINT skips what remains of the grace.

Ops waiting for an earlier ``seq_id`` that has not arrived cannot run (their predecessor would be
refused), so they are failed as soon as everything runnable has run.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from openrl_service.errors import ApiError, NotReady

if TYPE_CHECKING:
    from openrl_service.engine.service import TrainingService

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0  # what a refused client is told: about the time a restarted service needs
PICKUP_S = 60.0  # a result finished this long before the drain and never fetched: its client has gone
TICK_S = 0.05  # how often the drain looks at the queue and the unfetched results


class State(str, enum.Enum):
    STARTING = "starting"  # the model is loading
    RECOVERING = "recovering"  # replaying the journal (crash recovery plugs in here)
    READY = "ready"
    DRAINING = "draining"  # SIGTERM: no new work, finishing what was accepted
    STOPPED = "stopped"  # drained; the server is closing its connections
    FAILED = "failed"  # the model did not load


class ShuttingDown(ApiError):
    """New work refused while the service drains (503 + Retry-After), or an accepted op the drain's
    grace ran out on (an error result, category "server")."""

    status_code = 503
    category = "server"

    def __init__(self, message: str, *, retry_after_s: float = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def to_json(self) -> dict:
        return {**super().to_json(), "state": State.DRAINING.value, "retry_after_s": self.retry_after_s}


class Lifecycle:
    """The service's state and its drain. ``on_stopped`` (the server's "exit now") is called once the
    drain is over."""

    def __init__(self, svc: TrainingService, *, grace_s: float):
        self.svc = svc
        self.grace_s = grace_s
        self.state = State.STARTING
        self.on_stopped: Callable[[], None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reason = ""
        self._task: asyncio.Task | None = None
        self._deadline = 0.0  # monotonic: the end of the grace
        self._cut_short = ""  # the second signal that ended the drain early
        self.error = ""  # why the state is FAILED, when it is not the model load

    # -- starting --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Wait (off the loop) for the worker to load the model, recover the journal, then take work."""
        self.loop = asyncio.get_running_loop()
        engine = self.svc.engine
        while not await asyncio.to_thread(engine.ready.wait, 0.5):
            if engine.setup_error is not None or not engine.alive:
                self.state = State.FAILED
                return
        if self.state is not State.STARTING:
            return
        self.state = State.RECOVERING
        try:
            replayed = await self.svc.durability.recover()
        except Exception as e:  # noqa: BLE001 - reported by /readyz; the journal is left as it was
            log.exception("recovery failed")
            self.error = f"recovery failed: {e}"
            self.state = State.FAILED
            return
        if self.state is State.RECOVERING:
            self.state = State.READY
        if replayed:
            asyncio.ensure_future(self.svc.durability.snapshot("after recovery"))

    # -- what clients see ------------------------------------------------------------------------
    @property
    def taking_work(self) -> bool:
        return self.state is State.READY

    @property
    def coming_up(self) -> bool:
        """Starting or recovering: requests it does not know yet may be in its journal."""
        return self.state in (State.STARTING, State.RECOVERING)

    def refuse_until_recovered(self) -> None:
        """Raise NotReady (503 + Retry-After) while the service starts or recovers: what a request
        would read (a run, a session, a checkpoint list) may still be in the journal, and a 404 or an
        empty list would be wrong and final to the client."""
        if self.state is State.STARTING:
            raise NotReady("openrl-service is starting (loading the model); retry in a few seconds")
        if self.state is State.RECOVERING:
            raise NotReady(
                "openrl-service is recovering its journal after a restart; retry in a few seconds",
                retry_after_s=RETRY_AFTER_S,
            )

    def refuse_new_work(self) -> None:
        """Raise :class:`ShuttingDown` once the service drains, and NotReady (503 + Retry-After) while
        it starts or recovers; routes that queue work call this first."""
        self.refuse_until_recovered()
        if self.state in (State.DRAINING, State.STOPPED):
            why = f" ({self.reason})" if self.reason else ""
            raise ShuttingDown(
                f"openrl-service is shutting down{why} and takes no new work; "
                f"retry in {RETRY_AFTER_S:g} s (a restarted service will answer)"
            )

    def readiness(self) -> tuple[int, dict]:
        """``/readyz``: (HTTP status, body). 200 only when READY."""
        state, engine = self.state, self.svc.engine
        if state is State.STARTING and engine.setup_error is not None:
            state = State.FAILED
        if state is State.FAILED:
            return 503, {
                "status": "failed",
                "state": state.value,
                "error": self.error or str(engine.setup_error),
            }
        if state is State.STARTING:
            return 503, {"status": "loading", "state": state.value}
        if state is not State.READY:
            return 503, {"status": state.value, "state": state.value}
        base = self.svc.base  # the default model; "models" lists every served one
        return 200, {
            "status": "ready",
            "state": state.value,
            "model": base.name,
            "device": str(base.device),
            "models": [{"name": m.name, "device": str(m.base.device)} for m in self.svc.models.values()],
            "fusion": engine.fusion,
        }

    # -- draining --------------------------------------------------------------------------------
    def request_stop(self, reason: str) -> bool:
        """Begin the drain (or, on a second call, skip what is left of the grace). Safe from a signal
        handler or any thread. False when there is no running loop to drain on (exit at once)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return False
        loop.call_soon_threadsafe(self._stop_requested, reason)
        return True

    def _stop_requested(self, reason: str) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self.drain(reason))
        elif not self._cut_short:  # once: a supervisor may repeat its signal
            log.warning("%s during the drain: skipping the rest of the grace", reason)
            self._cut_short = reason.removeprefix("received ")
            self._deadline = time.monotonic()

    async def drain(self, reason: str) -> None:
        """Stop taking work, finish what was accepted, let clients fetch it; within the grace."""
        svc, engine = self.svc, self.svc.engine
        self.reason = reason
        self.state = State.DRAINING
        started, started_wall = time.monotonic(), time.time()
        self._deadline = started + self.grace_s
        reserve = min(2.0, self.grace_s / 4)
        log.warning(
            "%s: draining; no new work, finishing %d queued or running ops (grace %g s, OPENRL_DRAIN_GRACE_S)",
            reason,
            engine.runnable(),
            self.grace_s,
        )
        while engine.runnable() and engine.alive and time.monotonic() < self._deadline - reserve:
            await asyncio.sleep(TICK_S)
        if self._cut_short:
            why = f"a second signal ({self._cut_short}) cut the drain short"
        elif engine.runnable():
            why = f"its drain grace of {self.grace_s:g} s, OPENRL_DRAIN_GRACE_S, ran out"
        else:
            why = "it waited for an earlier seq_id, which was refused"
        if svc.durability.enabled:
            engine.hold()  # what has not run is journaled: the restarted service runs it
            svc.futures.hold()  # their long-polls answer try_again now; the SDK polls the successor
            left = engine.queue_depth()
            if left:
                log.warning("drain: %d accepted ops are journaled and run after the restart (%s)", left, why)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    svc.durability.snapshot("shutdown"), timeout=max(0.5, self._deadline - time.monotonic())
                )
        else:
            failed = engine.abandon(
                ShuttingDown(
                    f"openrl-service shut down before this request finished ({why}); it may not have been "
                    "applied. Resubmit it once the service is back"
                )
            )
            if failed:
                log.warning(
                    "drain: %d accepted ops did not finish and answer 'service shutting down'", failed
                )
        # With the journal, results still pending are delivered by the restarted service.
        pending = not svc.durability.enabled
        while (
            svc.futures.unfetched(since=started_wall - PICKUP_S, pending=pending)
            and time.monotonic() < self._deadline
        ):
            await asyncio.sleep(TICK_S)
        left = svc.futures.unfetched(since=started_wall - PICKUP_S, pending=pending)
        log.warning(
            "drained in %.1f s%s; exiting",
            time.monotonic() - started,
            f" ({left} results never fetched)" if left else "",
        )
        self.state = State.STOPPED
        if self.on_stopped is not None:
            self.on_stopped()
