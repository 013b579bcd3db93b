"""`serve --world-size N`: the supervisor that starts a node's ranks and restarts the group.

Like torchrun's agent, `serve` itself runs no model: on each node it starts one process per device
(``world_size / nnodes`` ranks, this node's ``node_rank × that`` onward), each a `serve` with
OPENRL_RANK set. Rank 0 (node 0) serves HTTP on the socket the supervisor bound, so the port stays the
same across restarts; the supervisor also holds the data dir's lock for as long as it runs.

Rendezvous. On one node the ranks meet in a FileStore in ``<data>/group`` (0700), a new file for each
incarnation of the group (its *generation*), and talk over loopback only (GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME ``lo`` unless set): no port of the group is reachable from another host. Across
nodes node 0's supervisor binds a TCPStore on ``--master-port`` (the other nodes' supervisors and ranks
connect to ``--master-addr``), which holds the generation counter; each generation meets under its own
key prefix. That port and the ranks' own are unauthenticated: keep them inside the group's network
(the LeaderWorkerSet overlay's NetworkPolicy does; docs/security.md).

Faults. When any rank of this node exits while the service is not stopping (kill -9, a collective that
failed or timed out: group/comm.py), the supervisor moves the store's generation on and kills its other
ranks; every node's supervisor sees the new generation, kills its ranks, and starts them again, and
rank 0 recovers from the journal as after a crash, so nothing acknowledged is lost. More than
``OPENRL_GROUP_MAX_RESTARTS`` failures in a row, each within a minute of its start, and `serve` gives
up (exit 1). The ranks die with the supervisor (PR_SET_PDEATHSIG): a kill -9 of `serve` leaves no
rank behind. SIGTERM goes to rank 0, which drains, tells the other ranks to stop, and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("openrl.group")

PR_SET_PDEATHSIG = 1
QUICK_FAILURE_S = 60.0  # a generation that failed sooner than this counts toward the restart limit


def die_with_parent() -> None:
    """In a rank, before exec: SIGKILL when the supervisor dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Layout:
    world_size: int
    nnodes: int
    node_rank: int
    devices: list[str]

    @property
    def per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def ranks(self) -> range:
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)


def layout(settings) -> Layout:
    """The group's shape from the settings, checked (ValueError naming the flag)."""
    world, nnodes, node_rank = settings.world_size, settings.nnodes, settings.node_rank
    if not 1 <= world <= 1024:
        raise ValueError(f"--world-size (OPENRL_WORLD_SIZE) must be between 1 and 1024; got {world}")
    if not 1 <= nnodes <= world or world % nnodes:
        raise ValueError(
            f"--nnodes (OPENRL_NNODES) must divide --world-size {world} (one rank per device, the same "
            f"number on every node); got {nnodes}"
        )
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank (OPENRL_NODE_RANK) must be in [0, {nnodes - 1}]; got {node_rank}")
    if nnodes > 1 and (not settings.master_addr or not settings.master_port):
        raise ValueError(
            "--master-addr and --master-port (OPENRL_MASTER_ADDR/PORT) are needed with --nnodes > 1: "
            "node 0's address and the port it binds for the group's rendezvous"
        )
    if not 5 <= settings.group_timeout_s <= 86400:
        raise ValueError(
            f"OPENRL_GROUP_TIMEOUT_S must be between 5 and 86400; got {settings.group_timeout_s:g}"
        )
    if not 0 <= settings.group_max_restarts <= 1000:
        raise ValueError(
            f"OPENRL_GROUP_MAX_RESTARTS must be between 0 and 1000; got {settings.group_max_restarts}"
        )
    per_node = world // nnodes
    devices = list(settings.devices)
    if not devices:
        devices = _visible_gpus(settings.device) or ["cpu"] * per_node
    if len(devices) != per_node:
        raise ValueError(
            f"--devices (OPENRL_DEVICES) names {len(devices)} devices; this node runs {per_node} ranks "
            f"(--world-size {world} / --nnodes {nnodes}), one per device"
        )
    for d in devices:
        if d != "cpu" and not d.startswith("cuda"):
            raise ValueError(f"--devices: {d!r} is not cpu or cuda:N")
    return Layout(world, nnodes, node_rank, devices)


