"""Checks for every public method of the Tinker SDK's four clients (used by test_tinker_surface.py).

Each check drives one method of the unmodified ``tinker`` SDK against a live service and asserts on
the values it gets back (not only that the call returned). ``CHECKS`` maps ``(client, method)`` to
a one-line description of what is checked (that line goes into docs/tinker-compatibility.md) and
the function that checks it. ``run_all`` runs them in registration order and records each outcome.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import cached_property
from pathlib import Path

import httpx
import numpy as np
import tinker
from tinker import types

CLIENTS = {
    "ServiceClient": tinker.ServiceClient,
    "TrainingClient": tinker.TrainingClient,
    "SamplingClient": tinker.SamplingClient,
    "RestClient": tinker.RestClient,
}
TINY = "openrl/tiny"
TIMEOUT = 60.0  # seconds any one SDK call may take before its check fails
CHILD = Path(__file__).with_name("tinker_surface_child.py")


def sdk_methods() -> dict[str, list[str]]:
    """Every public attribute of each client class, as the SDK defines it today."""
    return {name: sorted(n for n in dir(cls) if not n.startswith("_")) for name, cls in CLIENTS.items()}


# -- registry ----------------------------------------------------------------------------------
@dataclass
class Check:
    client: str
    method: str
    checked: str
    fn: Callable[[Ctx], None]


CHECKS: dict[tuple[str, str], Check] = {}


def check(client: str, method: str, checked: str):
    def deco(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        key = (client, method)
        assert key not in CHECKS, f"two checks for {key}"
        CHECKS[key] = Check(client, method, " ".join(checked.split()), fn)
        return fn

    return deco


@dataclass
class Outcome:
    status: str  # "pass" | "fail" | "unsupported"
    error: str = ""  # the traceback of a failed check
    seconds: float = 0.0
    error_type: str = ""  # the exception's class name


# -- data and small helpers --------------------------------------------------------------------
def datum(prompt: list[int], completion: list[int]) -> types.Datum:
    seq = prompt + completion
    w = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": w},
    )


DATA = [datum(list(b"ab"), list(b"cdef")), datum(list(b"xyz"), list(b"zy"))]
FP_SEQ = list(b"The quick brown fox")  # the weights' fingerprint: logprobs of this sequence
FP_DATUM = types.Datum(
    model_input=types.ModelInput.from_ints(FP_SEQ[:-1]),
    loss_fn_inputs={"target_tokens": FP_SEQ[1:], "weights": [1.0] * (len(FP_SEQ) - 1)},
)
PROMPT = types.ModelInput.from_ints(list(b"Hel"))
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0)
LR = 5e-2
TOL = 1e-4


def res(fut, timeout: float = TIMEOUT):
    return fut.result(timeout=timeout)


def fp(tc: tinker.TrainingClient) -> np.ndarray:
    """Per-token logprobs of FP_SEQ under the run's current weights."""
    out = res(tc.forward([FP_DATUM], "cross_entropy"))
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)


def fp_sampler(sampler: tinker.SamplingClient) -> np.ndarray:
    lps = res(sampler.compute_logprobs(types.ModelInput.from_ints(FP_SEQ)))
    assert lps[0] is None, f"the first prompt position has no logprob; got {lps[0]!r}"
    return np.asarray(lps[1:], dtype=np.float64)


def same(a, b, tol: float = TOL, what: str = "logprobs") -> None:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    assert diff <= tol, f"{what} differ by {diff:.3g} (> {tol:g})"


def differ(a, b, tol: float = 1e-3, what: str = "logprobs") -> None:
    diff = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    assert diff > tol, f"{what} should differ but max |Δ| = {diff:.3g}"


def step(tc: tinker.TrainingClient, lr: float = LR) -> None:
    res(tc.forward_backward(DATA, "cross_entropy"))
    res(tc.optim_step(types.AdamParams(learning_rate=lr)))


def loss(tc: tinker.TrainingClient) -> float:
    return res(tc.forward(DATA, "cross_entropy")).metrics["loss:sum"]


def utc(t: datetime | None) -> datetime | None:
    if t is None:
        return None
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t


_STARTED: dict[str, datetime] = {}  # "suite" and "check": when run_all began, and the current check


def near_now(t: datetime | None, offset_s: float = 0.0, what: str = "time", *, since: str = "check") -> None:
    """``t`` (shifted back by ``offset_s``) lies between the start of this check (or of the suite) and
    now: bounds read from the clock around the call, so a slow machine cannot fail it. One second of
    slack covers timestamps the SDK rounds."""
    assert t is not None, f"{what} is missing"
    shift, slack = timedelta(seconds=offset_s), timedelta(seconds=1)
    lo = _STARTED.get(since, datetime.fromtimestamp(0, timezone.utc)) + shift - slack
    hi = datetime.now(timezone.utc) + shift + slack
    assert lo <= utc(t) <= hi, f"{what} {t} is not between {lo} and {hi}"


def raises(fn: Callable[[], object], *kinds: type[BaseException]) -> BaseException:
    try:
        fn()
    except kinds as e:
        return e
    except Exception as e:  # noqa: BLE001 - report what was raised instead
        raise AssertionError(f"expected {[k.__name__ for k in kinds]}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {[k.__name__ for k in kinds]}, but the call succeeded")


def not_found(fn: Callable[[], object]) -> None:
    raises(fn, tinker.NotFoundError)


def parse(path: str) -> types.ParsedCheckpointTinkerPath:
    return types.ParsedCheckpointTinkerPath.from_tinker_path(path)


def sampler_id(s: tinker.SamplingClient) -> str:
    return s._sampling_session_id


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @contextlib.contextmanager
    def on(self, name: str = "tinker") -> Iterator[LogCapture]:
        logger = logging.getLogger(name)
        old = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.DEBUG)
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.setLevel(old)


