"""Scale: full fine-tunes of a 180 M model taking turns inside a container's memory limit, through kills.

The service image (``make images``) runs the cpu overlay's container spec exactly as ``make image-check``
runs it (tests/images/_containers.py: user, read-only root, dropped capabilities, the data volume, the
/tmp tmpfs, the key file), with three things changed: the memory limit (below), the model
(``OPENRL_MODEL=scale-180m``, built offline into the data volume at the first start) and a journal
snapshot every 5 s (``OPENRL_SNAPSHOT_INTERVAL_S``). Through the unmodified Tinker SDK, at once:

- three tenants each train a full fine-tune (``rank=0``), the same seed and the same data: N steps of
  ``forward_backward`` + ``optim_step``, then ``save_state``; the first exports its checkpoint merged;
- two tenants each train a LoRA (rank 8) RL-style: a sampler snapshot, samples, the letter-fraction
  reward, an importance-sampling step; the base model is sampled through the OpenAI-compatible
  endpoint (``/oai/api/v1/completions``) every step, and a ``save_weights_for_sampler`` checkpoint half
  way and at the end; the first exports its last checkpoint (PEFT). Every export's files are
  downloaded and their SHA-256 checked against what the service listed.

The limit holds one full run and not two (P parameters):

    limit = 0.75 GiB (the process) + P x 4 B (base weights) + 1.75 x P x 20 B (a full run: fp32 weights,
            gradients, AdamW's two moments, set-aside gradients; the rest is for activations, one
            sampling batch, a sampler snapshot and the accountant's margin)

so the full runs take turns (moved to disk and back). The service is killed twice with SIGKILL at its
own crash hooks (``OPENRL_CRASH_AT``, openrl_service/crashpoints.py): half way through writing a run's
file of a journal snapshot (``snapshot_write``), then, in the next container, half way through
writing a full run's spill file (``spill_write``). The hook writes a marker on the data volume and sends itself
SIGKILL, which Linux ignores where the service is PID 1 of its container (as in a pod); so the bench
watches for the marker from the host and sends the SIGKILL there, within milliseconds, and checks
that the kill left the file half written (its ``.tmp``). Each time a new container starts on the same
data volume and port, and the clients carry on through the SDK's retries. Then a fourth full run,
alone and never killed, trains the same N steps: the reference.

Measured while it runs: ``/healthz`` every 0.1 s (latency, status), the container's memory cgroup from
the host every 0.25 s (peak usage with page cache, anonymous memory, OOM kills), ``/metrics`` every 2 s
(``openrl_full_run_moves``, ``_move_seconds``, ``_move_bytes``; counters restart with each container,
so each container's last scrape is summed), and each container's log (snapshots). It prints tables
and writes ``build/bench-scale/scale.json`` (``--out``; ``scale-short.json`` for ``--short``) with
each container's log beside it.

Exits 1 when a requirement fails: an OOM kill or any other unplanned exit of the container, a step
that failed, full-run losses that differ in any bit (between the three runs or from the reference), an
optimizer step count other than 1..N, a crash point never reached or a kill that cut no write in half,
a kill the service did not recover from (no ready container after it, or no full-run step finished
after the restart). ``--short``
(tests/images/test_bench_scale.py, under ``make image-check``; within 4 minutes on 2 cores):
scale-30m, fewer and shorter steps, the same limit formula.

    python bench/scale.py [--short] [--steps N] [--crash POINT:N ...] [--no-crash] [--keep]
                          [--service-env NAME=VALUE ...] [--image TAG] [--out FILE]
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx  # noqa: E402
from load import percentile  # noqa: E402 - bench/load.py's quantile, one definition
from tinker_rl_letters import PROMPTS, decode, letter_fraction, rl_datum  # noqa: E402

from openrl_service.models.tiny import tiny_variant, variant_parameters  # noqa: E402
from tests.images._containers import deployment, images, pod_run_args, sh  # noqa: E402

GIB = 2**30
PROCESS_BYTES = int(0.75 * GIB)  # the service process with torch, before any model or run
BASE_BYTES_PER_PARAM = 4  # fp32 base weights
FULL_BYTES_PER_PARAM = 20  # a full run: weights, gradients, AdamW's two moments, set-aside gradients
HEADROOM_RUNS = 1.75  # full runs' worth of room in the limit: one fits, two do not
SNAPSHOT_INTERVAL_S = 5
SEED = 0
FULL_LR = 1e-4
LORA_LR = 1e-3
LORA_RANK = 8
HEALTH_PERIOD_S = 0.1
HEALTH_TIMEOUT_S = 30.0
MEMORY_PERIOD_S = 0.25
METRICS_PERIOD_S = 2.0
HTTP_RETRY_S = 600.0  # raw HTTP calls (OpenAI endpoint, exports) ride through a restart this long
MAX_UNPLANNED_EXITS = 3
CRASH_MARKER = "/data/bench-crash-{epoch}"  # on the data volume: the host reads it after the kill
FULL_TENANTS = ("full-1", "full-2", "full-3")
RL_TENANTS = ("rl-1", "rl-2")
REF_TENANT = "full-ref"
MOVE_FAMILIES = ("openrl_full_run_moves", "openrl_full_run_move_seconds", "openrl_full_run_move_bytes")
# "snapshot 3 (interval): 697569034 bytes in 7 files (930044312 bytes written so far, ...) in 9.05 s"
SNAPSHOT_LOG = re.compile(r"snapshot (\d+) \(([^)]*)\): (\d+) bytes(.*?) in ([0-9.]+) s\s*$", re.M)
WRITTEN_LOG = re.compile(r"(\d+) bytes written so far")
TEXT = (
    b"The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    b"How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. The five boxing "
    b"wizards jump quickly. Jackdaws love my big sphinx of quartz. Bright vixens jump; dozy fowl quack. "
    b"A wizard's job is to vex chumps quickly in fog. Watch Jeopardy!, Alex Trebek's fun TV quiz game. "
)


@dataclass(frozen=True)
class Mode:
    """One size of the bench."""

    model: str  # the --model spec
    steps: int  # steps of every run
    batch: int  # datums per full-run step
    tokens: int  # tokens per datum
    prompts: int  # prompts per RL step (x group samples)
    group: int
    max_tokens: int
    ready_s: float  # the first start builds the model; later ones replay the journal
    timeout_s: float  # the workload and the reference run, restarts included


FULL_MODE = Mode("scale-180m", 6, 4, 64, 2, 4, 16, ready_s=900, timeout_s=5400)
SHORT_MODE = Mode("scale-30m", 4, 2, 32, 2, 4, 8, ready_s=90, timeout_s=180)
# The first container dies in its first snapshot (5 s in); the second, once it has recovered (a
# recovery writes no spill), at the third spill of the turns that resume.
DEFAULT_CRASHES = ("snapshot_write:2", "spill_write:3")


class BenchError(Exception):
    """The bench could not run (no engine, no image, the service never became ready)."""


# -- the memory limit -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    params: int

    @property
    def base_bytes(self) -> int:
        return self.params * BASE_BYTES_PER_PARAM

    @property
    def full_run_bytes(self) -> int:
        return self.params * FULL_BYTES_PER_PARAM

    def resident(self, runs: int) -> int:
        """The service with ``runs`` full runs on the device."""
        return PROCESS_BYTES + self.base_bytes + runs * self.full_run_bytes

    @property
    def limit(self) -> int:
        raw = PROCESS_BYTES + self.base_bytes + int(HEADROOM_RUNS * self.full_run_bytes)
        return -(-raw // 2**20) * 2**20  # whole MiB

    def lines(self) -> list[str]:
        g = GIB
        return [
            f"limit = {PROCESS_BYTES / g:.2f} GiB process + {self.base_bytes / g:.2f} GiB base weights "
            f"(P x {BASE_BYTES_PER_PARAM} B) + {HEADROOM_RUNS} x {self.full_run_bytes / g:.2f} GiB "
            f"(one full run, P x {FULL_BYTES_PER_PARAM} B) = {self.limit / g:.2f} GiB",
            f"  one full run resident: {self.resident(1) / g:.2f} GiB <= {self.limit / g:.2f} GiB; "
            f"two: {self.resident(2) / g:.2f} GiB > limit; all three: {self.resident(3) / g:.2f} GiB",
        ]


# -- the container, one per epoch ----------------------------------------------------------------------
@dataclass
class Epoch:
    """One container's life on the data volume."""

    index: int
    name: str
    crash: str | None
    started: float
    ready: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    marker: str | None = None
    outcome: str = "running"
    planned: bool = False  # its end was the armed crash
    pid: int | None = None  # the service's pid on the host
    marker_seen: float | None = None  # when the crash hook's marker appeared
    host_kill_ms: float | None = None  # SIGKILL sent from the host this long after the marker
    partial: list = field(default_factory=list)  # files a kill left half written (*.tmp)
    cgroup: Path | None = None
    cgroup_v2: bool = False
    peak_usage: int = 0  # the cgroup's own peak (page cache included)
    peak_anon: int = 0  # anonymous memory, the most seen by the poller
    oom_kills: int = 0
    memory: list = field(default_factory=list)  # (time, usage, anonymous) about every second
    metrics: dict = field(default_factory=dict)  # the last /metrics scrape: {(family, move): value}
    max_device_runs: int = 0  # most full runs on the device at one scrape
    snapshots: list = field(default_factory=list)  # (n, reason, bytes, seconds) from the log
    snapshot_bytes_written: int | None = None  # what this container's snapshots wrote (its log)
    stopping: float | None = None  # when SIGTERM was sent (it stops listening as it drains)


