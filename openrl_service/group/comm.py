"""One rank's end of the group: its torch.distributed process group and the command channel.

Rank 0 (the process that serves HTTP and owns the journal and the scheduler) **sends** each command
(``call``): a name and a payload of plain values, numpy arrays and CPU tensors, broadcast to every
rank with ``broadcast_object_list``; each rank then does its part (the collectives the command implies
included) and every rank's outcome is gathered back to rank 0 (``gather_object``), which answers. The
other ranks **follow** (``follow``): receive, execute, reply, in the order rank 0 sent. Objects travel
on a gloo group of their own (on CUDA the tensors' collectives use NCCL); one lock on rank 0 keeps one
command (with its collectives) on the wire at a time, whichever thread sends it.

Agreement. A command whose ranks all succeed returns rank 0's result and the others'. When every rank
fails the same way (a user error every rank meets, such as a non-finite gradient norm) the error is
raised as on one device. When the ranks disagree, or a collective fails or times out
(``OPENRL_GROUP_TIMEOUT_S``: a rank killed, hung or cut off), the ranks' states may differ: the
process exits with :data:`EXIT_GROUP_FAILED` and `serve`'s supervisor (group/launch.py) restarts the
whole group; rank 0 then recovers from its journal, as after a kill -9.

Liveness. When no command has been sent for a while rank 0 sends a ``ping`` (a broadcast and a gather):
a follower hung while the service is idle is found within the timeout, and followers never wait on
the channel longer than the timeout while rank 0 is alive.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("openrl.group")

EXIT_GROUP_FAILED = 75  # a collective failed or the ranks disagreed: restart the group
SETUP_TIMEOUT_S = 3600.0  # how long ranks wait for each other's models to load (a big model's minutes)
HISTORY_S = 120.0  # how far back rank 0 keeps the ranks' busy times (telemetry ticks look 5 s back)


class GroupFailed(RuntimeError):
    pass


def env_rank() -> int | None:
    """This process's rank in a group `serve` started, or None when it is not one of a group's."""
    value = os.environ.get("OPENRL_RANK")
    return None if value is None else int(value)


class Group:
    """The group as one rank sees it (``rank`` 0 sends, the others follow)."""

    def __init__(
        self, *, rank: int, world_size: int, local_rank: int, device: torch.device, timeout_s: float
    ):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.timeout_s = timeout_s
        self.lock = threading.RLock()
        self.sent = 0  # commands sent (rank 0) or executed (the others)
        self._last = time.monotonic()
        self._closed = False
        self.cpu: Any = None  # the gloo group objects travel on
        self.busy_s = 0.0  # seconds spent on commands (rank 0: its own part of them)
        self.held: Callable[[], int] | None = None  # bytes of the runs' state this rank holds
        self.rank_stats: dict[int, dict] = {}  # rank 0: each rank's busy_s and memory_bytes, last seen
        self.history: deque[tuple[float, list[float]]] = deque()  # rank 0: (time, each rank's busy_s)

    # -- joining ---------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, *, timeout_s: float) -> Group:
        """This process's place in the group `serve` started it in (OPENRL_RANK, OPENRL_WORLD_SIZE,
        OPENRL_LOCAL_RANK, OPENRL_GROUP_DEVICE), before it forms (:meth:`form`)."""
        rank = int(os.environ["OPENRL_RANK"])
        device = torch.device(os.environ.get("OPENRL_GROUP_DEVICE") or "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return cls(
            rank=rank,
            world_size=int(os.environ["OPENRL_WORLD_SIZE"]),
            local_rank=int(os.environ.get("OPENRL_LOCAL_RANK", rank)),
            device=device,
            timeout_s=timeout_s,
        )

    def form(self, models: list[dict] | None = None) -> list[dict]:
        """Meet the other ranks (OPENRL_GROUP_STORE ``file:PATH`` or ``host:port``, a key prefix per
        OPENRL_GROUP_GENERATION) and form the process group. Loading models is not bounded by the
        collectives' timeout: rank 0 loads its models first and posts them (``models``); the others
        wait for that post (:data:`SETUP_TIMEOUT_S`), load the same, and say so; the process group
        forms once every rank has. Returns the models rank 0 posted."""
        where = os.environ["OPENRL_GROUP_STORE"]
        generation = os.environ.get("OPENRL_GROUP_GENERATION", "0")
        setup = datetime.timedelta(seconds=max(self.timeout_s, SETUP_TIMEOUT_S))
        if where.startswith("file:"):  # one node: a file of its own per generation
            store = dist.FileStore(where.removeprefix("file:"), self.world_size)
        else:
            host, _, port = where.rpartition(":")
            store = dist.TCPStore(host, int(port), is_master=False, timeout=setup)
            # each incarnation meets under its own prefix: keys of a failed one never mix in
            store = dist.PrefixStore(f"generation-{generation}/", store)
        store.set_timeout(setup)
        if self.rank == 0:
            store.set("models", json.dumps(models or []))
        else:
            store.wait(["models"])
            models = json.loads(store.get("models"))
        self._store = store
        return models or []

    def formed(self) -> None:
        """After :meth:`form` (and, on ranks > 0, loading the models): the process group."""
        store = self._store
        store.add("loaded", 1)
        deadline = time.monotonic() + max(self.timeout_s, SETUP_TIMEOUT_S)
        while store.add("loaded", 0) < self.world_size:  # every rank has loaded its models
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the group's ranks did not all load their models in {SETUP_TIMEOUT_S:g} s"
                )
            time.sleep(0.05)
        store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=self.timeout_s)
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )
        self.cpu = dist.new_group(backend="gloo", timeout=timeout) if self.device.type == "cuda" else None
        self._last = time.monotonic()
        log.info("rank %d of %d joined the group on %s", self.rank, self.world_size, self.device)

    # -- rank 0 --------------------------------------------------------------------------------------
    def call(self, name: str, payload: dict, local: Callable[[], Any]) -> tuple[Any, list[Any]]:
        """Send ``name`` to every rank, run ``local`` here (this rank's part), gather the outcomes:
        (rank 0's result, the other ranks' results in rank order)."""
        assert self.rank == 0
        with self.lock:
            try:
                self._broadcast([name, payload])
            except Exception as e:  # noqa: BLE001  (a rank gone: the group cannot go on)
                self.fail(f"sending {name}", e)
            self.sent += 1
            error: BaseException | None = None
            result = None
            t0 = time.monotonic()
            try:
                result = local()
            except BaseException as e:  # noqa: BLE001
                error = e
            self.busy_s += time.monotonic() - t0
            try:
                outcomes = self._gather(self._outcome(None if error is None else error))
            except Exception as e:  # noqa: BLE001
                self.fail(f"gathering the ranks' outcomes of {name}", e)
            self._last = time.monotonic()
        now = time.monotonic()
        for r, o in enumerate(outcomes):
            self.rank_stats[r] = o["stats"]
        self.history.append((now, [o["stats"]["busy_s"] for o in outcomes]))
        while len(self.history) > 2 and now - self.history[1][0] > HISTORY_S:
            self.history.popleft()
        others = outcomes[1:]
        if error is None and all(o["error"] is None for o in others):
            return result, [o["result"] for o in others]
        mine = None if error is None else type(error).__name__
        if error is not None and all(o["error"] is not None and o["error"][0] == mine for o in others):
            raise error  # every rank met the same error: as on one device
        what = [o["error"] and o["error"][0] for o in outcomes]
        self.fail(f"{name}: the ranks disagree", RuntimeError(f"errors by rank: {what}"))
        raise AssertionError  # unreachable

    def _outcome(self, error: BaseException | None, result: Any = None) -> dict:
        return {
            "result": result,
            "error": None if error is None else (type(error).__name__, str(error)),
            "stats": {
                "busy_s": self.busy_s,
                "memory_bytes": device_memory_bytes(self.device),
                "state_bytes": self.held() if self.held is not None else 0,
            },
        }

    def devices(self, window_s: float) -> list[dict]:
        """Rank 0: each rank's share of the last ``window_s`` spent on commands, and its memory."""
        history = list(self.history)
        if not history:
            return []
        now = time.monotonic()
        _, last = history[-1]
        before = [h for h in history if h[0] <= now - window_s]
        start_t, start = before[-1] if before else history[0]  # busy times as the window opened
        span = max(now - start_t, 1e-9)
        return [
            {
                "rank": r,
                "busy": min(1.0, max(0.0, (last[r] - start[r]) / span)),
                "memory_bytes": self.rank_stats.get(r, {}).get("memory_bytes"),
            }
            for r in range(len(last))
        ]

    def ping_when_idle(self, every_s: float) -> None:
        """A thread: a ping whenever nothing was sent for ``every_s`` (see the module's Liveness)."""

        def loop() -> None:
            while not self._closed:
                time.sleep(min(1.0, every_s / 4))
                if self._closed or time.monotonic() - self._last < every_s:
                    continue
                if not self.lock.acquire(timeout=0.1):
                    continue
                try:
                    if not self._closed:
                        self.call("ping", {}, lambda: None)
                finally:
                    self.lock.release()

        threading.Thread(target=loop, name="openrl-group-ping", daemon=True).start()

    def close(self) -> None:
        """Rank 0, at shutdown: the followers exit their loop."""
        with self.lock:
            if self._closed:
                return
            self.call("stop", {}, lambda: None)
            self._closed = True

    # -- the other ranks ------------------------------------------------------------------------
    def follow(self, execute: Callable[[str, dict], Any]) -> None:
        """Receive and execute rank 0's commands until it sends ``stop``."""
        while True:
            try:
                box = self._broadcast(None)
            except Exception as e:  # noqa: BLE001
                self.fail("waiting for rank 0's next command", e)
            name, payload = box
            what = payload.get("key", f"{len(payload['items'])} items" if "items" in payload else "")
            log.debug("rank %d: %s %s", self.rank, name, what)
            t0 = time.monotonic()
            try:
                result = execute(name, payload)
                error = None
            except BaseException as e:  # noqa: BLE001
                log.exception("rank %d: %s failed", self.rank, name)
                result, error = None, e
            self.busy_s += time.monotonic() - t0
            outcome = self._outcome(error, result)
            try:
                self._gather(outcome)
            except Exception as e:  # noqa: BLE001
                self.fail(f"replying to {name}", e)
            self.sent += 1
            if name == "stop":
                return

    # -- wire --------------------------------------------------------------------------------------
    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu)
        return out or []

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` over the ranks in place (one flat collective for all of them)."""
        if not tensors:
            return
        try:
            flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
            dist.all_reduce(flat)
        except Exception as e:  # noqa: BLE001
            self.fail("summing gradients over the ranks", e)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def fail(self, what: str, error: BaseException) -> None:
        """The group cannot go on: exit so that `serve` restarts every rank (module docstring)."""
        log.critical("rank %d: the group failed %s: %s; exiting for a restart", self.rank, what, error)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_GROUP_FAILED)


def device_memory_bytes(device: torch.device) -> int:
    """What this rank holds on its device: CUDA's allocated bytes, or on the CPU the process's RSS."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
