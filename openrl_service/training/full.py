"""Full fine-tuning: a run (``rank=0``) that trains its own copy of the model's weights.

A full run's :class:`FullWeights` hold one tensor per trained parameter, under the parameter's Hugging
Face name. The shared base model still does the computing: while a forward pass uses a full run
(``router.use(weights)``), the router puts the run's tensors in the modules' parameter slots (a tied
embedding's two slots get the one tensor) and puts the base's back afterwards, so every kernel, the
KV cache and the samplers work as for the base model, and the base's own weights are never written.
What a full run trains: every parameter, less the attention, MLP or embedding (input and output)
weights when ``train_attn`` / ``train_mlp`` / ``train_unembed`` is off; the parameters it does not
train stay shared with the base (no copy). Weights are kept in float32 (master weights); on a
bfloat16 model they are cast on the way in, differentiably.

Memory. A full run needs its weights, their gradients and the optimizer's state on the device while
it is served: :func:`footprint` (AdamW: 4 bytes × 4 per parameter, Dimuon 4 × 3). The device's share
for full runs (OPENRL_FULL_RUN_BUDGET_BYTES) is the :class:`Residency`'s budget: a run that alone
needs more is refused when it is created, with the numbers; any other is admitted, and runs take
turns. Before a run is served its tensors are brought to the device, and the least recently served
runs are moved out until it fits: to the host share (OPENRL_FULL_HOST_BUDGET_BYTES; off when the device
is the CPU), whose own least recently served runs go on to a file on disk (``<data>/spill``) to make
room, or straight to disk when the host share cannot hold it. So the longer a run has waited, the
further away it is. Moving out and back is exact (the same bits), so a run that took turns computes
exactly what it would have alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from openrl_service import crashpoints, memory, progress
from openrl_service.errors import UserError
from openrl_service.storage.tensorfile import link_or_copy, read_tensors, write_tensors
from openrl_service.training.lora import Adapter, adapter_from_peft
from openrl_service.training.weights import RunWeights, place_tensors, run_tensors

log = logging.getLogger("openrl.full")

FULL_FILES = ("model.safetensors", "config.json")  # a full checkpoint: what AutoModelForCausalLM loads


class FullWeights(RunWeights):
    """A full fine-tune's own tensors: {Hugging Face parameter name: tensor}. One of the two kinds of
    run weights (training/weights.py); the LoRA ``Adapter`` (training/lora.py) is the other."""

    full = True
    shares_batch = False  # its tensors replace the model's own for a pass: one run per pass
    vllm_serves = False  # vLLM holds one set of base weights: loading these would replace them
    scale = 1.0
    CHECKPOINT_FILE = "model.safetensors"

    def __init__(self, spec, weights: dict[str, torch.Tensor]):
        self.spec = spec
        self.weights = weights
        self.writes = 0
        self.home: Residency | None = None  # a training run's live weights: who moves them
        self.train_state = None  # ...and the TrainState whose gradients and optimizer move with them
        self._cast: tuple[int, torch.dtype, dict[str, torch.Tensor]] | None = None
        self.embeddings: list[str] = []  # the vocabulary-sized ones (set by the Trainer)

    @staticmethod
    def check_file(base, spec, shapes: dict[str, list[int]], *, field: str, model: str) -> None:
        check_full_tensors(base, spec, shapes, field=field, model=model)

    @classmethod
    def placeholders(cls, spec, names: list[str], *, dtype: torch.dtype, trainable: bool) -> FullWeights:
        """Empty tensors under ``names``: a run waiting on disk (its tensors come from a file)."""
        return cls(spec, {n: torch.empty(0, dtype=dtype).requires_grad_(trainable) for n in names})

    def cast(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in the model's dtype for a pass without gradients (sampling), cast once per
        version of the weights rather than at every decoded token."""
        version = self.version
        if self._cast is None or self._cast[0] != version or self._cast[1] != dtype:
            self._cast = None  # the old copy goes before the new one is made
            with torch.no_grad():
                self._cast = (version, dtype, {n: t.detach().to(dtype) for n, t in self.weights.items()})
        return self._cast[2][name]

    def ensure_resident(self) -> None:
        if self.home is not None:
            self.home.ensure(self)

    def prepare(self, base) -> None:
        groups = base.router.param_groups  # which tensors are embeddings (Dimuon treats them apart)
        self.embeddings = [n for n in self.weights if groups.get(n) == "unembed"]

    def adopt(self, trainer, state, waiting_in=None) -> None:
        need = trainer.footprint(self.spec) if state is not None else trainer.snapshot_need(self.spec)
        if waiting_in is None:
            trainer.residency.add(self, state, need)
        else:
            trainer.residency.add_on_disk(self, state, need, waiting_in)

    def back_on_device(self) -> bool:
        if self.home is None:
            return False
        self.home.ensure(self)
        return True

    def leave(self) -> None:
        if self.home is not None:
            self.home.drop(self)
        super().leave()

    @contextlib.contextmanager
    def applied(self, router) -> Iterator[None]:
        with router.routing(None), router._swapped(self):
            yield

    def dimuon_args(self) -> tuple[int | None, list[torch.Tensor]]:
        return None, [self.weights[n] for n in self.embeddings]

    def checkpoint_payload(self, base, base_model: str) -> tuple[dict[str, torch.Tensor], dict]:
        return full_checkpoint(base, self), full_config(base)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.weights.values())

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()

    def snapshot(self) -> FullWeights:
        """An immutable copy (a sampler's snapshot): a whole copy of the trained weights, which takes
        turns on the device like the run (held by the sampler: it leaves when the sampler does)."""
        self.ensure_resident()
        home = self.home
        if home is not None:
            home._make_room(self.nbytes(), keep=id(self))  # before the copy is made
        with torch.no_grad():
            copy = FullWeights(self.spec, {n: t.detach().clone() for n, t in self.weights.items()})
        if home is not None:
            home.add(copy, None, copy.nbytes())
        return copy

    def detached(self) -> FullWeights:
        return FullWeights(self.spec, {n: t.detach() for n, t in self.weights.items()})

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained tensors on the CPU, float32."""
        self.ensure_resident()
        return {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in self.weights.items()}


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def base_tensors(base) -> dict[str, torch.Tensor]:
    """The served model's own parameters by Hugging Face name (no copies): from the router's record
    of them, never from the modules' slots, which hold a full run's tensors during its ops."""
    own = base.router.base_weights
    return {n: own[n] for n in base.router.slots}


def new_full_weights(base, spec, *, trainable: bool = True) -> FullWeights:
    """A full run's starting point: a copy of the base model's weights that ``spec`` trains."""
    own = base_tensors(base)
    with torch.no_grad():
        weights = {
            n: own[n].detach().to(dtype=master_dtype(own[n].dtype), copy=True).requires_grad_(trainable)
            for n in base.router.full_names(spec)
        }
    return FullWeights(spec, weights)


def full_checkpoint(base, weights: FullWeights) -> dict[str, torch.Tensor]:
    """Every parameter of the model, the run's where it trains them, the base's elsewhere: the
    ``model.safetensors`` of a full checkpoint (a tied embedding saved once, as Hugging Face does)."""
    out = {n: t.detach().to("cpu").contiguous() for n, t in base_tensors(base).items()}
    out.update(weights.state_dict())  # float32 master weights: a resume continues bit for bit
    return out


def full_config(base) -> dict:
    """config.json of a full checkpoint: the served model's own configuration."""
    cfg = base.model.config.to_dict()
    cfg["torch_dtype"] = str(master_dtype(base.dtype)).removeprefix("torch.")
    cfg.pop("quantization_config", None)  # a GGUF base is served dequantised: so are its full runs
    return cfg