class Service:
    """The service container: each start is a new container on the same data volume and host port."""

    def __init__(
        self, eng: str, host: Path, keys: str, limit: int, env: dict[str, str], out: Path, image: str | None
    ):
        from openrl_jupyter.local import free_port

        self.eng, self.host, self.out = eng, host, out
        self.tag = image or images.tag_of("service-cpu")
        if images.image_id(eng, self.tag) is None:
            raise BenchError(f"{self.tag} is not built: make images (make bench-scale builds it)")
        self.flags, self.spec = container_flags(eng, host, keys, limit, env)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.epochs: list[Epoch] = []
        self.run_id = uuid.uuid4().hex[:8]

    @property
    def current(self) -> Epoch:
        return self.epochs[-1]

    def data(self) -> Path:
        return self.host / "openrl-data"

    def start(self, crash: str | None) -> Epoch:
        k = len(self.epochs)
        name = f"openrl-bench-scale-{self.run_id}-{k}"
        env = []
        if crash:
            env += ["--env", f"OPENRL_CRASH_AT={crash}", "--env", f"OPENRL_CRASH_MARKER={marker_path(k)}"]
        run = [self.eng, "run", "-d", "--name", name, *images.limit_args(self.eng), *self.flags, *env]
        run += ["-p", f"127.0.0.1:{self.port}:{self.spec['port']}", self.tag, *self.spec["args"]]
        epoch = Epoch(k, name, crash, time.time())
        sh(*run, timeout=120)
        epoch.pid = container_pid(self.eng, name)
        epoch.cgroup, epoch.cgroup_v2 = container_cgroup(epoch.pid)
        self.epochs.append(epoch)
        return epoch

    def state(self, epoch: Epoch) -> tuple[bool, int | None]:
        """(running, exit code); once it has exited, ``epoch.ended`` is when (the engine's clock)."""
        fmt = "{{.State.Running}} {{.State.ExitCode}} {{.State.FinishedAt.UnixNano}}"
        out = sh(self.eng, "inspect", "--format", fmt, epoch.name, check=False).stdout.split()
        if len(out) != 3:
            return False, None
        if out[0] != "true" and int(out[2]) > 0 and epoch.ended is None:
            epoch.ended = int(out[2]) / 1e9
        return out[0] == "true", int(out[1])

    def wait_ready(self, epoch: Epoch, timeout_s: float) -> str:
        """Until /readyz answers 200: "ready"; "exited" when the container exits first, "failed: ..."
        when the service says it failed (a recovery that could not finish), "timeout"."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(f"{self.url}/readyz", timeout=5)
                if r.status_code == 200:
                    epoch.ready = time.time()
                    return "ready"
                body = r.json()
                if body.get("state") == "failed":
                    return f"failed: {body.get('error')}"
            if not self.state(epoch)[0]:
                return "exited"
            time.sleep(0.5)
        return "timeout"

    def end(self, epoch: Epoch, exit_code: int | None) -> None:
        """Record how ``epoch`` ended: its exit code, its crash marker, its log; remove the container."""
        epoch.ended = epoch.ended or time.time()
        epoch.exit_code = exit_code
        marker = self.data() / Path(marker_path(epoch.index)).name
        if marker.is_file():  # empty when the host's SIGKILL came before the hook wrote the name
            epoch.marker = marker.read_text().strip() or (epoch.crash or "").partition(":")[0]
        # written as NAME.tmp and renamed when complete: what a kill cut in the middle of a write
        # (the next start clears them)
        epoch.partial = sorted(
            str(p.relative_to(self.data()))
            for p in self.data().rglob("*.tmp")
            if p.stat().st_mtime >= epoch.started
        )
        logs = sh(self.eng, "logs", epoch.name, check=False, timeout=120)
        text = logs.stdout + logs.stderr
        (self.out / f"{epoch.name}.log").write_text(text)
        epoch.snapshots = [(int(m[1]), m[2], int(m[3]), float(m[5])) for m in SNAPSHOT_LOG.finditer(text)]
        written = [int(m[1]) for m in WRITTEN_LOG.finditer(text)]
        epoch.snapshot_bytes_written = written[-1] if written else None
        sh(self.eng, "rm", "-f", "-t", "0", epoch.name, check=False)

    def stop(self, epoch: Epoch) -> None:
        """SIGTERM (the drain), then SIGKILL after the overlay's grace, as kubelet does."""
        grace = self.spec["grace"]
        epoch.stopping = time.time()
        sh(self.eng, "stop", "-t", str(grace), epoch.name, check=False, timeout=grace + 60)
        self.end(epoch, self.state(epoch)[1])
        epoch.outcome = f"stopped (SIGTERM), exit {epoch.exit_code}"
        epoch.planned = epoch.exit_code == 0

    def remove_all(self) -> None:
        for e in self.epochs:
            sh(self.eng, "rm", "-f", "-t", "0", e.name, check=False)


