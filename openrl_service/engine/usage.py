"""Device time per tenant: the seconds the engine's ops hold the devices for each tenant, over a
sliding window, and the quota on it (OPENRL_MAX_DEVICE_SECONDS_PER_TENANT per
OPENRL_DEVICE_SECONDS_WINDOW_S).

What is measured. The device worker runs one op (or one fused call) at a time, so an op holds this
process's device from its start to its end: forward_backward, optim_step, sampling, fused calls,
full fine-tunes, checkpoint saves and loads, each slice of a chunked op. At world size N the other
ranks report the seconds they spent on each command (group/comm.py ``busy_s``); what they spent
during the op is added, so a training step that runs on two devices costs about twice its wall time,
and sampling, which stays on rank 0, costs its wall time once.

What is refused. Over the quota a tenant's *new* requests that would queue device work are refused
with :class:`DeviceTimeExceeded` (429 + Retry-After: when the window frees room); nothing of them was
queued, so sending them again then is safe. Work already accepted always runs: a request refused
never takes a seq slot, and the ops a notebook-API request queues once it was admitted, or that a
restart replays from the journal, are not checked again.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from openrl_service.config import Limits
from openrl_service.engine.ops import QueueFull

SETTING = "OPENRL_MAX_DEVICE_SECONDS_PER_TENANT"
WINDOW_SETTING = "OPENRL_DEVICE_SECONDS_WINDOW_S"
BUCKETS = 256  # a tenant's charges are summed in at most this many time buckets per window


class DeviceTimeExceeded(QueueFull):
    """A tenant's device time in the window is at its quota: 429 + Retry-After (when it frees up)."""

    category = "user"

    def __init__(self, message: str, *, used_s: float, limit_s: float, window_s: float, frees_in_s: float):
        super().__init__(message, field="device_seconds", limit=SETTING, retry_after_s=frees_in_s)
        self.used_s, self.limit_s, self.window_s = used_s, limit_s, window_s

    def to_json(self) -> dict:
        return {
            **super().to_json(),
            "device_seconds": round(self.used_s, 3),
            "device_seconds_limit": self.limit_s,
            "window_s": self.window_s,
        }