def check_full_tensors(base, spec, shapes: dict[str, list[int]], *, field: str, model: str) -> None:
    """Refuse (naming the tensor) a full checkpoint whose tensors are not this model's."""
    own = base_tensors(base)
    for name, shape in shapes.items():
        if name not in own:
            raise UserError(f"{field}: tensor {name} is not a parameter of {model}", field=field)
        if list(shape) != list(own[name].shape):
            raise UserError(
                f"{field}: tensor {name} has shape {list(shape)}; {model} has {list(own[name].shape)}",
                field=field,
            )
    missing = [n for n in base.router.full_names(spec) if n not in shapes]
    if missing:
        raise UserError(
            f"{field}: tensor {missing[0]} of {model} is missing from the checkpoint", field=field
        )


def full_from_tensors(
    base, spec, tensors: dict[str, torch.Tensor], *, trainable: bool, consume: bool = False
) -> FullWeights:
    """The run weights in ``tensors`` (copied; with ``consume``, the caller's dict is emptied as the
    weights are made and a tensor already of the right device and dtype is taken, not copied: one
    copy of the model at a time)."""
    own = base_tensors(base)
    names = base.router.full_names(spec)
    weights = {}
    with torch.no_grad():
        for n in names:
            t = tensors.pop(n) if consume else tensors[n]
            w = t.to(base.device, master_dtype(own[n].dtype))
            weights[n] = (w if consume and w is t else w.clone()).requires_grad_(trainable)
            del t, w
    return FullWeights(spec, weights)