def marker_path(epoch: int) -> str:
    return CRASH_MARKER.format(epoch=epoch)


def container_flags(eng: str, host: Path, keys: str, limit: int, env: dict[str, str]) -> tuple[list, dict]:
    """The cpu overlay's container as ``make image-check`` runs it, with the memory limit (no swap)
    and the variables in ``env`` replaced or added."""
    flags, spec = pod_run_args(deployment("cpu"), host, keys, eng)
    pending = dict(env)
    out: list[str] = []
    i = 0
    while i < len(flags):
        flag = flags[i]
        if flag in ("--memory", "--memory-swap"):
            out += [flag, str(limit)]
            i += 2
        elif flag == "--env" and flags[i + 1].split("=", 1)[0] in pending:
            name = flags[i + 1].split("=", 1)[0]
            out += [flag, f"{name}={pending.pop(name)}"]
            i += 2
        else:
            out.append(flag)
            i += 1
    for name, value in pending.items():
        out += ["--env", f"{name}={value}"]
    if "--memory" not in out:
        raise BenchError("the cpu overlay's container has no memory limit to replace")
    spec["memory"] = limit
    return out, spec


def container_pid(eng: str, name: str) -> int | None:
    """The host's pid of the container's first process (the service)."""
    out = sh(eng, "inspect", "--format", "{{.State.Pid}}", name, check=False).stdout.strip()
    return int(out) if out.isdigit() and int(out) > 0 else None