class DeviceUsage:
    """Each tenant's device-seconds: charged by the device worker, read (and checked) anywhere.

    ``others_busy_s`` (world size > 1): the seconds the other ranks have spent on commands so far, as
    they last reported them; an op's cost is its wall time here plus what that grew by during it."""

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        others_busy_s: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limits = limits  # read at each check: an operator's change applies to the next request
        self.others_busy_s = others_busy_s
        self.clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, deque[list[float]]] = {}  # tenant -> [[bucket start, seconds], ...]
        self._totals: Counter[str] = Counter()  # tenant -> device-seconds since the service started
        self._refusals: Counter[str] = Counter()  # tenant -> requests refused for the quota

    @property
    def window_s(self) -> float:
        return float(self.limits.device_seconds_window_s) if self.limits is not None else 3600.0

    @property
    def limit_s(self) -> float | None:
        limit = self.limits.max_device_seconds_per_tenant if self.limits is not None else None
        return None if limit is None else float(limit)

    # -- the device worker ----------------------------------------------------------------------
    def begin(self) -> tuple[float, float]:
        """An op starts: the clock and the other ranks' busy seconds now."""
        return self.clock(), self.others_busy_s() if self.others_busy_s is not None else 0.0

    def charge(self, began: tuple[float, float], shares: list[tuple[str, float]]) -> float:
        """An op that began at ``began`` has ended: its device-seconds, split between ``shares``
        ((tenant, weight); one member for an op of its own). Returns the seconds charged.

        A fused call runs the requests of several tenants in one pass, and its time is apportioned
        by tokens (the weights the caller passes: each member's tokens, as the op records lay the
        members out in the call's time), so a tenant pays for the rows it sent, never a neighbour's."""
        t0, busy0 = began
        now = self.clock()
        spent = max(0.0, now - t0)
        if self.others_busy_s is not None:
            spent += max(0.0, self.others_busy_s() - busy0)
        total = sum(w for _, w in shares)
        if not shares or total <= 0:
            return 0.0
        with self._lock:
            for tenant, weight in shares:
                self._add(tenant, spent * weight / total, now)
        return spent

    def _add(self, tenant: str, seconds: float, now: float) -> None:
        width = self.window_s / BUCKETS
        buckets = self._buckets.setdefault(tenant, deque())
        if buckets and now - buckets[-1][0] < width:
            buckets[-1][1] += seconds
        else:
            buckets.append([now, seconds])
        self._totals[tenant] += seconds
        self._expire(tenant, now)

    def _expire(self, tenant: str, now: float) -> None:
        """Drop the buckets whose every charge is older than the window (lock held). A bucket counts
        until its end leaves the window: usage is over-counted by at most window/BUCKETS, never under."""
        buckets = self._buckets.get(tenant)
        width = self.window_s / BUCKETS
        while buckets and buckets[0][0] + width + self.window_s <= now:
            buckets.popleft()
        if buckets is not None and not buckets:
            del self._buckets[tenant]

    # -- anyone ---------------------------------------------------------------------------------
    def used_s(self, tenant: str) -> float:
        """The tenant's device-seconds in the last window."""
        now = self.clock()
        with self._lock:
            self._expire(tenant, now)
            return sum(s for _, s in self._buckets.get(tenant, ()))

    def total_s(self, tenant: str | None = None) -> float:
        """Device-seconds since the service started: the tenant's, or everyone's."""
        with self._lock:
            return self._totals[tenant] if tenant is not None else sum(self._totals.values())

    def refusals(self, tenant: str) -> int:
        with self._lock:
            return self._refusals[tenant]

    def frees_in_s(self, tenant: str, limit_s: float) -> float:
        """Seconds until the tenant's usage in the window is below ``limit_s`` again (0: it is)."""
        now = self.clock()
        width = self.window_s / BUCKETS
        with self._lock:
            self._expire(tenant, now)
            buckets = list(self._buckets.get(tenant, ()))
        used = sum(s for _, s in buckets)
        if used < limit_s:
            return 0.0
        for start, seconds in buckets:  # oldest first: each leaves the window at its end
            used -= seconds
            if used < limit_s:
                return max(0.0, start + width + self.window_s - now)
        return self.window_s  # (float rounding only: without its buckets a tenant uses nothing)

    def check(self, tenant: str) -> None:
        """Raise :class:`DeviceTimeExceeded` when the tenant is at its quota (no quota: never)."""
        limit = self.limit_s
        if limit is None:
            return
        used = self.used_s(tenant)
        if used < limit:
            return
        window = self.window_s
        wait = max(self.frees_in_s(tenant, limit), 0.001)
        with self._lock:
            self._refusals[tenant] += 1
        raise DeviceTimeExceeded(
            f"device time quota reached: tenant {tenant!r} has used {_amount(used)} device-seconds in the "
            f"last {window:g} s, its limit is {limit:g} ({SETTING}={limit:g} per {WINDOW_SETTING}={window:g}); "
            f"new work is refused until room frees up in {_duration(wait)} (retry then); work already "
            "accepted still runs",
            used_s=used,
            limit_s=limit,
            window_s=window,
            frees_in_s=wait,
        )

    def forget(self, tenant: str) -> None:
        """A removed (or retired) tenant: a tenant of the same name later starts from nothing."""
        with self._lock:
            self._buckets.pop(tenant, None)
            self._totals.pop(tenant, None)
            self._refusals.pop(tenant, None)

    def row(self, tenant: str) -> dict:
        """What the operator's tenant list and a tenant's /metrics show."""
        return {
            "device_seconds": round(self.used_s(tenant), 3),
            "device_seconds_total": round(self.total_s(tenant), 3),
            "device_quota_refusals": self.refusals(tenant),
        }


def _amount(seconds: float) -> str:
    return f"{seconds:.3f}" if seconds < 10 else f"{seconds:,.1f}"


def _duration(seconds: float) -> str:
    """``3.2 s``; ``14 min``; ``23.9 h``: rounded up, so a client that waits this long finds room."""
    if seconds < 120:
        return f"{math.ceil(seconds * 10) / 10:g} s"
    if seconds < 7200:
        return f"{math.ceil(seconds / 60):.0f} min"
    return f"{math.ceil(seconds / 360) / 10:g} h"