def weights_from_checkpoint(
    base, spec, tensors: dict[str, torch.Tensor], *, trainable: bool, consume: bool = False
):
    """A checkpoint's tensors as run weights: a full fine-tune's or a LoRA adapter."""
    if spec.full:
        return full_from_tensors(base, spec, tensors, trainable=trainable, consume=consume)
    return adapter_from_peft(spec, tensors, device=base.device, trainable=trainable)


def parameter_count(base, spec) -> int:
    own = base_tensors(base)
    return sum(own[n].numel() for n in base.router.full_names(spec))


def footprint(base, spec, optimizer_slots: int = 2) -> int:
    """Bytes a full run holds on the device while served: float32 weights, gradients, the gradient
    set aside while a new one is computed (trainer.accumulating_grads), the optimizer's per-parameter
    state (AdamW 2 slots, Dimuon 1) and, on a model narrower than float32, the casts of the weights
    to its dtype (one for a pass with gradients, one kept for sampling)."""
    per = 4 * (3 + optimizer_slots)
    item = torch.empty((), dtype=base.dtype).element_size()
    if item < 4:
        per += 2 * item
    return parameter_count(base, spec) * per


class Residency:
    """Which full runs' tensors are on the device; the least recently served wait elsewhere.

    Entries are training runs (weights, gradients and optimizer state) and sampler snapshots of full
    runs (weights only). Only the engine's worker moves tensors (every caller of ``ensure`` /
    ``make_room`` / ``add`` is an op); a finished session drops its run from a request thread. The
    lock guards the bookkeeping only and is never held while tensors are copied or written: a spill
    of gigabytes does not stall ``/metrics`` or a session's end, and ``status()`` answers from a copy.

    Moves are written and read one tensor at a time (storage/tensorfile.py): the memory a move
    needs beyond the run itself is one tensor. The resident run whose lane has work queued is moved
    out last (``busy``), so runs take fewer turns."""

    def __init__(
        self,
        device: torch.device,
        *,
        budget_bytes: int | None,
        host_bytes: int,
        spill_dir: Path | None,
        host_tier_on_cpu: bool = False,
    ):
        self.device = torch.device(device)
        self.budget = budget_bytes  # None: no limit (every run stays on the device)
        # on a CPU device host memory is the device's: runs go straight to disk (``host_tier_on_cpu``
        # keeps the host tier, so its order of moves can be tested without a GPU)
        self.host_budget = host_bytes if (self.device.type != "cpu" or host_tier_on_cpu) else 0
        self.spill_dir = spill_dir
        self.runs: OrderedDict[int, FullWeights] = OrderedDict()  # least recently served first
        self.where: dict[int, str] = {}  # "device" | "host" | "disk"
        self.need: dict[int, int] = {}
        self.busy: Callable[[FullWeights], bool] = lambda _w: False  # its next op is queued
        self._lock = threading.Lock()  # bookkeeping only: never held across a copy or a write
        self._moving: int | None = None  # the run whose tensors the worker is moving now
        # Sampler snapshots are held weakly: when the sampler lets go of its weights, they leave
        # (collected, their keys queued here by a finalizer, and forgotten at the next call).
        self._gone: deque[int] = deque()
        self.moves = {"out_host": 0, "out_disk": 0, "in": 0}
        self.seconds = {"out_host": 0.0, "out_disk": 0.0, "in": 0.0}
        self.moved_bytes = {"out_host": 0, "out_disk": 0, "in": 0}
        self._status: dict = {}
        self._publish()

    # -- accounting ------------------------------------------------------------------------------
    def _on(self, tier: str) -> int:
        return sum(self.need[k] for k, t in self.where.items() if t == tier)

    def _get(self, key: int) -> FullWeights | None:
        w = self.runs.get(key)
        return w() if isinstance(w, weakref.ref) else w

    def _collect(self) -> list[Path]:
        """Forget collected snapshots (lock held); returns their spill files to remove."""
        files = []
        while self._gone:
            key = self._gone.popleft()
            w = self.runs.get(key)
            if not isinstance(w, weakref.ref) or w() is not None:
                continue  # not a snapshot, or its id was taken by a new one that is alive
            self.runs.pop(key)
            self.need.pop(key, None)
            if self.where.pop(key, None) == "disk" and self.spill_dir is not None:
                files.append(self._spill_path(key))
        if files:
            self._publish()
        return files

    def _collected(self, key: int) -> None:
        """A sampler snapshot was collected (any thread, no lock: a finalizer): its spill file goes
        now, its bookkeeping at the next call."""
        if self.where.get(key) == "disk" and self.spill_dir is not None and self._moving != key:
            with contextlib.suppress(OSError):
                self._spill_path(key).unlink()
        self._gone.append(key)

    def _sweep(self) -> None:
        with self._lock:
            files = self._collect()
        for f in files:
            with contextlib.suppress(OSError):
                f.unlink()

    def resident_bytes(self) -> int:
        with self._lock:
            return self._on("device")

    def admit(self, need: int, what: str) -> None:
        """Refuse (UserError, with the numbers) a run that alone does not fit the device's share."""
        if self.budget is not None and need > self.budget:
            raise UserError(
                f"{what} needs {_gib(need)} on {self.device} (float32 weights, gradients, a set-aside "
                f"gradient and optimizer state), more than the {_gib(self.budget)} full runs may use "
                "there (OPENRL_FULL_RUN_BUDGET_BYTES, or what the memory accountant leaves for full "
                "runs: GET /metrics, openrl_memory_bytes); train a LoRA (rank >= 1), freeze the "
                "embeddings (train_unembed=false), or give the service more memory",
                field="lora_config.rank",
            )

    def add(self, weights: FullWeights, state, need: int) -> None:
        """Take charge of a run's live weights (state: its TrainState), or of a sampler snapshot of a
        full run (state None: held weakly), on the device now: make room first."""
        self._make_room(need, keep=id(weights))
        with self._lock:
            self._add(weights, state, need, "device")

    def add_on_disk(self, weights: FullWeights, state, need: int, source: Path) -> None:
        """Take charge of a run whose tensors are in ``source`` (a journal snapshot's run file, at a
        recovery): it waits on disk, linked as its spill file, until its first op brings it in."""
        key = id(weights)
        self.spill_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        link_or_copy(source, self._spill_path(key))
        with self._lock:
            self._add(weights, state, need, "disk")

    def make_room(self, need: int) -> None:
        """Move least recently served runs out until ``need`` more bytes fit (before a new run's copy
        is made)."""
        self._make_room(need, keep=-1)

    def _add(self, weights: FullWeights, state, need: int, where: str) -> None:
        self._collect()  # before an id a collected snapshot had is taken again
        key = id(weights)
        weights.home, weights.train_state = self, state
        if state is None:
            self.runs[key] = weakref.ref(weights)
            weakref.finalize(weights, self._collected, key)
        else:
            self.runs[key] = weights
        self.where[key] = where
        self.need[key] = need
        self._publish()

    def drop(self, weights: FullWeights) -> None:
        key = id(weights)
        with self._lock:
            if self.runs.pop(key, None) is None:
                return
            where = self.where.pop(key, None)
            self.need.pop(key, None)
            weights.home = None
            self._publish()
            moving = self._moving == key  # the mover removes its file when it is done
        if where == "disk" and self.spill_dir is not None and not moving:
            with contextlib.suppress(OSError):
                self._spill_path(key).unlink()

    def spill_file(self, weights: FullWeights) -> Path | None:
        """The file holding the run's tensors while it waits on disk (else None)."""
        key = id(weights)
        with self._lock:
            return self._spill_path(key) if self.where.get(key) == "disk" else None

    def _publish(self) -> None:
        """The status copy readers get (lock held, or in __init__)."""
        self._status = {
            "budget_bytes": self.budget,
            "host_budget_bytes": self.host_budget,
            "resident_bytes": sum(self.need[k] for k, t in self.where.items() if t == "device"),
            "runs": {t: sum(1 for w in self.where.values() if w == t) for t in ("device", "host", "disk")},
            "moves": dict(self.moves),
            "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
            "bytes": dict(self.moved_bytes),
        }

    def status(self) -> dict:
        return self._status  # replaced whole on each change: never read half-updated

    # -- turns -----------------------------------------------------------------------------------
    def ensure(self, weights: FullWeights) -> None:
        """Bring ``weights`` (and its gradients and optimizer state) to the device, moving the least
        recently served runs out until it fits; it becomes the most recently served."""
        self._sweep()
        key = id(weights)
        with self._lock:
            if key not in self.runs:
                return
            self.runs.move_to_end(key)
            if self.where[key] == "device":
                return
            need, source = self.need[key], self.where[key]
        self._make_room(need, keep=key)
        t0 = time.perf_counter()
        self._move(weights, key, source, self.device)
        with self._lock:
            if key in self.runs:
                self.where[key] = "device"
            self._count("in", t0, need)

    def _count(self, move: str, t0: float, nbytes: int) -> None:
        self.moves[move] += 1
        self.seconds[move] += time.perf_counter() - t0
        self.moved_bytes[move] += nbytes
        self._publish()

    def _victim(self, keep: int) -> int | None:
        """The run to move off the device next (lock held): the least recently served one whose
        next op is not already queued, else the least recently served one."""
        resident = [
            k for k in self.runs if k != keep and self.where.get(k) == "device" and self._get(k) is not None
        ]
        idle = [k for k in resident if not self.busy(self._get(k))]
        return (idle or resident or [None])[0]

    def _make_room(self, need: int, keep: int) -> None:
        if self.budget is None:
            return
        self._sweep()
        while True:
            with self._lock:
                if self._on("device") + need <= self.budget:
                    return
                key = self._victim(keep)
                if key is None:
                    return
            self._evict(key)

    def _evict(self, key: int) -> None:
        """Move a run off the device: to the host share when it fits there at all (the least recently
        served runs already on the host go on to disk to make room), else to disk."""
        with self._lock:
            weights, need = self._get(key), self.need[key]
            if weights is None:
                return
            to_host = bool(self.host_budget) and need <= self.host_budget
        if to_host:
            while True:
                with self._lock:
                    if self._on("host") + need <= self.host_budget:
                        break
                    others = [
                        k
                        for k in self.runs
                        if k != key and self.where[k] == "host" and self._get(k) is not None
                    ]
                    if not others:
                        break
                    other = others[0]
                    w, n = self._get(other), self.need[other]
                t1 = time.perf_counter()
                self._spill(w, other)
                with self._lock:
                    self.where[other] = "disk" if other in self.runs else self.where.get(other)
                    self._count("out_disk", t1, n)
            t0 = time.perf_counter()
            self._move(weights, key, "device", torch.device("cpu"))
            with self._lock:
                if key in self.runs:
                    self.where[key] = "host"
                self._count("out_host", t0, need)
        else:
            t0 = time.perf_counter()
            self._spill(weights, key)
            with self._lock:
                if key in self.runs:
                    self.where[key] = "disk"
                self._count("out_disk", t0, need)
        log.info("full run weights %x moved off %s", key, self.device)

    # -- moving tensors --------------------------------------------------------------------------
    def _move(self, weights: FullWeights, key: int, source: str, device: torch.device) -> None:
        self._moving = key
        try:
            self._move_now(weights, key, source, device)
        finally:
            self._moving = None

    def _move_now(self, weights: FullWeights, key: int, source: str, device: torch.device) -> None:
        if source == "disk":
            path = self._spill_path(key)
            with read_tensors(path) as f:
                place_tensors(weights, weights.train_state, f, device)
            with contextlib.suppress(OSError):
                path.unlink()
            return
        place_tensors(weights, weights.train_state, run_tensors(weights, weights.train_state), device)

    def _spill_path(self, key: int) -> Path:
        if self.spill_dir is None:
            raise RuntimeError("full runs need a spill folder to move to disk")
        return self.spill_dir / f"{os.getpid()}-{key:x}.safetensors"

    def _spill(self, weights: FullWeights, key: int) -> None:
        """Write the run's tensors to its spill file, one at a time, and free them (placeholders keep
        identities). A full disk leaves the run where it was and no partial file."""
        self.spill_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tensors = run_tensors(weights, weights.train_state)
        half = len(tensors) // 2

        def step(i: int) -> None:
            progress.tick()
            if i == half:
                crashpoints.hit("spill_write")

        self._moving = key
        try:
            write_tensors(self._spill_path(key), tensors, progress=step)
        finally:
            self._moving = None
        del tensors
        self._release(weights)
        memory.give_back()
        with self._lock:
            dropped = key not in self.runs
        if dropped:  # its session finished while it was written: nobody will read it
            with contextlib.suppress(OSError):
                self._spill_path(key).unlink()

    @staticmethod
    def _release(weights: FullWeights) -> None:
        """Free the run's tensors (empty placeholders keep every identity the optimizer keys on)."""
        weights._cast = None
        state = weights.train_state
        opt = state.optimizer.state if state is not None else {}
        for p in weights.weights.values():
            p.data = torch.empty(0, dtype=p.dtype)
            p.grad = None
            st = opt.get(p)
            if st:
                for k, v in list(st.items()):
                    if isinstance(v, torch.Tensor) and not (k == "step" and v.dim() == 0):
                        st[k] = torch.empty(0, dtype=v.dtype)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def weights_class(spec) -> type[RunWeights]:
    """The class of the weights a run with ``spec`` trains: FullWeights for rank 0, else Adapter."""
    return FullWeights if spec.full else Adapter