def container_cgroup(pid: int | None) -> tuple[Path | None, bool]:
    """The container's memory cgroup folder on the host (v1 or v2), from its first process."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None, False
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (folder / "memory.max_usage_in_bytes").exists():
                return folder, False
    for line in lines:
        if line.startswith("0::"):
            folder = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
            if (folder / "memory.current").exists():
                return folder, True
    return None, False


# -- what runs beside the workload ----------------------------------------------------------------
class Poller(threading.Thread, abc.ABC):
    """Calls ``poll`` every ``period_s`` until stopped."""

    def __init__(self, period_s: float):
        super().__init__(daemon=True)
        self.period_s = period_s
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            t0 = time.monotonic()
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a monitor must not end the bench
                pass
            self.halt.wait(max(0.0, self.period_s - (time.monotonic() - t0)))

    @abc.abstractmethod
    def poll(self) -> None:
        """One measurement (each poller's own)."""

    def stop(self) -> None:
        self.halt.set()
        self.join(HEALTH_TIMEOUT_S + 5)


class CrashWatch(Poller):
    """The crash hook's SIGKILL, delivered. The hook creates its marker file, writes the point's name in
    it and sends itself SIGKILL; but where the service is PID 1 of its container (as in a pod), Linux
    drops a signal that PID 1 sends itself (SIGKILL can have no handler), and the hook carries on. So
    the bench watches for the marker from the host, where the service is an ordinary process, and
    sends the SIGKILL from there as soon as the file exists (within a few ms, while the hook still
    fsyncs its marker: what was being written stays half written, which ``Service.end`` records).
    Where the service is not PID 1 the hook's own SIGKILL is given ``GRACE_S`` to act first."""

    GRACE_S = 0.01

    def __init__(self, service: Service):
        super().__init__(0.05)
        self.service = service

    def poll(self) -> None:
        if not self.service.epochs:
            return
        e = self.service.current
        if not e.crash or e.marker_seen is not None or e.pid is None or e.ended is not None:
            return
        init = pid_one(e.pid)
        marker = self.service.data() / Path(marker_path(e.index)).name
        while not marker.exists():  # a tight loop while armed: the kill must land within the write
            if self.halt.is_set() or e is not self.service.current or e.ended is not None:
                return
            time.sleep(0.0005)
        e.marker_seen = time.time()
        if not init:
            time.sleep(self.GRACE_S)
        try:
            os.kill(e.pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # the hook's own SIGKILL did it
        except PermissionError:  # not root here: the engine delivers it (slower)
            sh(self.service.eng, "kill", "--signal", "KILL", e.name, check=False)
        e.host_kill_ms = (time.time() - e.marker_seen) * 1000


def pid_one(pid: int) -> bool:
    """Whether the host's process ``pid`` is PID 1 of its own PID namespace (NSpid's last field)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return line.split()[-1] == "1"
    except OSError:
        pass
    return False


class Health(Poller):
    """GET /healthz at ~10 Hz: (time, latency s, status or None, error kind)."""

    def __init__(self, service: Service):
        super().__init__(HEALTH_PERIOD_S)
        self.service = service
        self.samples: list[tuple[float, float, int | None, str | None]] = []
        self.client = httpx.Client(timeout=HEALTH_TIMEOUT_S)

    def poll(self) -> None:
        t0 = time.perf_counter()
        try:
            r = self.client.get(f"{self.service.url}/healthz")
            self.samples.append((time.time(), time.perf_counter() - t0, r.status_code, None))
        except httpx.TimeoutException:
            self.samples.append((time.time(), time.perf_counter() - t0, None, "timeout"))
        except httpx.HTTPError:
            self.samples.append((time.time(), time.perf_counter() - t0, None, "refused"))


class Memory(Poller):
    """The current container's memory cgroup, read from the host."""

    def __init__(self, service: Service):
        super().__init__(MEMORY_PERIOD_S)
        self.service = service

    def poll(self) -> None:
        if not self.service.epochs:
            return
        e = self.service.current
        if e.cgroup is None or e.ended is not None:
            return
        stat = dict(
            line.split() for line in (e.cgroup / "memory.stat").read_text().splitlines() if line.strip()
        )
        if e.cgroup_v2:
            peak_file = e.cgroup / "memory.peak"
            usage = int((peak_file if peak_file.exists() else e.cgroup / "memory.current").read_text())
            anon = int(stat.get("anon", 0))
            events = dict(line.split() for line in (e.cgroup / "memory.events").read_text().splitlines())
            ooms = int(events.get("oom_kill", 0))
        else:
            usage = int((e.cgroup / "memory.max_usage_in_bytes").read_text())
            anon = int(stat.get("rss", 0))
            oom = dict(line.split() for line in (e.cgroup / "memory.oom_control").read_text().splitlines())
            ooms = int(oom.get("oom_kill", 0))
        e.peak_usage = max(e.peak_usage, usage)
        e.peak_anon = max(e.peak_anon, anon)
        e.oom_kills = max(e.oom_kills, ooms)
        if not e.memory or time.time() - e.memory[-1][0] >= 1.0:
            current = e.cgroup / ("memory.current" if e.cgroup_v2 else "memory.usage_in_bytes")
            e.memory.append((round(time.time(), 2), int(current.read_text()), anon))


class Metrics(Poller):
    """/metrics every 2 s: the full runs' moves, seconds and bytes (the current container's last scrape)."""

    def __init__(self, service: Service):
        super().__init__(METRICS_PERIOD_S)
        self.service = service

    def poll(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        if not self.service.epochs or self.service.current.ready is None:
            return
        e = self.service.current
        r = httpx.get(f"{self.service.url}/metrics", timeout=10)
        if r.status_code != 200:
            return
        got: dict = {}
        device = 0
        for fam in text_string_to_metric_families(r.text):
            if fam.name in MOVE_FAMILIES:
                for s in fam.samples:
                    if s.name in (fam.name, fam.name + "_total"):
                        key = (fam.name, s.labels.get("move", ""))
                        got[key] = got.get(key, 0.0) + s.value
            elif fam.name == "openrl_full_runs":
                device += int(sum(s.value for s in fam.samples if s.labels.get("where") == "device"))
        if e.ended is None:
            e.metrics = got
            e.max_device_runs = max(e.max_device_runs, device)


# -- the workload --------------------------------------------------------------------------------
@dataclass
class Op:
    tenant: str
    kind: str
    t0: float
    t1: float
    ok: bool
    error: str | None = None


class Workload:
    """The tenants' clients (threads here, the SDK's retries patched up as the recovery tests do)."""

    def __init__(self, mode: Mode, service: Service, keys: dict[str, str]):
        self.mode, self.service, self.keys = mode, service, keys
        self.model = tiny_variant(mode.model)
        self.ops: list[Op] = []
        self.losses: dict[str, list[float]] = {}
        self.steps: dict[str, list[int]] = {}
        self.failures: list[str] = []
        self.exports: list[dict] = []
        self.lock = threading.Lock()

    def timed(self, tenant: str, kind: str, fn):
        t0 = time.time()
        try:
            out = fn()
        except Exception as exc:
            with self.lock:
                self.ops.append(Op(tenant, kind, t0, time.time(), False, repr(exc)[:500]))
            raise
        with self.lock:
            self.ops.append(Op(tenant, kind, t0, time.time(), True))
        return out

    def thread(self, name: str, target, *args) -> threading.Thread:
        def body():
            try:
                target(*args)
            except Exception as exc:  # noqa: BLE001 - recorded: the bench fails on it
                tb = traceback.format_exc(limit=4)
                with self.lock:
                    self.failures.append(f"{name}: {exc!r}\n{tb}")

        t = threading.Thread(target=body, name=name, daemon=True)
        t.start()
        return t

    def client(self, tenant: str):
        import tinker

        return tinker.ServiceClient(base_url=self.service.url, api_key=self.keys[tenant])

    # -- full runs -------------------------------------------------------------------------------
    def full_batch(self, step: int) -> list:
        from tinker import types

        n, span = self.mode.tokens, len(TEXT) - self.mode.tokens - 1
        out = []
        for i in range(self.mode.batch):
            start = ((step * self.mode.batch + i) * 37) % span
            ids = list(TEXT[start : start + n + 1])
            out.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * n},
                )
            )
        return out

    def full_run(self, tenant: str, export: bool) -> None:
        from tinker import types

        sc = self.client(tenant)
        tc = self.timed(
            tenant,
            "create full run",
            lambda: sc.create_lora_training_client(base_model=self.model, rank=0, seed=SEED).result(),
        )
        losses, steps = self.losses.setdefault(tenant, []), self.steps.setdefault(tenant, [])
        for k in range(self.mode.steps):

            def step(k=k):
                fb = tc.forward_backward(self.full_batch(k), "cross_entropy")
                opt = tc.optim_step(types.AdamParams(learning_rate=FULL_LR))
                return fb.result().metrics["loss:sum"], opt.result().metrics.get("step:max")

            loss, n = self.timed(tenant, "full step", step)
            losses.append(float(loss))
            steps.append(int(n) if n is not None else -1)
        path = self.timed(tenant, "full save_state", lambda: tc.save_state("end").result().path)
        if export:
            self.export(tenant, path, merged=True)

    # -- LoRA runs -------------------------------------------------------------------------------
    def rl_run(self, tenant: str, index: int, export: bool) -> None:
        from tinker import types

        sc = self.client(tenant)
        tc = self.timed(
            tenant,
            "create LoRA run",
            lambda: sc.create_lora_training_client(
                base_model=self.model, rank=LORA_RANK, seed=index
            ).result(),
        )
        prompts = [
            list(PROMPTS[(index * self.mode.prompts + i) % len(PROMPTS)].encode())
            for i in range(self.mode.prompts)
        ]
        steps = self.steps.setdefault(tenant, [])
        path = None
        for k in range(self.mode.steps):

            def step(k=k):
                sampler = tc.save_weights_and_get_sampling_client().result()
                params = types.SamplingParams(
                    max_tokens=self.mode.max_tokens, temperature=1.0, seed=1000 * index + k
                )
                futs = [
                    sampler.sample(types.ModelInput.from_ints(p), self.mode.group, params) for p in prompts
                ]
                datums = []
                for prompt, fut in zip(prompts, futs, strict=True):
                    seqs = fut.result().sequences
                    rewards = [letter_fraction(decode(s.tokens)) for s in seqs]
                    mean = statistics.fmean(rewards)
                    # + 1e-3: a group of equal rewards still trains, so every step has datums
                    datums += [
                        rl_datum(prompt, s.tokens, s.logprobs, r - mean + 1e-3)
                        for s, r in zip(seqs, rewards, strict=True)
                        if s.tokens
                    ]
                fb = tc.forward_backward(datums, "importance_sampling")
                opt = tc.optim_step(types.AdamParams(learning_rate=LORA_LR))
                fb.result()
                return opt.result().metrics.get("step:max")

            n = self.timed(tenant, "LoRA RL step", step)
            steps.append(int(n) if n is not None else -1)
            self.timed(tenant, "/v1 completion", lambda: self.complete(tenant, self.model))
            if k in (self.mode.steps // 2, self.mode.steps - 1):
                path = self.timed(
                    tenant,
                    "LoRA save_weights_for_sampler",
                    lambda k=k: tc.save_weights_for_sampler(f"rl-{k}").result().path,
                )
                self.timed(tenant, "/v1 completion", lambda p=path: self.complete(tenant, p))
        if export and path:
            self.export(tenant, path, merged=False)

    # -- raw HTTP: the OpenAI endpoint, exports, downloads ---------------------------------------
    def request(self, method: str, url: str, headers: dict, **kw) -> httpx.Response:
        """One HTTP call, retried while the service is down or recovering (connection refused, 502-504)."""
        deadline = time.monotonic() + HTTP_RETRY_S
        while True:
            try:
                r = httpx.request(method, url, headers=headers, timeout=900, **kw)
                if r.status_code not in (502, 503, 504) or time.monotonic() > deadline:
                    return r
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(1.0)

    def complete(self, tenant: str, model: str) -> None:
        r = self.request(
            "POST",
            f"{self.service.url}/oai/api/v1/completions",
            {"Authorization": f"Bearer {self.keys[tenant]}"},
            json={"model": model, "prompt": "Say hello:", "max_tokens": 8, "temperature": 0},
        )
        if r.status_code != 200 or "text" not in r.json()["choices"][0]:
            raise RuntimeError(f"/oai/api/v1/completions ({model}): {r.status_code} {r.text[:300]}")

    def export(self, tenant: str, path: str, merged: bool) -> None:
        kind = "export merged" if merged else "export PEFT"

        def build():
            r = self.request(
                "POST",
                f"{self.service.url}/api/v1/exports",
                {"X-API-Key": self.keys[tenant]},
                json={"tinker_path": path, "merged": merged},
            )
            if r.status_code != 200:
                raise RuntimeError(f"{kind} of {path}: {r.status_code} {r.text[:300]}")
            return r.json()["files"]

        files = self.timed(tenant, kind, build)
        total = 0
        for f in files:
            digest, size = self.timed(tenant, "download", lambda f=f: self.download(f["url"]))
            if digest != f["sha256"] or size != f["size_bytes"]:
                raise RuntimeError(f"{kind} {f['name']}: downloaded {size} B sha256 {digest}, listed {f}")
            total += size
        with self.lock:
            self.exports.append({"tenant": tenant, "kind": kind, "files": len(files), "bytes": total})

    def download(self, url: str) -> tuple[str, int]:
        deadline = time.monotonic() + HTTP_RETRY_S
        while True:
            h, n = hashlib.sha256(), 0
            try:
                with httpx.stream("GET", url, timeout=900) as r:
                    if r.status_code in (502, 503, 504) and time.monotonic() < deadline:
                        raise httpx.TransportError(f"{r.status_code}")
                    if r.status_code != 200:
                        raise RuntimeError(f"download: {r.status_code} {r.read()[:300]!r}")
                    for chunk in r.iter_bytes(1 << 20):
                        h.update(chunk)
                        n += len(chunk)
                return h.hexdigest(), n
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)