def _visible_gpus(device: str | None) -> list[str]:
    if device == "cpu":
        return []
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return []
    return [f"cuda:{i}" for i in range(n)]


class Supervisor:
    def __init__(self, settings, shape: Layout, argv: list[str], *, listen_fd: int | None, url: str | None):
        self.settings = settings
        self.shape = shape
        self.argv = argv
        self.listen_fd = listen_fd
        self.url = url
        self.stopping = False
        self.children: dict[int, subprocess.Popen] = {}
        self.store = None  # across nodes: the TCPStore holding the generation
        self.address = ""

    def _connect_store(self):
        """Across nodes: node 0 binds the TCPStore on --master-port, the others connect. On one node
        there is no network rendezvous at all: each generation meets in a file of the data dir."""
        import torch.distributed as dist

        s = self.settings
        if self.shape.nnodes == 1:
            self.folder = Path(s.data_dir) / "group"
            shutil.rmtree(self.folder, ignore_errors=True)  # a killed predecessor's files
            self.folder.mkdir(mode=0o700, parents=True)
            self._generation = 0
            return
        timeout = datetime.timedelta(seconds=s.group_timeout_s)
        if self.shape.node_rank == 0:
            store = dist.TCPStore(
                s.master_addr, s.master_port, is_master=True, wait_for_workers=False, timeout=timeout
            )
            store.set("generation", "0")
        else:
            deadline = time.monotonic() + s.group_timeout_s
            while True:
                try:
                    store = dist.TCPStore(s.master_addr, s.master_port, is_master=False, timeout=timeout)
                    break
                except Exception:  # noqa: BLE001  (node 0 not up yet)
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
        self.address = f"{s.master_addr}:{s.master_port}"
        self.store = store

    def generation(self) -> int:
        if self.store is None:
            return self._generation
        return int(self.store.get("generation"))

    def _next_generation(self, generation: int) -> None:
        if self.store is None:
            self._generation = generation + 1
            return
        with contextlib.suppress(Exception):
            self.store.compare_set("generation", str(generation), str(generation + 1))

    def _rendezvous(self, generation: int) -> str:
        if self.store is not None:
            return self.address
        return f"file:{self.folder / f'store-{generation}'}"

    def _start(self, generation: int) -> None:
        threads = max(1, (os.cpu_count() or 1) // self.shape.per_node)
        for local, rank in enumerate(self.shape.ranks):
            env = {
                **os.environ,
                "OPENRL_RANK": str(rank),
                "OPENRL_LOCAL_RANK": str(local),
                "OPENRL_WORLD_SIZE": str(self.shape.world_size),
                "OPENRL_GROUP_STORE": self._rendezvous(generation),
                "OPENRL_GROUP_GENERATION": str(generation),
                "OPENRL_GROUP_DEVICE": self.shape.devices[local],
                "OPENRL_TORCH_THREADS": os.environ.get("OPENRL_TORCH_THREADS") or str(threads),
            }
            if self.shape.nnodes == 1:  # one node: the ranks talk over loopback only
                for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                    env.setdefault(var, "lo")
            pass_fds: tuple[int, ...] = ()
            if rank == 0 and self.listen_fd is not None:
                env["OPENRL_GROUP_LISTEN_FD"] = str(self.listen_fd)
                env["OPENRL_GROUP_URL"] = self.url or ""
                pass_fds = (self.listen_fd,)
            self.children[rank] = subprocess.Popen(
                self.argv, env=env, pass_fds=pass_fds, preexec_fn=die_with_parent
            )

    def _kill_all(self) -> None:
        for proc in self.children.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for proc in self.children.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=30)
        self.children = {}

    def on_sigterm(self, signum, frame) -> None:
        self.stopping = True
        rank0 = self.children.get(0)
        if rank0 is not None and rank0.poll() is None:
            rank0.send_signal(signal.SIGTERM)  # rank 0 drains and stops the others

    def run(self) -> int:
        self._connect_store()
        signal.signal(signal.SIGTERM, self.on_sigterm)
        signal.signal(signal.SIGINT, self.on_sigterm)
        quick_failures = 0
        while True:
            generation = self.generation()
            started = time.monotonic()
            print(
                f"openrl-service: starting ranks {self.shape.ranks.start}-{self.shape.ranks.stop - 1} of "
                f"{self.shape.world_size} (generation {generation}, rendezvous {self._rendezvous(generation)})",
                flush=True,
            )
            self._start(generation)
            code = self._watch(generation)
            if code is not None:
                return code
            quick_failures = quick_failures + 1 if time.monotonic() - started < QUICK_FAILURE_S else 1
            if quick_failures > self.settings.group_max_restarts:
                print(
                    f"openrl-service: the group failed {quick_failures} times in a row, each within "
                    f"{QUICK_FAILURE_S:g} s of its start (OPENRL_GROUP_MAX_RESTARTS="
                    f"{self.settings.group_max_restarts}); giving up",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            time.sleep(min(5.0, 0.5 * quick_failures))

    def _watch(self, generation: int) -> int | None:
        """Until the ranks stop (rank 0's exit code) or the group must restart (None). A rank exits 0
        only once rank 0 has told it to stop (and rank 0 only after its drain): that is a shutdown,
        any other exit a failure."""
        last_check = 0.0
        clean_since: float | None = None
        while True:
            time.sleep(0.2)
            exited = {r: p.returncode for r, p in self.children.items() if p.poll() is not None}
            if len(exited) == len(self.children):
                return exited.get(0, 0) if self.shape.node_rank == 0 else 0
            failed = {r: c for r, c in exited.items() if c != 0}
            if failed and not self.stopping:
                why = ", ".join(f"rank {r} exited with {_describe(c)}" for r, c in sorted(failed.items()))
                print(f"openrl-service: {why}: restarting the group", file=sys.stderr, flush=True)
                self._next_generation(generation)
                self._kill_all()
                return None
            if exited or failed:  # a shutdown under way: the others follow within a minute
                clean_since = clean_since or time.monotonic()
                if time.monotonic() - clean_since > 60:
                    self._kill_all()
                    return exited.get(0, 1) if self.shape.node_rank == 0 else 0
            if self.store is not None and not exited and time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                if not self._store_alive():  # node 0 is gone: stopped or dead
                    self._kill_all()
                    return 0 if self.stopping else 1
                if self.generation() != generation:
                    print("openrl-service: another node restarted the group", file=sys.stderr, flush=True)
                    self._kill_all()
                    return None

    def _store_alive(self) -> bool:
        try:
            self.generation()
            return True
        except Exception:  # noqa: BLE001
            return False


def _describe(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"code {code}"


def supervise(settings, argv: list[str], *, sock: socket.socket | None, url: str | None) -> int:
    shape = layout(settings)
    fd = None
    if sock is not None:
        fd = sock.fileno()
        os.set_inheritable(fd, True)
    return Supervisor(settings, shape, argv, listen_fd=fd, url=url).run()


def add_arguments(parser) -> None:
    """`serve`'s flags for several devices (and vLLM's parallelism), OPENRL_WORLD_SIZE and the rest."""
    g = parser.add_argument_group(
        "Several devices per model (OPENRL_WORLD_SIZE, …; see docs/architecture.md)"
    )
    g.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks of the torch.distributed group serving each model, one process per device, across "
        "every node (default 1; OPENRL_WORLD_SIZE)",
    )
    g.add_argument(
        "--devices",
        default=None,
        help="this node's devices, one per rank: cuda:0,cuda:1,… (default: every visible GPU, else CPU "
        "ranks on gloo; OPENRL_DEVICES)",
    )
    g.add_argument(
        "--nnodes", type=int, default=None, help="nodes the group spans (default 1; OPENRL_NNODES)"
    )
    g.add_argument(
        "--node-rank", type=int, default=None, help="this node's place, 0 serves HTTP (OPENRL_NODE_RANK)"
    )
    g.add_argument(
        "--master-addr",
        default=None,
        help="with several nodes: node 0's address, where the group meets (OPENRL_MASTER_ADDR)",
    )
    g.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="with several nodes: the port node 0 binds for the group's rendezvous (OPENRL_MASTER_PORT)",
    )
    g.add_argument(
        "--vllm-tp", type=int, default=None, help="vLLM's tensor_parallel_size (default 1; OPENRL_VLLM_TP)"
    )
    g.add_argument(
        "--sampler-devices",
        default=None,
        help="GPUs for vLLM apart from the training group's: cuda:2,cuda:3 (default: colocated; "
        "OPENRL_SAMPLER_DEVICES)",
    )