# -- the shared context ------------------------------------------------------------------------
@dataclass
class Ctx:
    url: str
    key: str
    other_key: str
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    _closers: list[Callable[[], object]] = field(default_factory=list)

    # clients
    @cached_property
    def display_name(self) -> str:
        return f"surface-{self.tag} main"

    @cached_property
    def sc(self) -> tinker.ServiceClient:
        sc = tinker.ServiceClient(
            user_metadata={"suite": "surface"},
            project_id="proj-surface",
            display_name=self.display_name,
            base_url=self.url,
            api_key=self.key,
        )
        self._closers.append(lambda: sc.close("success").result(timeout=30))
        return sc

    @cached_property
    def rest(self) -> tinker.RestClient:
        return tinker.RestClient(base_url=self.url, api_key=self.key)

    @cached_property
    def rest_other(self) -> tinker.RestClient:
        """Another tenant's client: everything of ours must be a 404 to it."""
        return tinker.RestClient(base_url=self.url, api_key=self.other_key)

    @cached_property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        self._closers.append(loop.close)
        return loop

    def aw(self, coro, timeout: float = TIMEOUT):
        """Run an ``*_async`` method in an event loop; await a returned future too."""

        async def go():
            r = await coro
            while isinstance(r, tinker.APIFuture):
                r = await r
            return r

        return self.loop.run_until_complete(asyncio.wait_for(go(), timeout))

    def new_service_client(self, **kw) -> tinker.ServiceClient:
        sc = tinker.ServiceClient(base_url=self.url, api_key=self.key, **kw)
        self._closers.append(lambda: sc.close("success").result(timeout=30))
        return sc

    def fresh(self, rank: int = 8, **kw) -> tinker.TrainingClient:
        """A new run on the main session, identical at birth to every other seed-0 rank-8 run."""
        return res(self.sc.create_lora_training_client(TINY, rank=rank, seed=0, **kw))

    def close(self) -> None:
        for c in reversed(self._closers):
            with contextlib.suppress(Exception):
                c()

    # the main run: two steps, then a training checkpoint and a sampler checkpoint
    @cached_property
    def tc(self) -> tinker.TrainingClient:
        tc = self.fresh(user_metadata={"role": "main"})
        self.__dict__["base_fp"] = fp(tc)
        step(tc)
        step(tc)
        fp_now = fp(tc)
        differ(fp_now, self.base_fp, what="two training steps")
        self.__dict__["trained_fp"] = fp_now
        self.__dict__["state_path"] = res(tc.save_state("main-state", user_metadata={"note": "main"})).path
        self.__dict__["sampler_path"] = res(tc.save_weights_for_sampler("main-sampler")).path
        return tc

    @cached_property
    def base_fp(self) -> np.ndarray:
        _ = self.tc
        return self.__dict__["base_fp"]

    @cached_property
    def trained_fp(self) -> np.ndarray:
        _ = self.tc
        return self.__dict__["trained_fp"]

    @cached_property
    def state_path(self) -> str:
        _ = self.tc
        return self.__dict__["state_path"]

    @cached_property
    def sampler_path(self) -> str:
        _ = self.tc
        return self.__dict__["sampler_path"]

    @cached_property
    def sampler(self) -> tinker.SamplingClient:
        """A snapshot of the main run's trained weights."""
        _ = self.tc
        return res(self.tc.save_weights_and_get_sampling_client())

    @cached_property
    def session_id(self) -> str:
        return self.sc.holder.get_session_id()

    # a resumable run: saved after two steps; the reference continues one more step from there
    @cached_property
    def resume(self) -> dict:
        r = self.fresh()
        step(r)
        step(r)
        path = res(r.save_state("resume")).path
        saved = fp(r)
        step(r)
        return {"path": path, "saved": saved, "continued": fp(r)}

    # the child process: from_sampler_handle and both get_tokenizer, with HF_ENDPOINT at the service
    @cached_property
    def child(self) -> dict:
        import tempfile

        hf_home = tempfile.mkdtemp(prefix="surface-hf-")
        # tests/conftest.py sets HF_HUB_OFFLINE for the test process; a client reaches the mirror.
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))
        }
        env.update(
            HF_ENDPOINT=self.url,
            HF_TOKEN=self.key,
            HF_HOME=hf_home,
            TINKER_API_KEY=self.key,
            TINKER_TELEMETRY="0",
            TOKENIZERS_PARALLELISM="false",
        )
        arg = {
            "url": self.url,
            "model": TINY,
            "handle": self.sampler.get_sampler_handle(),
            "prompt": PROMPT.to_ints(),
            "fp_seq": FP_SEQ,
        }
        try:
            proc = subprocess.run(
                [sys.executable, str(CHILD), json.dumps(arg)],
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
        except subprocess.TimeoutExpired as e:
            return {"error": f"the child process timed out:\n{e.stdout}\n{e.stderr}"}
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:  # remembered, so the next check does not rerun it
            return {"error": f"the child process exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"}
        return json.loads(lines[-1])

    def child_result(self, name: str) -> dict:
        assert "error" not in self.child, self.child.get("error")
        r = self.child[name]
        assert r["ok"], f"in the child process: {r['error']}"
        return r["value"]

    # a checkpoint scratch run (kept apart from the main run so its listing stays exact)
    @cached_property
    def scratch(self) -> tinker.TrainingClient:
        tc = self.fresh()
        step(tc)
        return tc


# -- the run -----------------------------------------------------------------------------------
def run_all(ctx: Ctx, allowed_unsupported: dict[tuple[str, str], str]) -> dict[tuple[str, str], Outcome]:
    """Run every registered check (and probe every allowed-unsupported method) once, in order."""
    out: dict[tuple[str, str], Outcome] = {}
    _STARTED["suite"] = datetime.now(timezone.utc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the SDK's deprecation and experimental warnings
        for key, chk in CHECKS.items():
            t0 = time.monotonic()
            _STARTED["check"] = datetime.now(timezone.utc)
            try:
                chk.fn(ctx)
            except BaseException as e:  # noqa: BLE001 - record and go on to the next method
                if isinstance(e, KeyboardInterrupt):
                    raise
                status = "unsupported" if key in allowed_unsupported else "fail"
                out[key] = Outcome(
                    status, traceback.format_exc(limit=6), time.monotonic() - t0, type(e).__name__
                )
            else:
                out[key] = Outcome("pass", "", time.monotonic() - t0)
    return out


def render_doc(
    methods: dict[str, list[str]],
    outcomes: dict[tuple[str, str], Outcome],
    allowed_unsupported: dict[tuple[str, str], str],
) -> str:
    total = sum(len(v) for v in methods.values())
    supported = {
        c: sum(outcomes.get((c, m), Outcome("fail")).status == "pass" for m in ms)
        for c, ms in methods.items()
    }
    n = sum(supported.values())
    per = ", ".join(f"{c} {supported[c]}/{len(ms)}" for c, ms in methods.items())
    lines = [
        "# Tinker SDK compatibility",
        "",
        f"Every public method of the unmodified `tinker=={tinker.__version__}` SDK's four clients, driven",
        "against openrl-service by `tests/service/test_tinker_surface.py`, which checks the values each",
        "call returns. The test regenerates this table and fails when it differs from this file;",
        "`make compat-doc` rewrites it. A method is *supported* when its check passes.",
        "",
        f"**{n} of {total} methods supported** ({per}).",
        "",
        "| client | method | supported | what the test checked, or why it is unsupported |",
        "|---|---|---|---|",
    ]
    for client, ms in methods.items():
        for m in ms:
            key = (client, m)
            o = outcomes.get(key)
            chk = CHECKS.get(key)
            if o is not None and o.status == "pass":
                yes, text = "yes", chk.checked
            elif key in allowed_unsupported:
                yes, text = "no", allowed_unsupported[key]
            elif chk is None:
                yes, text = "no", "no check in the suite yet (a method new to the SDK?)"
            else:
                yes, text = "no", f"the check fails ({o.error_type if o else 'not run'})"
            cell = text.replace("|", "\\|")
            lines.append(f"| {client} | `{m}` | {yes} | {cell} |")
    lines += ["", *OPTIONS_DOC, "", *NEXT_SDK_DOC, ""]
    return "\n".join(lines)


# Tinker 0.39 (documented, not on PyPI here): served and tested over HTTP with the documented shapes.
NEXT_SDK_DOC = [
    "## Tinker 0.39: tested over HTTP only",
    "",
    "The 0.39 SDK is published in Tinker's docs but not installable here, so these are implemented from",
    "its API reference and driven over HTTP with the documented request and response shapes by",
    "`tests/service/test_tinker_039.py`; the SDK itself has not called them.",
    "",
    "| method | route | what the test checked |",
    "|---|---|---|",
    "| `RestClient.external_weights_upload_start` | `POST /api/v1/external_weights_upload_start` | "
    "`{base_model, lora_config, destination_project_id?}` → `{upload_id, urls, expires}`: a signed PUT URL "
    "per file (`adapter_model.safetensors`, `adapter_config.json`), bounded by the adapter's size (413) |",
    "| `RestClient.external_weights_upload_finish` | `POST /api/v1/external_weights_upload_finish` | "
    "`{upload_id}` → `{tinker_path}` of an `external_weights` checkpoint; an adapter of another rank or "
    "shape, or a missing file, is a 400 naming it; the checkpoint samples as the original did and a run "
    "starts from it and trains |",
    "| `RestClient.search_checkpoints` | `POST /api/v1/checkpoints/search` (the route is not documented; "
    "named after 0.38's `sessions/search`) | `checkpoint_type`, `base_models`, `user_metadata`, "
    "`project_ids`, `owner`, `limit` (1-200) and the `next_cursor` paging, newest first; another "
    "tenant's checkpoints never appear |",
    "| `Checkpoint.base_model` | every checkpoint listing | the checkpoint's base model |",
]


# The training surface's options beyond the method list: each row names the tests that hold it.
OPTIONS_DOC = [
    "## Options of the training surface",
    "",
    "| option | supported | what it does here, and the tests that hold it |",
    "|---|---|---|",
    "| `create_lora_training_client(rank=0)` | yes | a full fine-tune: the run trains its own copy of every "
    "weight (`train_unembed=False` freezes the embeddings); the same losses, checkpoints (a Hugging Face "
    "folder), recovery and tenancy as a LoRA run; runs beyond the device's share take turns "
    "(`tests/service/test_full_finetune.py`) |",
    "| `optimizer=DimuonOptimizerConfig()`, `optim_step(DimuonParams(...))` | yes | Dimuon as "
    "`openrl_service/training/dimuon.py` defines it (the fields of SDK 0.38 and of older clients); its "
    "momentum is saved and restored with the optimizer state (`tests/service/test_dimuon.py`) |",
    '| `loss_fn="stable_reinforce"`, `record_stability_info=True`, datum provenance | yes (alpha) | '
    "sequences recorded by sequence id for a day after their last use, in the sampling session; the "
    "loss uses the recorded sampler logprobs (`tests/service/test_stable_reinforce.py`) |",
    '| `loss_fn_config={"kl_ref_coef": c}` with `loss_fn_inputs["ref_logprobs"]` | yes (this service\'s '
    "extension) | every RL loss adds c × Σ k3 KL(policy ‖ reference) over the positions it trains, given "
    "the reference policy's logprobs of the targets; a coefficient above 0 without `ref_logprobs` is "
    "refused (a 400 naming both), and without the key the losses are exactly Tinker's "
    "(`tests/service/test_kl_ref.py`) |",
    '| `save_weights_and_get_sampling_client(kind="inflight")` | yes | one shared set of weights per '
    "run, which each later inflight save updates for every inflight client of the run "
    "(`tests/service/test_stable_reinforce.py`) |",
    "| tinker-cookbook 0.6.x | not installable | it needs `tml-renderers>=0.4.1`, which PyPI does not "
    "have (0.2.1); the cookbook's 0.5.8 recipes run unchanged (`tests/e2e`) |",
]


# ==============================================================================================
# ServiceClient
# ==============================================================================================
@check(
    "ServiceClient",
    "close",
    """finishes the session: the service then answers its heartbeat with 410, and the closed
    client refuses new work""",
)
def _(c: Ctx):
    s = c.new_service_client()
    tc = res(s.create_lora_training_client(TINY, rank=4))
    sid = s.holder.get_session_id()
    assert res(s.close("success", "surface check")) is None
    r = httpx.post(
        f"{c.url}/api/v1/session_heartbeat",
        json={"session_id": sid, "type": "session_heartbeat"},
        headers={"X-API-Key": c.key},
        timeout=30,
    )
    assert r.status_code == 410, f"heartbeat after close: {r.status_code} {r.text}"
    raises(lambda: s.create_lora_training_client(TINY, rank=4), RuntimeError)
    assert tc.model_id.startswith(f"{sid}:train:")


@check(
    "ServiceClient",
    "copy_weights",
    """copies a training checkpoint into the client's project: a new `weights` path in a new run,
    listed under that project, which loads to the source's exact logprobs""",
)
def _(c: Ctx):
    s = c.new_service_client(project_id=f"proj-sc-copy-{c.tag}")
    path = res(s.copy_weights(c.state_path))
    p, src = parse(path), parse(c.state_path)
    assert p.checkpoint_type == "training" and p.training_run_id != src.training_run_id, path
    same(fp(res(c.sc.create_training_client_from_state(path))), c.trained_fp)
    runs = res(c.rest.list_training_runs(limit=100, project_id=f"proj-sc-copy-{c.tag}")).training_runs
    assert [r.training_run_id for r in runs] == [p.training_run_id], runs


def surface_ce(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/surface_ce:sum": loss}


@check(
    "ServiceClient",
    "create_custom_loss",
    """traces a loss into a `LossHandle` (name, session, inputs with ranks); with it
    `forward_backward_custom` reports the loss equal to the service's cross-entropy""",
)
def _(c: Ctx):
    h = res(c.sc.create_custom_loss(surface_ce, {"logprobs": 1, "weights": 1}))
    assert h.name == "surface_ce" and h.session_id == c.session_id, h
    assert [(i.name, i.rank) for i in h.inputs] == [("logprobs", 1), ("weights", 1)], h.inputs
    tc = c.fresh()
    ref = loss(tc)
    out = res(tc.forward_backward_custom(DATA, h))
    assert abs(out.metrics["custom/surface_ce:sum"] - ref) < 1e-3, (out.metrics, ref)


@check(
    "ServiceClient",
    "create_lora_training_client",
    """run id `<session>:train:<n>`; `get_info` has the base model and rank; two runs with the
    same seed start with identical logprobs; the run's user_metadata is stored""",
)
def _(c: Ctx):
    a = c.fresh(user_metadata={"created": "sync"})
    assert a.model_id.startswith(f"{c.session_id}:train:"), a.model_id
    info = a.get_info()
    assert info.model_data.model_name == TINY and info.lora_rank == 8, info
    same(fp(a), c.base_fp, what="same seed, same start")
    assert res(c.rest.get_training_run(a.model_id)).user_metadata == {"created": "sync"}


@check(
    "ServiceClient",
    "create_lora_training_client_async",
    """awaited: a run with the requested rank, the next run id of the session, and the same
    starting logprobs as the sync call""",
)
def _(c: Ctx):
    a = c.fresh()
    b = c.aw(c.sc.create_lora_training_client_async(TINY, 8, 0))
    assert b.get_info().lora_rank == 8
    n = int(a.model_id.rsplit(":", 1)[1])
    assert b.model_id == f"{c.session_id}:train:{n + 1}", (a.model_id, b.model_id)
    same(fp(b), fp(a))


@check(
    "ServiceClient",
    "create_rest_client",
    """a RestClient with the same key: lists the served model and reads this session's run""",
)
def _(c: Ctx):
    rc = c.sc.create_rest_client()
    assert isinstance(rc, tinker.RestClient)
    caps = res(rc.get_server_capabilities())
    assert TINY in [m.model_name for m in caps.supported_models]
    assert res(rc.get_training_run(c.tc.model_id)).training_run_id == c.tc.model_id


@check(
    "ServiceClient",
    "create_sampling_client",
    """from a sampler checkpoint: base model known, logprobs equal the training run's at save
    time; from `base_model`: serves the untrained model (logprobs of a fresh run)""",
)
def _(c: Ctx):
    s = res(c.sc.create_sampling_client(model_path=c.sampler_path))
    assert s.get_base_model() == TINY
    same(fp_sampler(s), c.trained_fp)
    b = res(c.sc.create_sampling_client(base_model=TINY))
    assert b.get_base_model() == TINY
    same(fp_sampler(b), c.base_fp)


@check(
    "ServiceClient",
    "create_sampling_client_async",
    """awaited: the same weights (logprobs) and greedy tokens as the sync call""",
)
def _(c: Ctx):
    s = c.aw(c.sc.create_sampling_client_async(model_path=c.sampler_path))
    same(fp_sampler(s), c.trained_fp)
    a = res(c.sc.create_sampling_client(model_path=c.sampler_path))
    assert (
        res(s.sample(PROMPT, 1, GREEDY)).sequences[0].tokens
        == res(a.sample(PROMPT, 1, GREEDY)).sequences[0].tokens
    )


@check(
    "ServiceClient",
    "create_training_client_from_state",
    """a new run with the checkpoint's weights (exact logprobs) and rank, and a fresh optimizer
    (its next step differs from the original run's)""",
)
def _(c: Ctx):
    r = c.resume
    tc = res(c.sc.create_training_client_from_state(r["path"], user_metadata={"from": "state"}))
    assert tc.get_info().lora_rank == 8
    same(fp(tc), r["saved"])
    step(tc)
    differ(fp(tc), r["continued"], tol=1e-5, what="a step with a reset optimizer vs the original")
    assert res(c.rest.get_training_run(tc.model_id)).user_metadata == {"from": "state"}


@check(
    "ServiceClient",
    "create_training_client_from_state_async",
    """awaited: the checkpoint's exact logprobs, as the sync call""",
)
def _(c: Ctx):
    tc = c.aw(c.sc.create_training_client_from_state_async(c.resume["path"]))
    same(fp(tc), c.resume["saved"])


@check(
    "ServiceClient",
    "create_training_client_from_state_with_optimizer",
    """a new run with the checkpoint's weights and Adam state: its next step matches the original
    run's next step""",
)
def _(c: Ctx):
    r = c.resume
    tc = res(c.sc.create_training_client_from_state_with_optimizer(r["path"]))
    same(fp(tc), r["saved"])
    step(tc)
    same(fp(tc), r["continued"], what="the step after resuming vs the original's")


@check(
    "ServiceClient",
    "create_training_client_from_state_with_optimizer_async",
    """awaited: weights and Adam state restored (the next step matches the original's)""",
)
def _(c: Ctx):
    r = c.resume
    tc = c.aw(c.sc.create_training_client_from_state_with_optimizer_async(r["path"]))
    same(fp(tc), r["saved"])
    step(tc)
    same(fp(tc), r["continued"])


@check(
    "ServiceClient",
    "get_console_url",
    """local: the vendor console URL naming this session's id (there is no console here)""",
)
def _(c: Ctx):
    url = c.sc.get_console_url()
    assert url.startswith("https://") and url.endswith(f"/sessions/{c.session_id}"), url


@check(
    "ServiceClient",
    "get_server_capabilities",
    """lists `openrl/tiny` as trainable and sampleable with its context length; equal to
    `RestClient.get_server_capabilities`""",
)
def _(c: Ctx):
    caps = c.sc.get_server_capabilities()
    m = next(m for m in caps.supported_models if m.model_name == TINY)
    assert m.trainable is True and m.sampleable is True, m
    assert isinstance(m.max_context_length, int) and m.max_context_length >= len(FP_SEQ), m
    assert caps == res(c.rest.get_server_capabilities())


@check(
    "ServiceClient",
    "get_server_capabilities_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    assert c.aw(c.sc.get_server_capabilities_async()) == c.sc.get_server_capabilities()


@contextlib.contextmanager
def telemetry_bundle(c: Ctx):
    """Clients built with TINKER_TELEMETRY=1; at exit the client closes, which flushes the events to
    POST /api/v1/telemetry, and no batch may have been dropped (rejected by the service)."""
    cap = LogCapture()
    old = os.environ.get("TINKER_TELEMETRY")
    os.environ["TINKER_TELEMETRY"] = "1"
    try:
        s = tinker.ServiceClient(base_url=c.url, api_key=c.key)
        tc = res(s.create_lora_training_client(TINY, rank=4))
        rc = s.create_rest_client()
    finally:
        if old is None:
            os.environ.pop("TINKER_TELEMETRY", None)
        else:
            os.environ["TINKER_TELEMETRY"] = old
    with cap.on():
        try:
            yield s, tc, rc
        finally:
            res(s.close("success"))
    dropped = [
        r.getMessage()
        for r in cap.records
        if r.levelno >= logging.WARNING and "telemetry" in r.getMessage().lower()
    ]
    assert not dropped, f"telemetry not accepted: {dropped}"


def check_telemetry(tel, session_id: str | None) -> None:
    from tinker.lib.telemetry import Telemetry

    assert isinstance(tel, Telemetry), tel
    if session_id is not None:
        assert tel._session_id == session_id, (tel._session_id, session_id)
    else:
        assert tel._session_id.startswith("sessionless-"), tel._session_id
    assert tel.log("openrl_surface_check", {"ok": True}) is True


@check(
    "ServiceClient",
    "get_telemetry",
    """None with TINKER_TELEMETRY=0; otherwise the session's Telemetry, whose events the service
    accepts at close (no batch dropped)""",
)
def _(c: Ctx):
    assert c.sc.get_telemetry() is None
    with telemetry_bundle(c) as (s, _tc, _rc):
        check_telemetry(s.get_telemetry(), s.holder.get_session_id())


@check(
    "ServiceClient",
    "holder",
    """the session's client holder: its session id prefixes every run id of this client and is
    the one its sampler handles carry""",
)
def _(c: Ctx):
    sid = c.sc.holder.get_session_id()
    assert c.tc.model_id.startswith(f"{sid}:train:")
    handle = json.loads(base64.urlsafe_b64decode(c.sampler.get_sampler_handle()))
    assert handle["session_id"] == sid


# ==============================================================================================
# TrainingClient
# ==============================================================================================
@check(
    "TrainingClient",
    "create_sampling_client",
    """from a sampler checkpoint path: base model and logprobs of the weights at save time;
    `get_sampler` names the path""",
)
def _(c: Ctx):
    s = res(c.tc.create_sampling_client(c.sampler_path))
    assert s.get_base_model() == TINY
    same(fp_sampler(s), c.trained_fp)
    assert res(c.rest.get_sampler(sampler_id(s))).model_path == c.sampler_path


@check(
    "TrainingClient",
    "create_sampling_client_async",
    """awaited: the same weights (logprobs) as the sync call""",
)
def _(c: Ctx):
    s = c.aw(c.tc.create_sampling_client_async(c.sampler_path))
    same(fp_sampler(s), c.trained_fp)


@check(
    "TrainingClient",
    "forward",
    """per-datum logprobs of the targets' length; `loss:sum` equals −Σ weights·logprobs; a second
    forward gives the same numbers (no gradient, no update)""",
)
def _(c: Ctx):
    out = res(c.tc.forward(DATA, "cross_entropy"))
    assert len(out.loss_fn_outputs) == len(DATA)
    total = 0.0
    for o, d in zip(out.loss_fn_outputs, DATA, strict=True):
        lp = np.asarray(o["logprobs"].data)
        assert lp.shape == (d.model_input.length,) and np.all(lp <= 0), lp
        total -= float(np.dot(lp, np.asarray(d.loss_fn_inputs["weights"].data)))
    assert abs(out.metrics["loss:sum"] - total) < 1e-3, (out.metrics, total)
    again = res(c.tc.forward(DATA, "cross_entropy"))
    assert again.metrics == out.metrics
    same(fp(c.tc), c.trained_fp)


@check(
    "TrainingClient",
    "forward_async",
    """awaited: the same metrics and logprobs as the sync call""",
)
def _(c: Ctx):
    a = c.aw(c.tc.forward_async(DATA, "cross_entropy"))
    b = res(c.tc.forward(DATA, "cross_entropy"))
    assert a.metrics == b.metrics
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        same(x["logprobs"].data, y["logprobs"].data, tol=0)


@check(
    "TrainingClient",
    "forward_backward",
    """the same loss and logprobs as `forward` at those weights; the accumulated gradient then
    lowers the loss in `optim_step`""",
)
def _(c: Ctx):
    tc = c.fresh()
    before = res(tc.forward(DATA, "cross_entropy"))
    fb = res(tc.forward_backward(DATA, "cross_entropy"))
    assert abs(fb.metrics["loss:sum"] - before.metrics["loss:sum"]) < 1e-4, (fb.metrics, before.metrics)
    for x, y in zip(fb.loss_fn_outputs, before.loss_fn_outputs, strict=True):
        same(x["logprobs"].data, y["logprobs"].data)
    res(tc.optim_step(types.AdamParams(learning_rate=LR)))
    assert loss(tc) < before.metrics["loss:sum"] - 1e-3


@check(
    "TrainingClient",
    "forward_backward_async",
    """awaited, on a twin run: the same metrics as the sync call and, after a step, the same
    weights""",
)
def _(c: Ctx):
    a, b = c.fresh(), c.fresh()
    ma = res(a.forward_backward(DATA, "cross_entropy")).metrics
    mb = c.aw(b.forward_backward_async(DATA, "cross_entropy")).metrics
    assert ma == mb, (ma, mb)
    res(a.optim_step(types.AdamParams(learning_rate=LR)))
    res(b.optim_step(types.AdamParams(learning_rate=LR)))
    same(fp(a), fp(b), tol=0)


def ce_callable(data, logprobs_list):
    import torch

    loss = sum(
        -(lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum()
        for d, lp in zip(data, logprobs_list, strict=True)
    )
    return loss, {"custom_ce:sum": float(loss)}


@check(
    "TrainingClient",
    "forward_backward_custom",
    """a client-side cross-entropy: `loss:sum` and its metric equal the service's cross-entropy,
    and the step it takes equals a `forward_backward("cross_entropy")` step""",
)
def _(c: Ctx):
    a, b = c.fresh(), c.fresh()
    ref = res(a.forward_backward(DATA, "cross_entropy")).metrics["loss:sum"]
    out = res(b.forward_backward_custom(DATA, ce_callable))
    assert abs(out.metrics["loss:sum"] - ref) < 1e-3 and abs(out.metrics["custom_ce:sum"] - ref) < 1e-3, (
        out.metrics,
        ref,
    )
    res(a.optim_step(types.AdamParams(learning_rate=LR)))
    res(b.optim_step(types.AdamParams(learning_rate=LR)))
    same(fp(a), fp(b), tol=1e-5)


@check(
    "TrainingClient",
    "forward_backward_custom_async",
    """awaited: the same loss as the sync call on a twin run, and the same weights after a step""",
)
def _(c: Ctx):
    a, b = c.fresh(), c.fresh()
    ma = res(a.forward_backward_custom(DATA, ce_callable)).metrics
    mb = c.aw(b.forward_backward_custom_async(DATA, ce_callable)).metrics
    assert abs(ma["loss:sum"] - mb["loss:sum"]) < 1e-6, (ma, mb)
    res(a.optim_step(types.AdamParams(learning_rate=LR)))
    res(b.optim_step(types.AdamParams(learning_rate=LR)))
    same(fp(a), fp(b), tol=1e-6)


@check(
    "TrainingClient",
    "get_console_url",
    """local: the vendor console URL naming this run's id (there is no console here)""",
)
def _(c: Ctx):
    url = c.tc.get_console_url()
    assert url.startswith("https://") and url.endswith(c.tc.model_id), url


@check(
    "TrainingClient",
    "get_info",
    """the run id, `model_data.model_name` `openrl/tiny`, `is_lora`, and the rank it was created
    with""",
)
def _(c: Ctx):
    info = c.tc.get_info()
    assert info.model_id == c.tc.model_id and info.model_data.model_name == TINY, info
    assert info.lora_rank == 8 and info.is_lora in (True, None), info
    four = res(c.sc.create_lora_training_client(TINY, rank=4))
    assert four.get_info().lora_rank == 4


@check(
    "TrainingClient",
    "get_info_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    assert c.aw(c.tc.get_info_async()) == c.tc.get_info()


@check(
    "TrainingClient",
    "get_telemetry",
    """None with TINKER_TELEMETRY=0; otherwise the session's Telemetry, shared with its
    ServiceClient, whose events the service accepts""",
)
def _(c: Ctx):
    assert c.tc.get_telemetry() is None
    with telemetry_bundle(c) as (s, tc, _rc):
        assert tc.get_telemetry() is s.get_telemetry()
        check_telemetry(tc.get_telemetry(), s.holder.get_session_id())


TOKENIZER_DOC = """in a subprocess with `HF_ENDPOINT` at the service, `HF_TOKEN` the key and an empty
`HF_HOME`: the `openrl/tiny` tokenizer (260 tokens; bytes are ids 0–255, so it encodes and decodes
bytes exactly; the four specials; the chat template)"""


def check_tokenizer(v: dict) -> None:
    assert v["len"] == 260, v
    assert v["encode_hi"] == [72, 105], v
    assert v["decode"] == "Hello, world", v
    assert v["specials"] == [256, 257, 258, 259], v
    assert v["chat"].startswith("<|im_start|>user\nhi<|im_end|>"), v


@check("TrainingClient", "get_tokenizer", TOKENIZER_DOC)
def _(c: Ctx):
    check_tokenizer(c.child_result("TrainingClient.get_tokenizer"))


@check(
    "TrainingClient",
    "load_state",
    """restores a checkpoint's weights in place (exact logprobs after training past it) and resets
    the optimizer (the next step differs from the original run's)""",
)
def _(c: Ctx):
    r = c.resume
    tc = c.fresh()
    step(tc)
    resp = res(tc.load_state(r["path"]))
    assert resp.path in (None, r["path"]), resp
    same(fp(tc), r["saved"])
    step(tc)
    differ(fp(tc), r["continued"], tol=1e-5, what="a step with a reset optimizer vs the original")


@check(
    "TrainingClient",
    "load_state_async",
    """awaited: restores the checkpoint's exact logprobs""",
)
def _(c: Ctx):
    tc = c.fresh()
    c.aw(tc.load_state_async(c.resume["path"]))
    same(fp(tc), c.resume["saved"])


@check(
    "TrainingClient",
    "load_state_with_optimizer",
    """restores weights and Adam state in place: the next step matches the original run's""",
)
def _(c: Ctx):
    r = c.resume
    tc = c.fresh()
    step(tc)
    res(tc.load_state_with_optimizer(r["path"]))
    same(fp(tc), r["saved"])
    step(tc)
    same(fp(tc), r["continued"], what="the step after loading vs the original's")


@check(
    "TrainingClient",
    "load_state_with_optimizer_async",
    """awaited: weights and Adam state restored (the next step matches the original's)""",
)
def _(c: Ctx):
    r = c.resume
    tc = c.fresh()
    c.aw(tc.load_state_with_optimizer_async(r["path"]))
    step(tc)
    same(fp(tc), r["continued"])


@check(
    "TrainingClient",
    "optim_step",
    """returns `OptimStepResponse`; with lr 0 the weights stay exactly as they were, with lr > 0
    the loss on the batch goes down""",
)
def _(c: Ctx):
    tc = c.fresh()
    before = fp(tc)
    res(tc.forward_backward(DATA, "cross_entropy"))
    r = res(tc.optim_step(types.AdamParams(learning_rate=0.0)))
    assert isinstance(r, types.OptimStepResponse), r
    same(fp(tc), before, tol=0, what="weights after an lr-0 step")
    l0 = loss(tc)
    step(tc)
    assert loss(tc) < l0 - 1e-3


@check(
    "TrainingClient",
    "optim_step_async",
    """awaited, on a twin run: the same weights as the sync call""",
)
def _(c: Ctx):
    a, b = c.fresh(), c.fresh()
    res(a.forward_backward(DATA, "cross_entropy"))
    res(b.forward_backward(DATA, "cross_entropy"))
    ra = res(a.optim_step(types.AdamParams(learning_rate=LR)))
    rb = c.aw(b.optim_step_async(types.AdamParams(learning_rate=LR)))
    assert isinstance(rb, types.OptimStepResponse) and ra.metrics == rb.metrics, (ra, rb)
    same(fp(a), fp(b), tol=0)


def listed(c: Ctx, path: str) -> types.Checkpoint:
    p = parse(path)
    cks = res(c.rest.list_checkpoints(p.training_run_id)).checkpoints
    hits = [ck for ck in cks if ck.tinker_path == path]
    assert len(hits) == 1, f"{path} listed {len(hits)} times in {[ck.tinker_path for ck in cks]}"
    ck = hits[0]
    assert ck.checkpoint_id == p.checkpoint_id and ck.checkpoint_type == p.checkpoint_type, ck
    return ck


@check(
    "TrainingClient",
    "save_state",
    """path `tinker://<run>/weights/<name>`; listed as a `training` checkpoint with its size,
    user_metadata and `expires_at` = now + ttl; loads back to the same logprobs; an existing name
    is refused unless `overwrite=True`""",
)
def _(c: Ctx):
    tc = c.scratch
    path = res(tc.save_state("saved", ttl_seconds=7200, user_metadata={"k": "v"})).path
    assert path == f"tinker://{tc.model_id}/weights/saved", path
    ck = listed(c, path)
    assert ck.size_bytes and ck.size_bytes > 0 and ck.user_metadata == {"k": "v"}, ck
    near_now(ck.time, what="time")
    near_now(ck.expires_at, 7200, what="expires_at")
    same(fp(res(c.sc.create_training_client_from_state(path))), fp(tc))
    raises(lambda: res(tc.save_state("saved")), tinker.RequestFailedError, tinker.APIStatusError)
    assert res(tc.save_state("saved", overwrite=True)).path == path
    assert listed(c, path).expires_at is None


@check(
    "TrainingClient",
    "save_state_async",
    """awaited: the `weights` path, listed as `training`, loading back to the same logprobs""",
)
def _(c: Ctx):
    tc = c.scratch
    path = c.aw(tc.save_state_async("saved-async")).path
    assert path == f"tinker://{tc.model_id}/weights/saved-async", path
    assert listed(c, path).checkpoint_type == "training"
    same(fp(res(c.sc.create_training_client_from_state(path))), fp(tc))


@check(
    "TrainingClient",
    "save_weights_and_get_sampling_client",
    """a sampler whose logprobs equal the run's at that moment, and stay so after the run trains on
    (a snapshot)""",
)
def _(c: Ctx):
    tc = c.fresh()
    step(tc)
    now = fp(tc)
    s = res(tc.save_weights_and_get_sampling_client())
    assert s.get_base_model() == TINY
    same(fp_sampler(s), now)
    step(tc)
    differ(fp(tc), now)
    same(fp_sampler(s), now, what="the sampler after more training")


@check(
    "TrainingClient",
    "save_weights_and_get_sampling_client_async",
    """awaited: a sampler with the run's current logprobs""",
)
def _(c: Ctx):
    s = c.aw(c.tc.save_weights_and_get_sampling_client_async())
    same(fp_sampler(s), c.trained_fp)


@check(
    "TrainingClient",
    "save_weights_external",
    """path `tinker://<run>/external_weights/<name>`; listed as an `external` checkpoint with
    its size and `expires_at`; `get_external_weights_urls` serves its files""",
)
def _(c: Ctx):
    tc = c.scratch
    resp = res(tc.save_weights_external("export", ttl_seconds=7200))
    assert resp.path == f"tinker://{tc.model_id}/external_weights/export", resp
    ck = listed(c, resp.path)
    assert ck.checkpoint_type == "external" and ck.size_bytes and ck.size_bytes > 0, ck
    near_now(ck.expires_at, 7200, what="expires_at")
    check_external_urls(c, res(c.rest.get_external_weights_urls(resp.path)), rank=8)


@check(
    "TrainingClient",
    "save_weights_external_async",
    """awaited: the `external_weights` path, listed as `external`""",
)
def _(c: Ctx):
    tc = c.scratch
    resp = c.aw(tc.save_weights_external_async("export-async"))
    assert resp.path == f"tinker://{tc.model_id}/external_weights/export-async", resp
    assert listed(c, resp.path).checkpoint_type == "external"


@check(
    "TrainingClient",
    "save_weights_for_sampler",
    """path `tinker://<run>/sampler_weights/<name>`; listed as `sampler` with user_metadata and
    `expires_at`; a sampler on it has the run's logprobs""",
)
def _(c: Ctx):
    tc = c.scratch
    path = res(tc.save_weights_for_sampler("for-sampler", ttl_seconds=7200, user_metadata={"s": "1"})).path
    assert path == f"tinker://{tc.model_id}/sampler_weights/for-sampler", path
    ck = listed(c, path)
    assert ck.checkpoint_type == "sampler" and ck.user_metadata == {"s": "1"}, ck
    near_now(ck.expires_at, 7200, what="expires_at")
    same(fp_sampler(res(c.sc.create_sampling_client(model_path=path))), fp(tc))


@check(
    "TrainingClient",
    "save_weights_for_sampler_async",
    """awaited: the `sampler_weights` path; a sampler on it has the run's logprobs""",
)
def _(c: Ctx):
    tc = c.scratch
    path = c.aw(tc.save_weights_for_sampler_async("for-sampler-async")).path
    assert path == f"tinker://{tc.model_id}/sampler_weights/for-sampler-async", path
    same(fp_sampler(res(c.sc.create_sampling_client(model_path=path))), fp(tc))


# ==============================================================================================
# SamplingClient
# ==============================================================================================
@check(
    "SamplingClient",
    "compute_logprobs",
    """one entry per prompt token, the first None, the rest equal to the training run's logprobs
    (|Δ| ≤ 1e-4); `prompt_logprobs_last_n` keeps the last n""",
)
def _(c: Ctx):
    same(fp_sampler(c.sampler), c.trained_fp)
    last = res(c.sampler.compute_logprobs(types.ModelInput.from_ints(FP_SEQ), prompt_logprobs_last_n=3))
    assert len(last) == len(FP_SEQ) and all(x is None for x in last[:-3]), last
    same(last[-3:], c.trained_fp[-3:])


@check(
    "SamplingClient",
    "compute_logprobs_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    seq = types.ModelInput.from_ints(FP_SEQ)
    assert c.aw(c.sampler.compute_logprobs_async(seq)) == res(c.sampler.compute_logprobs(seq))


@check(
    "SamplingClient",
    "create",
    """static, on a ServiceClient's holder and a sampler checkpoint: base model fetched from the
    service, logprobs of the checkpoint""",
)
def _(c: Ctx):
    s = res(tinker.SamplingClient.create(c.sc.holder, model_path=c.sampler_path))
    assert s.get_base_model() == TINY
    same(fp_sampler(s), c.trained_fp)


@check(
    "SamplingClient",
    "from_sampler_handle",
    """in a subprocess: the handle's sampler gives the same greedy tokens and logprobs as in the
    parent""",
)
def _(c: Ctx):
    v = c.child_result("SamplingClient.from_sampler_handle")
    assert v["base_model"] == TINY, v
    assert v["greedy"] == res(c.sampler.sample(PROMPT, 1, GREEDY)).sequences[0].tokens, v
    same(v["logprobs"], c.trained_fp)


@check(
    "SamplingClient",
    "get_base_model",
    """`openrl/tiny`, also for a sampler made from a checkpoint path alone (read back from the
    service)""",
)
def _(c: Ctx):
    assert c.sampler.get_base_model() == TINY
    s = res(c.sc.create_sampling_client(model_path=c.sampler_path))
    assert s.get_base_model() == TINY


@check(
    "SamplingClient",
    "get_base_model_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    assert c.aw(c.sampler.get_base_model_async()) == c.sampler.get_base_model() == TINY


@check(
    "SamplingClient",
    "get_sampler_handle",
    """a base64 JSON handle naming this sampler and session, carrying no API key""",
)
def _(c: Ctx):
    h = c.sampler.get_sampler_handle()
    d = json.loads(base64.urlsafe_b64decode(h))
    assert d["sampling_session_id"] == sampler_id(c.sampler) and d["session_id"] == c.session_id, d
    assert d["holder"]["api_key"] is None and c.key not in h, d


@check(
    "SamplingClient",
    "get_telemetry",
    """None with TINKER_TELEMETRY=0; otherwise the session's Telemetry, whose events the service
    accepts""",
)
def _(c: Ctx):
    assert c.sampler.get_telemetry() is None
    with telemetry_bundle(c) as (s, tc, _rc):
        smp = res(tc.save_weights_and_get_sampling_client())
        assert smp.get_telemetry() is s.get_telemetry()
        check_telemetry(smp.get_telemetry(), s.holder.get_session_id())


@check("SamplingClient", "get_tokenizer", TOKENIZER_DOC)
def _(c: Ctx):
    check_tokenizer(c.child_result("SamplingClient.get_tokenizer"))


@check(
    "SamplingClient",
    "on_queue_state_change",
    """local: a paused queue state logs a warning naming the sampler and the reason; `active`
    logs nothing""",
)
def _(c: Ctx):
    from tinker.lib.api_future_impl import QueueState

    s = res(c.sc.create_sampling_client(base_model=TINY))
    with LogCapture().on() as cap:
        s.on_queue_state_change(QueueState.ACTIVE, None)
        assert not cap.records
        s.on_queue_state_change(QueueState.PAUSED_CAPACITY, "surface check")
    msgs = [r.getMessage() for r in cap.records if r.levelno == logging.WARNING]
    assert any(sampler_id(s) in m and "surface check" in m for m in msgs), msgs


@check(
    "SamplingClient",
    "sample",
    """`num_samples` sequences with unique ids, ≤ max_tokens tokens and one logprob each, equal to
    the training run's logprobs of those tokens; the same seed gives the same tokens; prompt
    logprobs match `compute_logprobs`""",
)
def _(c: Ctx):
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    r = res(c.sampler.sample(PROMPT, 3, params, include_prompt_logprobs=True))
    assert len(r.sequences) == 3 and len({s.sequence_id for s in r.sequences}) == 3, r
    for s in r.sequences:
        assert 0 < len(s.tokens) <= 6 and len(s.logprobs) == len(s.tokens), s
        assert s.stop_reason in ("stop", "length"), s
        seq = PROMPT.to_ints() + s.tokens
        d = types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
        )
        lp = res(c.tc.forward([d], "cross_entropy")).loss_fn_outputs[0]["logprobs"].data
        same(s.logprobs, lp[-len(s.tokens) :], tol=1e-3, what="sampled-token logprobs vs training")
    again = res(c.sampler.sample(PROMPT, 3, params))
    assert [s.tokens for s in again.sequences] == [s.tokens for s in r.sequences]
    pl = r.prompt_logprobs
    assert pl is not None and len(pl) == PROMPT.length and pl[0] is None, pl
    same(pl[1:], res(c.sampler.compute_logprobs(PROMPT))[1:])


@check(
    "SamplingClient",
    "sample_async",
    """awaited: with the same seed, the same tokens and logprobs as the sync call""",
)
def _(c: Ctx):
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    a = c.aw(c.sampler.sample_async(PROMPT, 2, params))
    b = res(c.sampler.sample(PROMPT, 2, params))
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    for x, y in zip(a.sequences, b.sequences, strict=True):
        same(x.logprobs, y.logprobs)


# ==============================================================================================
# RestClient
# ==============================================================================================
def search(c: Ctx, **kw) -> types.SessionSearchResponse:
    return res(c.rest.search_sessions(types.SessionSearchRequest(**kw)))


@check(
    "RestClient",
    "assign_session_project",
    """moves a session into a project: `search_sessions` reports the new project_id and
    `list_training_runs(project_id=…)` then lists the session's run; another tenant gets 404""",
)
def _(c: Ctx):
    s = c.new_service_client(display_name=f"assign-{c.tag}")
    tc = res(s.create_lora_training_client(TINY, rank=4))
    sid = s.holder.get_session_id()
    proj = f"proj-assigned-{c.tag}"
    assert res(c.rest.assign_session_project(sid, proj)) is None
    hit = [x for x in search(c, session_id=sid).sessions if x.session_id == sid]
    assert len(hit) == 1 and hit[0].project_id == proj, hit
    runs = res(c.rest.list_training_runs(limit=100, project_id=proj)).training_runs
    assert [r.training_run_id for r in runs] == [tc.model_id], runs
    not_found(lambda: res(c.rest_other.assign_session_project(sid, "proj-theft")))


@check(
    "RestClient",
    "assign_session_project_async",
    """awaited: the session's project changes, as the sync call""",
)
def _(c: Ctx):
    s = c.new_service_client()
    res(s.create_lora_training_client(TINY, rank=4))
    sid = s.holder.get_session_id()
    proj = f"proj-assigned-async-{c.tag}"
    assert c.aw(c.rest.assign_session_project_async(sid, proj)) is None
    hit = [x for x in search(c, session_id=sid).sessions if x.session_id == sid]
    assert len(hit) == 1 and hit[0].project_id == proj, hit


@check(
    "RestClient",
    "copy_weights",
    """copies a sampler checkpoint into a named project with a TTL: a `sampler_weights` path in a
    new run listed under that project, `expires_at` = now + ttl, and a sampler on it gives the
    source's logprobs""",
)
def _(c: Ctx):
    proj = f"proj-copy-{c.tag}"
    path = res(c.rest.copy_weights(c.sampler_path, proj, ttl_seconds=7200))
    p, src = parse(path), parse(c.sampler_path)
    assert p.checkpoint_type == "sampler" and p.training_run_id != src.training_run_id, path
    near_now(listed(c, path).expires_at, 7200, what="the copy's expires_at")
    same(fp_sampler(res(c.sc.create_sampling_client(model_path=path))), c.trained_fp)
    runs = res(c.rest.list_training_runs(limit=100, project_id=proj)).training_runs
    assert [r.training_run_id for r in runs] == [p.training_run_id], runs
    not_found(lambda: res(c.rest_other.copy_weights(c.sampler_path, "proj-theft")))


@check(
    "RestClient",
    "copy_weights_async",
    """awaited: a training-checkpoint copy that loads to the source's logprobs""",
)
def _(c: Ctx):
    path = c.aw(c.rest.copy_weights_async(c.state_path, f"proj-copy-async-{c.tag}"))
    assert parse(path).checkpoint_type == "training", path
    same(fp(res(c.sc.create_training_client_from_state(path))), c.trained_fp)


def check_deleted(c: Ctx, path: str, delete: Callable[[], object]) -> None:
    p = parse(path)
    assert delete() is None
    ids = [ck.checkpoint_id for ck in res(c.rest.list_checkpoints(p.training_run_id)).checkpoints]
    assert p.checkpoint_id not in ids, ids
    assert path not in [ck.tinker_path for ck in res(c.rest.list_user_checkpoints(limit=1000)).checkpoints]
    if p.checkpoint_type == "training":
        raises(
            lambda: res(c.sc.create_training_client_from_state(path)),
            tinker.RequestFailedError,
            tinker.APIStatusError,
        )
    else:
        raises(
            lambda: res(c.sc.create_sampling_client(model_path=path)),
            tinker.RequestFailedError,
            tinker.APIStatusError,
        )
    not_found(lambda: res(c.rest.get_weights_info_by_tinker_path(path)))
    not_found(lambda: res(c.rest.delete_checkpoint(p.training_run_id, p.checkpoint_id)))


@check(
    "RestClient",
    "delete_checkpoint",
    """the checkpoint leaves both listings, can no longer be loaded, `weights_info` on it and a
    second delete are 404s; another tenant's delete is a 404 and deletes nothing""",
)
def _(c: Ctx):
    tc = c.scratch
    path = res(tc.save_state("to-delete")).path
    p = parse(path)
    not_found(lambda: res(c.rest_other.delete_checkpoint(p.training_run_id, p.checkpoint_id)))
    listed(c, path)
    check_deleted(c, path, lambda: res(c.rest.delete_checkpoint(p.training_run_id, p.checkpoint_id)))


@check(
    "RestClient",
    "delete_checkpoint_async",
    """awaited: the checkpoint is gone from the listing and a second delete is a 404""",
)
def _(c: Ctx):
    path = res(c.scratch.save_state("to-delete-async")).path
    p = parse(path)
    check_deleted(c, path, lambda: c.aw(c.rest.delete_checkpoint_async(p.training_run_id, p.checkpoint_id)))


@check(
    "RestClient",
    "delete_checkpoint_from_tinker_path",
    """a sampler checkpoint leaves the listings, no sampler can be created on it, and a second
    delete is a 404""",
)
def _(c: Ctx):
    path = res(c.scratch.save_weights_for_sampler("to-delete-path")).path
    listed(c, path)
    check_deleted(c, path, lambda: res(c.rest.delete_checkpoint_from_tinker_path(path)))


@check(
    "RestClient",
    "delete_checkpoint_from_tinker_path_async",
    """awaited: the checkpoint is gone and a second delete is a 404""",
)
def _(c: Ctx):
    path = res(c.scratch.save_state("to-delete-path-async")).path
    check_deleted(c, path, lambda: c.aw(c.rest.delete_checkpoint_from_tinker_path_async(path)))


def check_trace(c: Ctx, url: str, run_id: str) -> None:
    assert isinstance(url, str) and url.startswith(("http://", "https://")), url
    r = httpx.get(url, timeout=30)  # a signed URL: no key
    assert r.status_code == 200 and len(r.content) > 0, (r.status_code, r.content[:200])
    assert run_id.encode() in r.content, "the trace does not name the session's training run"


@check(
    "RestClient",
    "export_session_trace",
    """a download URL (fetched without the key) whose trace names the session's training run;
    another tenant gets 404""",
)
def _(c: Ctx):
    _ = c.tc
    check_trace(c, res(c.rest.export_session_trace(c.session_id), timeout=120), c.tc.model_id)
    not_found(lambda: res(c.rest_other.export_session_trace(c.session_id)))


@check(
    "RestClient",
    "export_session_trace_async",
    """awaited: a download URL whose trace names the session's run""",
)
def _(c: Ctx):
    check_trace(c, c.aw(c.rest.export_session_trace_async(c.session_id), timeout=120), c.tc.model_id)


@check(
    "RestClient",
    "get_audit_log",
    "",
)
def _(c: Ctx):
    res(c.rest.get_audit_log(), timeout=30)


@check("RestClient", "get_audit_log_async", "")
def _(c: Ctx):
    c.aw(c.rest.get_audit_log_async(), timeout=30)


@check("RestClient", "get_billing_usage", "")
def _(c: Ctx):
    res(c.rest.get_billing_usage("2026-01-01", "2026-01-02"), timeout=30)


@check("RestClient", "get_billing_usage_async", "")
def _(c: Ctx):
    c.aw(c.rest.get_billing_usage_async("2026-01-01", "2026-01-02"), timeout=30)


@check("RestClient", "get_current_checkpoint_storage_usage", "")
def _(c: Ctx):
    res(c.rest.get_current_checkpoint_storage_usage(), timeout=30)


@check("RestClient", "get_current_checkpoint_storage_usage_async", "")
def _(c: Ctx):
    c.aw(c.rest.get_current_checkpoint_storage_usage_async(), timeout=30)


@check("RestClient", "whoami", "")
def _(c: Ctx):
    res(c.rest.whoami(), timeout=30)


def check_external_urls(c: Ctx, r: types.ExternalWeightsUrlsResponse, rank: int) -> None:
    assert r.urls, r
    assert utc(r.expires) > datetime.now(timezone.utc), r.expires
    files = {}
    for name, url in r.urls.items():
        got = httpx.get(url, timeout=30)  # signed URLs: no key
        assert got.status_code == 200 and got.content, (name, got.status_code)
        files[name] = got.content
    st = [n for n in files if n.endswith(".safetensors")]
    assert st, f"no safetensors file among {sorted(files)}"
    for n in st:
        (hlen,) = np.frombuffer(files[n][:8], dtype="<u8")
        header = json.loads(files[n][8 : 8 + int(hlen)])
        assert any(k != "__metadata__" for k in header), header
    cfg = [n for n in files if n.endswith("adapter_config.json")]
    if cfg:
        assert json.loads(files[cfg[0]])["r"] == rank


@check(
    "RestClient",
    "get_external_weights_urls",
    """one URL per file, expiring in the future; every URL downloads without the key, with a
    valid safetensors file among them; another tenant gets 404""",
)
def _(c: Ctx):
    path = res(c.scratch.save_weights_external("urls")).path
    check_external_urls(c, res(c.rest.get_external_weights_urls(path)), rank=8)
    not_found(lambda: res(c.rest_other.get_external_weights_urls(path)))


@check(
    "RestClient",
    "get_external_weights_urls_async",
    """awaited: the same files as the sync call""",
)
def _(c: Ctx):
    path = res(c.scratch.save_weights_external("urls-async")).path
    a = c.aw(c.rest.get_external_weights_urls_async(path))
    assert set(a.urls) == set(res(c.rest.get_external_weights_urls(path)).urls), a
    check_external_urls(c, a, rank=8)


@check(
    "RestClient",
    "get_sampler",
    """the sampler id, base model, and `model_path` (the checkpoint for a checkpoint sampler,
    None for a base-model one); another tenant gets 404""",
)
def _(c: Ctx):
    s = res(c.sc.create_sampling_client(model_path=c.sampler_path))
    g = res(c.rest.get_sampler(sampler_id(s)))
    assert (g.sampler_id, g.base_model, g.model_path) == (sampler_id(s), TINY, c.sampler_path), g
    b = res(c.sc.create_sampling_client(base_model=TINY))
    g = res(c.rest.get_sampler(sampler_id(b)))
    assert (g.sampler_id, g.base_model, g.model_path) == (sampler_id(b), TINY, None), g
    not_found(lambda: res(c.rest_other.get_sampler(sampler_id(s))))


@check(
    "RestClient",
    "get_sampler_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    sid = sampler_id(c.sampler)
    assert c.aw(c.rest.get_sampler_async(sid)) == res(c.rest.get_sampler(sid))


@check(
    "RestClient",
    "get_server_capabilities",
    """`openrl/tiny` trainable and sampleable, with a context length that fits the test
    sequences""",
)
def _(c: Ctx):
    caps = res(c.rest.get_server_capabilities())
    m = [m for m in caps.supported_models if m.model_name == TINY]
    assert len(m) == 1 and m[0].trainable is True and m[0].sampleable is True, caps
    assert isinstance(m[0].max_context_length, int) and m[0].max_context_length >= 64, m


@check(
    "RestClient",
    "get_session",
    """the session's training runs and samplers, its user_metadata and display name; another
    tenant gets 404""",
)
def _(c: Ctx):
    _ = c.sampler
    g = res(c.rest.get_session(c.session_id))
    assert c.tc.model_id in g.training_run_ids, g
    assert all(r.startswith(f"{c.session_id}:train:") for r in g.training_run_ids), g
    assert sampler_id(c.sampler) in g.sampler_ids, g
    assert g.user_metadata == {"suite": "surface"} and g.display_name == c.display_name, g
    not_found(lambda: res(c.rest_other.get_session(c.session_id)))


@check(
    "RestClient",
    "get_session_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    s = c.new_service_client(user_metadata={"x": "y"})
    tc = res(s.create_lora_training_client(TINY, rank=4))
    sid = s.holder.get_session_id()
    g = c.aw(c.rest.get_session_async(sid))
    assert g == res(c.rest.get_session(sid)) and g.training_run_ids == [tc.model_id], g
    assert g.user_metadata == {"x": "y"}, g


@check(
    "RestClient",
    "get_telemetry",
    """None with TINKER_TELEMETRY=0; otherwise a session-less Telemetry whose events the service
    accepts""",
)
def _(c: Ctx):
    assert c.rest.get_telemetry() is None
    with telemetry_bundle(c) as (s, _tc, rc):
        assert rc.get_telemetry() is not s.get_telemetry()
        check_telemetry(rc.get_telemetry(), None)


def check_run(c: Ctx, r: types.TrainingRun) -> None:
    assert r.training_run_id == c.tc.model_id and r.base_model == TINY, r
    assert r.is_lora is True and r.lora_rank == 8 and r.corrupted is False and r.model_owner, r
    assert r.user_metadata == {"role": "main"}, r
    assert r.last_checkpoint is not None and r.last_checkpoint.tinker_path == c.state_path, r
    assert r.last_sampler_checkpoint is not None and r.last_sampler_checkpoint.tinker_path == c.sampler_path
    near_now(r.last_request_time, what="last_request_time", since="suite")


@check(
    "RestClient",
    "get_training_run",
    """id, base model, owner, LoRA rank, user_metadata, last training and sampler checkpoints,
    a recent last_request_time; another tenant gets 404""",
)
def _(c: Ctx):
    check_run(c, res(c.rest.get_training_run(c.tc.model_id)))
    not_found(lambda: res(c.rest_other.get_training_run(c.tc.model_id)))
    not_found(lambda: res(c.rest.get_training_run(f"{c.session_id}:train:9999")))


@check(
    "RestClient",
    "get_training_run_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    a = c.aw(c.rest.get_training_run_async(c.tc.model_id))
    check_run(c, a)
    assert a == res(c.rest.get_training_run(c.tc.model_id))


@check(
    "RestClient",
    "get_training_run_by_tinker_path",
    """the run a checkpoint path belongs to, with the same fields as `get_training_run`""",
)
def _(c: Ctx):
    r = res(c.rest.get_training_run_by_tinker_path(c.sampler_path))
    check_run(c, r)
    not_found(lambda: res(c.rest_other.get_training_run_by_tinker_path(c.state_path)))


@check(
    "RestClient",
    "get_training_run_by_tinker_path_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    a = c.aw(c.rest.get_training_run_by_tinker_path_async(c.state_path))
    assert a == res(c.rest.get_training_run_by_tinker_path(c.state_path))
    check_run(c, a)


@check(
    "RestClient",
    "get_weights_info_by_tinker_path",
    """base model, LoRA rank and which layers were trained, for a run created with rank 4 and no
    MLP adapters (training and sampler paths); another tenant gets 404""",
)
def _(c: Ctx):
    tc = res(c.sc.create_lora_training_client(TINY, rank=4, train_mlp=False))
    for path in (res(tc.save_state("info")).path, res(tc.save_weights_for_sampler("info")).path):
        w = res(c.rest.get_weights_info_by_tinker_path(path))
        assert (w.base_model, w.is_lora, w.lora_rank) == (TINY, True, 4), w
        assert (w.train_mlp, w.train_attn, w.train_unembed) == (False, True, True), w
    not_found(lambda: res(c.rest_other.get_weights_info_by_tinker_path(c.state_path)))


@check(
    "RestClient",
    "list_checkpoints",
    """exactly the run's checkpoints, newest first: ids, types, paths, sizes (the training one,
    with optimizer state, larger), user_metadata, `public` false; another tenant gets 404""",
)
def _(c: Ctx):
    cks = res(c.rest.list_checkpoints(c.tc.model_id)).checkpoints
    got = {ck.checkpoint_id: ck for ck in cks}
    assert set(got) == {"weights/main-state", "sampler_weights/main-sampler"}, got
    st, sp = got["weights/main-state"], got["sampler_weights/main-sampler"]
    assert (st.checkpoint_type, st.tinker_path) == ("training", c.state_path), st
    assert (sp.checkpoint_type, sp.tinker_path) == ("sampler", c.sampler_path), sp
    assert st.user_metadata == {"note": "main"} and not st.public and not sp.public, cks
    assert st.size_bytes > sp.size_bytes > 0, (st.size_bytes, sp.size_bytes)
    assert [ck.checkpoint_id for ck in cks] == ["sampler_weights/main-sampler", "weights/main-state"]
    assert st.expires_at is None and sp.expires_at is None
    not_found(lambda: res(c.rest_other.list_checkpoints(c.tc.model_id)))


@check(
    "RestClient",
    "list_checkpoints_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    assert c.aw(c.rest.list_checkpoints_async(c.tc.model_id)) == res(c.rest.list_checkpoints(c.tc.model_id))


@check(
    "RestClient",
    "list_sessions",
    """pages (limit/offset) that together hold each of the caller's sessions once, this one
    included; another tenant's list holds none of them""",
)
def _(c: Ctx):
    _ = c.tc
    full = res(c.rest.list_sessions(limit=1000)).sessions
    assert c.session_id in full and len(set(full)) == len(full), full
    paged = []
    for off in range(0, len(full) + 2, 2):
        page = res(c.rest.list_sessions(limit=2, offset=off)).sessions
        assert len(page) <= 2
        paged += page
    assert sorted(paged) == sorted(full), (paged, full)
    assert not set(res(c.rest_other.list_sessions(limit=1000)).sessions) & set(full)


@check(
    "RestClient",
    "list_sessions_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    _ = c.tc
    assert c.aw(c.rest.list_sessions_async(limit=1000)) == res(c.rest.list_sessions(limit=1000))


def page_all(fetch: Callable[[int, int], object], items: str, limit: int = 3) -> tuple[list, int]:
    """Page through a cursor listing; check each cursor and return (all items, total_count)."""
    got, off, total = [], 0, None
    while True:
        r = fetch(limit, off)
        page = getattr(r, items)
        assert r.cursor is not None, "no cursor"
        assert (r.cursor.offset, r.cursor.limit) == (off, limit), r.cursor
        assert total is None or r.cursor.total_count == total, r.cursor
        total = r.cursor.total_count
        assert len(page) == min(limit, max(0, total - off)), (len(page), r.cursor)
        got += page
        off += limit
        if off >= total:
            return got, total


@check(
    "RestClient",
    "list_training_runs",
    """paging: each cursor echoes offset/limit with one total_count, pages hold each run once and
    add up to it; the project filter selects this session's runs; another tenant sees none""",
)
def _(c: Ctx):
    _ = c.tc
    runs, total = page_all(
        lambda lim, off: res(c.rest.list_training_runs(limit=lim, offset=off)), "training_runs"
    )
    ids = [r.training_run_id for r in runs]
    assert len(ids) == total == len(set(ids)) and c.tc.model_id in ids, (total, ids)
    assert all(r.base_model == TINY for r in runs)
    proj = res(c.rest.list_training_runs(limit=1000, project_id="proj-surface")).training_runs
    pids = {r.training_run_id for r in proj}
    assert c.tc.model_id in pids and all(p.startswith(f"{c.session_id}:") for p in pids), pids
    other = res(c.rest_other.list_training_runs(limit=1000))
    assert not {r.training_run_id for r in other.training_runs} & set(ids)


@check(
    "RestClient",
    "list_training_runs_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    _ = c.tc
    a = c.aw(c.rest.list_training_runs_async(limit=5, offset=1))
    b = res(c.rest.list_training_runs(limit=5, offset=1))
    assert a.cursor == b.cursor and [r.training_run_id for r in a.training_runs] == [
        r.training_run_id for r in b.training_runs
    ]


@check(
    "RestClient",
    "list_user_checkpoints",
    """paging across all the caller's runs, newest first: cursors consistent, each checkpoint
    once, the total equal to the per-run listings' sum; another tenant sees none""",
)
def _(c: Ctx):
    _ = c.tc
    cks, total = page_all(
        lambda lim, off: res(c.rest.list_user_checkpoints(limit=lim, offset=off)), "checkpoints"
    )
    paths = [ck.tinker_path for ck in cks]
    assert len(paths) == total == len(set(paths)), (total, paths)
    assert {c.state_path, c.sampler_path} <= set(paths)
    times = [utc(ck.time) for ck in cks]
    assert times == sorted(times, reverse=True), "not newest first"
    runs = {parse(p).training_run_id for p in paths}
    assert sum(len(res(c.rest.list_checkpoints(r)).checkpoints) for r in runs) == total
    assert not {
        ck.tinker_path for ck in res(c.rest_other.list_user_checkpoints(limit=1000)).checkpoints
    } & set(paths)


@check(
    "RestClient",
    "list_user_checkpoints_async",
    """awaited: equal to the sync call""",
)
def _(c: Ctx):
    _ = c.tc
    assert c.aw(c.rest.list_user_checkpoints_async(limit=4, offset=1)) == res(
        c.rest.list_user_checkpoints(limit=4, offset=1)
    )


def check_publish(c: Ctx, path: str, publish, unpublish) -> None:
    assert listed(c, path).public is False
    assert publish() is None
    assert listed(c, path).public is True
    assert unpublish() is None
    assert listed(c, path).public is False


@check(
    "RestClient",
    "publish_checkpoint_from_tinker_path",
    """flips the listed checkpoint's `public` to true (and unpublish back); another tenant's
    publish is a 404""",
)
def _(c: Ctx):
    path = res(c.scratch.save_state("pub")).path
    not_found(lambda: res(c.rest_other.publish_checkpoint_from_tinker_path(path)))
    check_publish(
        c,
        path,
        lambda: res(c.rest.publish_checkpoint_from_tinker_path(path)),
        lambda: res(c.rest.unpublish_checkpoint_from_tinker_path(path)),
    )


@check(
    "RestClient",
    "publish_checkpoint_from_tinker_path_async",
    """awaited: `public` becomes true""",
)
def _(c: Ctx):
    path = res(c.scratch.save_weights_for_sampler("pub-async")).path
    check_publish(
        c,
        path,
        lambda: c.aw(c.rest.publish_checkpoint_from_tinker_path_async(path)),
        lambda: res(c.rest.unpublish_checkpoint_from_tinker_path(path)),
    )


@check(
    "RestClient",
    "search_sessions",
    """by display name, newest first, one per page with `next_cursor` until exhausted; with a
    status filter (client-finished: success) only the closed session; each summary has id,
    owner, project, user_metadata, created_at""",
)
def _(c: Ctx):
    _ = c.tc
    other = c.new_service_client(
        display_name=f"surface-{c.tag} other", user_metadata={"who": "other"}, project_id="proj-other"
    )
    res(other.create_lora_training_client(TINY, rank=4))
    osid = other.holder.get_session_id()
    res(other.close("success"))
    p1 = search(c, display_name=f"surface-{c.tag}", limit=1)
    assert [s.session_id for s in p1.sessions] == [osid] and p1.next_cursor is not None, p1
    p2 = search(c, display_name=f"surface-{c.tag}", limit=1, cursor=p1.next_cursor)
    assert [s.session_id for s in p2.sessions] == [c.session_id], p2
    if p2.next_cursor is not None:
        assert search(c, display_name=f"surface-{c.tag}", limit=1, cursor=p2.next_cursor).sessions == []
    o, m = p1.sessions[0], p2.sessions[0]
    assert (o.project_id, o.user_metadata, o.display_name) == (
        "proj-other",
        {"who": "other"},
        f"surface-{c.tag} other",
    )
    assert (m.project_id, m.user_metadata, m.display_name) == (
        "proj-surface",
        {"suite": "surface"},
        c.display_name,
    )
    assert o.owner and m.owner == o.owner and utc(o.created_at) >= utc(m.created_at), (o, m)
    assert o.status is not None and o.status.type == "client_finished", o.status
    done = search(
        c,
        display_name=f"surface-{c.tag}",
        statuses=[types.ClientFinishedSessionStatusQuery(reasons=["success"])],
    )
    assert [s.session_id for s in done.sessions] == [osid], done


@check(
    "RestClient",
    "set_checkpoint_ttl_from_tinker_path",
    """sets the listed `expires_at` to now + ttl, clears it with None; an out-of-range ttl is
    refused; another tenant gets 404""",
)
def _(c: Ctx):
    path = res(c.scratch.save_state("ttl")).path
    assert listed(c, path).expires_at is None
    assert res(c.rest.set_checkpoint_ttl_from_tinker_path(path, 7200)) is None
    near_now(listed(c, path).expires_at, 7200, what="expires_at")
    assert res(c.rest.set_checkpoint_ttl_from_tinker_path(path, None)) is None
    assert listed(c, path).expires_at is None
    raises(lambda: res(c.rest.set_checkpoint_ttl_from_tinker_path(path, 10)), tinker.APIStatusError)
    not_found(lambda: res(c.rest_other.set_checkpoint_ttl_from_tinker_path(path, 7200)))


@check(
    "RestClient",
    "set_checkpoint_ttl_from_tinker_path_async",
    """awaited: the listed `expires_at` becomes now + ttl""",
)
def _(c: Ctx):
    path = res(c.scratch.save_weights_for_sampler("ttl-async")).path
    assert c.aw(c.rest.set_checkpoint_ttl_from_tinker_path_async(path, 86400)) is None
    near_now(listed(c, path).expires_at, 86400, what="expires_at")


@check(
    "RestClient",
    "unpublish_checkpoint_from_tinker_path",
    """flips a published checkpoint's `public` back to false; another tenant gets 404""",
)
def _(c: Ctx):
    path = res(c.scratch.save_weights_for_sampler("unpub")).path
    res(c.rest.publish_checkpoint_from_tinker_path(path))
    not_found(lambda: res(c.rest_other.unpublish_checkpoint_from_tinker_path(path)))
    assert listed(c, path).public is True
    assert res(c.rest.unpublish_checkpoint_from_tinker_path(path)) is None
    assert listed(c, path).public is False


@check(
    "RestClient",
    "unpublish_checkpoint_from_tinker_path_async",
    """awaited: `public` back to false""",
)
def _(c: Ctx):
    path = res(c.scratch.save_state("unpub-async")).path
    res(c.rest.publish_checkpoint_from_tinker_path(path))
    assert listed(c, path).public is True
    assert c.aw(c.rest.unpublish_checkpoint_from_tinker_path_async(path)) is None
    assert listed(c, path).public is False