# -- the bench -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    mode: Mode
    budget: Budget
    crashes: list[str]
    service: Service
    workload: Workload
    health: Health
    violations: list[str]
    kills: list[dict]
    wall_s: float = 0.0
    workload_s: float = 0.0


def supervise(
    service: Service,
    threads: list[threading.Thread],
    crashes: list[str],
    state: dict,
    deadline: float,
    ready_s: float,
    violations: list[str],
    kills: list[dict],
) -> bool:
    """Until the threads end (True): each time the container exits, record why and start the next one
    on the same volume (armed with the next crash point, if any). False when it gives up: too many
    unplanned exits, a container that never became ready, the deadline."""
    while any(t.is_alive() for t in threads):
        epoch = service.current
        running, code = service.state(epoch)
        if not running:
            service.end(epoch, code)
            expected = crashes[state["armed"]] if state["armed"] < len(crashes) else None
            point = expected.partition(":")[0] if expected else None
            if expected and epoch.marker == point and code == 137:
                epoch.outcome, epoch.planned = f"killed (SIGKILL) at {epoch.marker}", True
                if epoch.host_kill_ms is not None:
                    epoch.outcome += f" (from the host, {epoch.host_kill_ms:.1f} ms after the marker)"
                epoch.outcome += f"; half-written: {', '.join(epoch.partial) or 'nothing'}"
                if epoch.oom_kills:  # the hook fired, but the memory cgroup killed it too (or first)
                    epoch.outcome += f", and OOM-killed (cgroup oom_kill {epoch.oom_kills})"
                state["armed"] += 1
                kills.append(
                    {
                        "point": expected,
                        "epoch": epoch.index,
                        "at": epoch.ended,
                        "partial": epoch.partial,
                        "host_kill_ms": epoch.host_kill_ms,
                    }
                )
            else:
                state["unplanned"] += 1
                if epoch.oom_kills:
                    why = f"OOM-killed (cgroup oom_kill {epoch.oom_kills})"
                else:
                    why = "an OOM kill?" if code == 137 and not epoch.marker else "a crash?"
                epoch.outcome = f"exited {code} unplanned: {why}"
                violations.append(
                    f"container {epoch.name} exited {code} with crash marker {epoch.marker!r} while "
                    f"{expected or 'nothing'} was armed (cgroup oom_kill {epoch.oom_kills}, peak "
                    f"{epoch.peak_usage / GIB:.2f} GiB): {why}; see {service.out / epoch.name}.log"
                )
                if state["unplanned"] > MAX_UNPLANNED_EXITS:
                    violations.append(f"gave up after {state['unplanned']} unplanned exits")
                    return False
            crash = crashes[state["armed"]] if state["armed"] < len(crashes) else None
            nxt = service.start(crash)
            print(
                f"  [{time.strftime('%H:%M:%S')}] {epoch.name}: {epoch.outcome}; started {nxt.name}"
                + (f" armed {crash}" if crash else ""),
                flush=True,
            )
            ready = service.wait_ready(nxt, min(ready_s, max(5.0, deadline - time.time())))
            if ready == "ready":
                print(f"  [{time.strftime('%H:%M:%S')}] {nxt.name} ready in {nxt.ready - nxt.started:.1f} s")
                for k in kills:
                    k.setdefault("ready", nxt.ready)
            elif ready != "exited":  # exited: the next turn of the loop says why
                violations.append(
                    f"{nxt.name} did not become ready after {epoch.outcome}: {ready} "
                    f"(see {service.out / nxt.name}.log)"
                )
                return False
            continue
        if time.time() > deadline:
            violations.append(
                f"stalled: the workload was still running after {deadline - state['t0']:.0f} s "
                f"({[t.name for t in threads if t.is_alive()]} not done)"
            )
            return False
        time.sleep(0.2)
    return True


def run(args: argparse.Namespace) -> Outcome:
    mode = SHORT_MODE if args.short else FULL_MODE
    if args.steps:
        mode = Mode(**{**mode.__dict__, "steps": args.steps})
    model = tiny_variant(mode.model)
    budget = Budget(variant_parameters(model))
    crashes = [] if args.no_crash else list(args.crash or DEFAULT_CRASHES)
    eng = images.engine()
    out = Path(args.out).parent  # the containers' logs go beside the JSON
    out.mkdir(parents=True, exist_ok=True)
    tenants = [*FULL_TENANTS, *RL_TENANTS, REF_TENANT]
    keys = {t: "tml-" + secrets.token_hex(24) for t in tenants}
    env = {"OPENRL_MODEL": mode.model, "OPENRL_SNAPSHOT_INTERVAL_S": str(SNAPSHOT_INTERVAL_S)}
    env |= dict(kv.split("=", 1) for kv in args.service_env)
    host = Path(tempfile.mkdtemp(prefix="openrl-bench-scale-", dir=args.work_dir))
    t_wall = time.time()
    print(
        f"scale: {model} ({budget.params / 1e6:.1f} M parameters), {len(FULL_TENANTS)} full runs + "
        f"{len(RL_TENANTS)} LoRA runs x {mode.steps} steps, kills at {crashes or 'none'}",
        flush=True,
    )
    for line in budget.lines():
        print(f"  {line}", flush=True)
    keys_file = "".join(f"{t} {k}\n" for t, k in keys.items())
    service = Service(eng, host, keys_file, budget.limit, env, out, args.image)
    health, memory, metrics, watch = Health(service), Memory(service), Metrics(service), CrashWatch(service)
    violations: list[str] = []
    kills: list[dict] = []
    workload = Workload(mode, service, keys)
    outcome = Outcome(mode, budget, crashes, service, workload, health, violations, kills)
    import tinker._client

    logging.getLogger("tinker").setLevel(logging.ERROR)  # not a warning per long poll answered try_again
    # The SDK gives a request 10 tries (~60 s); a restart with a journal replay may take longer.
    tinker._client.AsyncTinker.__init__.__kwdefaults__["max_retries"] = 1_000
    try:
        first = service.start(crashes[0] if crashes else None)
        for p in (health, memory, metrics, watch):
            p.start()
        ready = service.wait_ready(first, mode.ready_s)
        if ready != "ready":
            service.end(first, service.state(first)[1])
            raise BenchError(
                f"{first.name} did not become ready ({ready}; exit {first.exit_code}):\n"
                + (out / f"{first.name}.log").read_text()[-4000:]
            )
        print(f"  {first.name} ready in {first.ready - first.started:.1f} s (builds the model)", flush=True)
        t0 = time.time()
        state = {"armed": 0, "t0": t0, "unplanned": 0}
        threads = [workload.thread(t, workload.full_run, t, i == 0) for i, t in enumerate(FULL_TENANTS)]
        threads += [workload.thread(t, workload.rl_run, t, i, i == 0) for i, t in enumerate(RL_TENANTS)]
        done = supervise(
            service, threads, crashes, state, t0 + mode.timeout_s, mode.ready_s, violations, kills
        )
        for name in crashes[state["armed"] :]:
            violations.append(f"the crash point {name} was never reached (the workload ended first)")
        outcome.workload_s = time.time() - t0
        if done:  # the reference: one full run alone, never killed
            ref = [workload.thread(REF_TENANT, workload.full_run, REF_TENANT, False)]
            supervise(service, ref, [], state, t0 + mode.timeout_s, mode.ready_s, violations, kills)
        time.sleep(METRICS_PERIOD_S + 0.5)  # one more scrape of the last container
        last = service.current
        if service.state(last)[0]:
            service.stop(last)
            if last.exit_code != 0:
                violations.append(f"{last.name}: SIGTERM ended it with exit {last.exit_code}, not 0")
    finally:
        for p in (health, memory, metrics, watch):
            p.halt.set()
        for p in (health, memory, metrics, watch):
            if p.is_alive():
                p.join(HEALTH_TIMEOUT_S + 5)
        service.remove_all()
        if args.keep:
            print(f"  data volume kept: {host}")
        else:
            shutil.rmtree(host, ignore_errors=True)
    outcome.wall_s = time.time() - t_wall
    return outcome


# -- the report ----------------------------------------------------------------------------------
def checks(o: Outcome) -> list[tuple[str, bool, str]]:
    """(requirement, held, detail)."""
    w, mode = o.workload, o.mode
    rows = []
    ooms = sum(e.oom_kills for e in o.service.epochs)
    unplanned = [e for e in o.service.epochs if e.ended is not None and not e.planned]
    rows.append(
        (
            "no OOM kill, no unplanned exit",
            ooms == 0 and not unplanned,
            f"cgroup oom_kill {ooms}; unplanned exits: {[f'{e.name} {e.exit_code}' for e in unplanned] or 'none'}",
        )
    )
    failed = [op for op in w.ops if not op.ok]
    rows.append(
        (
            "every step succeeded",
            not failed and not w.failures,
            f"{len(w.ops)} ops, {len(failed)} failed" + (" (below)" if failed or w.failures else ""),
        )
    )
    want = list(range(1, mode.steps + 1))
    runs = (*FULL_TENANTS, *RL_TENANTS, REF_TENANT)
    wrong = [f"{t} {w.steps[t]}" for t in runs if t in w.steps and w.steps[t] != want]
    wrong += [f"{t} never ran" for t in runs if t not in w.steps]
    rows.append(
        (
            "optimizer steps 1..N per run (none lost, none twice)",
            not wrong,
            "; ".join(wrong) or f"all {len(runs)} runs {want}",
        )
    )
    full = {t: w.losses.get(t, []) for t in (*FULL_TENANTS, REF_TENANT)}
    ref = full[REF_TENANT]
    same = len(ref) == mode.steps and all(v == ref for v in full.values())
    diff = [t for t, v in full.items() if v != ref]
    if same:
        detail = f"{len(full)} runs x {mode.steps} steps, all equal to the reference's"
    elif len(ref) != mode.steps:
        detail = f"the reference run has {len(ref)} of {mode.steps} steps (it runs once the workload is done)"
    else:
        detail = f"differ from the reference: {diff}"
    rows.append(("same-seed full runs: equal losses, bit for bit", same, detail))
    for k in o.kills:
        folder = {"spill_write": "spill/", "snapshot_write": "journal/"}.get(k["point"].partition(":")[0], "")
        cut = [f for f in k["partial"] if f.startswith(folder)]
        rows.append(
            (
                f"the kill at {k['point']} cut a write in half",
                bool(cut),
                f"left {', '.join(cut)}" if cut else f"no {folder}*.tmp left (partial files: {k['partial']})",
            )
        )
        after = [
            op for op in w.ops if op.ok and op.kind == "full step" and k.get("ready") and op.t1 > k["ready"]
        ]
        rows.append(
            (
                f"the kill at {k['point']} recovered exactly",
                bool(k.get("ready")) and bool(after) and same,
                (
                    f"ready {k['ready'] - k['at']:.1f} s after the kill, {len(after)} full steps done after"
                    f" it; losses {'equal' if same else 'not shown equal (above)'}"
                )
                if k.get("ready")
                else "no ready container after it",
            )
        )
    return rows


def report(o: Outcome) -> tuple[str, dict, bool]:
    w, b, mode = o.workload, o.budget, o.mode
    epochs = o.service.epochs
    lines = [
        "",
        f"scale: {tiny_variant(mode.model)}, {b.params / 1e6:.1f} M parameters, limit "
        f"{b.limit / GIB:.2f} GiB ({b.limit} B), wall {o.wall_s:.0f} s (workload {o.workload_s:.0f} s)",
        "",
        f"  {'container':<11}{'armed':<18}{'ready s':>8}{'up s':>8}{'peak GiB':>10}{'anon GiB':>10}"
        f"{'oom':>5}{'snaps':>6}  ended",
    ]
    for e in epochs:
        ready = f"{e.ready - e.started:.1f}" if e.ready else "-"
        up = f"{(e.ended or time.time()) - e.started:.0f}"
        lines.append(
            f"  {e.index:<11}{e.crash or '-':<18}{ready:>8}{up:>8}{e.peak_usage / GIB:>10.2f}"
            f"{e.peak_anon / GIB:>10.2f}{e.oom_kills:>5}{len(e.snapshots):>6}  {e.outcome}"
        )
    peak = max((e.peak_usage for e in epochs), default=0)
    anon = max((e.peak_anon for e in epochs), default=0)
    lines += [
        "",
        f"  memory      peak {peak / GIB:.2f} GiB of {b.limit / GIB:.2f} GiB ({100 * peak / b.limit:.0f} %, page "
        f"cache included); anonymous {anon / GIB:.2f} GiB ({100 * anon / b.limit:.0f} %)",
    ]

    def serving(sample) -> bool:
        """Sent while a container was ready: not once it was told to stop, nor in the half second
        before it was killed."""
        t = sample[0] - sample[1]
        return any(
            e.ready and e.ready <= t <= min(e.stopping or float("inf"), (e.ended or float("inf")) - 0.5)
            for e in epochs
        )

    answered = [s for s in o.health.samples if s[2] is not None]
    lat = [s[1] * 1000 for s in answered]
    non200 = [s for s in answered if s[2] != 200]
    lost = [s for s in o.health.samples if s[2] is None and serving(s)]
    between = sum(1 for s in o.health.samples if s[2] is None and not serving(s))
    lines.append(
        f"  /healthz    {len(o.health.samples)} polls: p50 {percentile(lat, 0.5):.0f} ms, p99 {percentile(lat, 0.99):.0f} ms, "
        f"max {max(lat, default=float('nan')):.0f} ms; non-200 {len(non200)}"
        + (f" ({sorted({s[2] for s in non200})})" if non200 else "")
        + f"; no answer while serving {len(lost)}"
        + (f" ({', '.join(sorted({s[3] for s in lost}))})" if lost else "")
        + f", {between} while starting or restarting"
    )
    restarts = [(e.ended, n.ready or e.ended) for e, n in zip(epochs, epochs[1:], strict=False) if e.ended]
    lines += ["", f"  {'op':<32}{'n':>5}{'p50 s':>9}{'max s':>9}{'failed':>8}{'over a restart':>16}"]
    for kind in dict.fromkeys(op.kind for op in w.ops):
        ops = [op for op in w.ops if op.kind == kind]
        xs = [op.t1 - op.t0 for op in ops]
        over = sum(1 for op in ops if any(op.t0 < a < op.t1 for a, _ in restarts))
        lines.append(
            f"  {kind:<32}{len(ops):>5}{percentile(xs, 0.5):>9.2f}{max(xs):>9.2f}"
            f"{sum(not op.ok for op in ops):>8}{over:>16}"
        )
    total: dict = {}
    for e in epochs:
        for key, v in e.metrics.items():
            total[key] = total.get(key, 0.0) + v

    def m(fam: str, *moves: str) -> float | None:
        vals = [total[(fam, mv)] for mv in moves if (fam, mv) in total]
        return sum(vals) if vals else None

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    outs = ("out_disk", "out_host")
    moves_out, moves_in = m("openrl_full_run_moves", *outs), m("openrl_full_run_moves", "in")
    s_out, s_in = m("openrl_full_run_move_seconds", *outs), m("openrl_full_run_move_seconds", "in")
    b_out, b_in = m("openrl_full_run_move_bytes", *outs), m("openrl_full_run_move_bytes", "in")
    lines += [
        "",
        f"  turns       moves out {fmt(moves_out, '.0f')} (disk {fmt(m('openrl_full_run_moves', 'out_disk'), '.0f')}, "
        f"host {fmt(m('openrl_full_run_moves', 'out_host'), '.0f')}), in {fmt(moves_in, '.0f')}; "
        f"most full runs on the device at once {max((e.max_device_runs for e in epochs), default=0)}",
        f"  moved       out {fmt(b_out and b_out / GIB, '.2f')} GiB in {fmt(s_out, '.1f')} s, in "
        f"{fmt(b_in and b_in / GIB, '.2f')} GiB in {fmt(s_in, '.1f')} s"
        + ("" if b_out is not None else " (no openrl_full_run_move_bytes in /metrics)"),
    ]
    snaps = [s for e in epochs for s in e.snapshots]
    written = [e.snapshot_bytes_written for e in epochs if e.snapshot_bytes_written is not None]
    lines.append(
        f"  snapshots   {len(snaps)} (every {SNAPSHOT_INTERVAL_S} s when anything changed): "
        f"{sum(s[2] for s in snaps) / GIB:.2f} GiB in all, "
        + (
            f"{sum(written) / GIB:.2f} GiB written (unchanged files are referred to again), "
            if written
            else ""
        )
        + f"p50 {percentile([s[3] for s in snaps], 0.5):.1f} s, max {max((s[3] for s in snaps), default=0):.1f} s each"
    )
    for x in w.exports:
        lines.append(
            f"  export      {x['tenant']} {x['kind']}: {x['files']} files, {x['bytes'] / 2**20:.1f} MiB, sha256 ok"
        )
    lines += ["", f"  {'step':>6}" + "".join(f"{t:>14}" for t in (*FULL_TENANTS, REF_TENANT)) + "  equal"]
    for k in range(mode.steps):
        row = [
            w.losses.get(t, [])[k] if k < len(w.losses.get(t, [])) else None
            for t in (*FULL_TENANTS, REF_TENANT)
        ]
        eq = all(v is not None and v == row[0] for v in row)
        lines.append(
            f"  {k + 1:>6}" + "".join(f"{fmt(v, '.6f'):>14}" for v in row) + f"  {'yes' if eq else 'NO'}"
        )
    rows = checks(o)
    lines += [""] + [f"  [{'ok' if held else 'FAIL'}] {name}: {detail}" for name, held, detail in rows]
    for v in o.violations:
        lines.append(f"  [FAIL] {v}")
    for f in w.failures:  # the tracebacks are in the JSON
        lines.append(f"  [FAIL] {f.splitlines()[0][:400]}")
    ok = all(held for _, held, _ in rows) and not o.violations
    lines.append(
        f"scale: model={tiny_variant(mode.model)} params={b.params} limit_gib={b.limit / GIB:.2f} "
        f"peak_gib={peak / GIB:.2f} anon_gib={anon / GIB:.2f} healthz_p99_ms={percentile(lat, 0.99):.0f} "
        f"healthz_max_ms={max(lat, default=float('nan')):.0f} non200={len(non200)} healthz_lost={len(lost)} "
        f"moves_out={fmt(moves_out, '.0f')} kills={len(o.kills)} snapshots={len(snaps)} "
        f"wall_s={o.wall_s:.0f} ok={ok}"
    )
    result = {
        "bench": "scale",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "mode": o.mode.__dict__,
        "params": b.params,
        "limit_bytes": b.limit,
        "crashes": o.crashes,
        "epochs": [
            {k: (str(v) if isinstance(v, Path) else v) for k, v in e.__dict__.items() if k != "metrics"}
            | {"metrics": {f"{f}{{move={mv}}}": v for (f, mv), v in e.metrics.items()}}
            for e in epochs
        ],
        "healthz": {
            "polls": len(o.health.samples),
            "p50_ms": percentile(lat, 0.5),
            "p99_ms": percentile(lat, 0.99),
            "max_ms": max(lat, default=None),
            "non_200": len(non200),
            "no_answer_while_serving": len(lost),
            "no_answer_between": between,
        },
        "ops": [op.__dict__ for op in w.ops],
        "losses": w.losses,
        "steps": w.steps,
        "exports": w.exports,
        "kills": o.kills,
        "checks": [{"check": n, "ok": h, "detail": d} for n, h, d in rows],
        "violations": o.violations,
        "failures": w.failures,
        "wall_s": o.wall_s,
        "ok": ok,
    }
    return "\n".join(lines), result, ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="scale-30m, fewer shorter steps (CI: <= 4 min)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (6; --short: 4)")
    p.add_argument(
        "--crash",
        action="append",
        metavar="POINT:N",
        help=f"crash points armed in turn, one per container (default {' '.join(DEFAULT_CRASHES)})",
    )
    p.add_argument("--no-crash", action="store_true", help="no kills")
    p.add_argument(
        "--service-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an extra variable for the service container (repeatable; for experiments)",
    )
    p.add_argument("--image", default=None, help="the service image (default: the cpu overlay's tag)")
    p.add_argument("--out", default=None, help="the JSON results (the containers' logs go beside it)")
    p.add_argument("--work-dir", default=None, help="where the data volume goes (default: $TMPDIR)")
    p.add_argument("--keep", action="store_true", help="keep the data volume")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(ROOT / "build" / "bench-scale" / ("scale-short.json" if args.short else "scale.json"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        outcome = run(args)
    except BenchError as e:
        print(f"scale: {e}", file=sys.stderr)
        return 2
    text, result, ok = report(outcome)
    print(text)
    path = Path(args.out)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"(written to {path})")
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Clients still retrying against a service that is gone (after a failure) must not hold the exit.
    os._exit(code)
