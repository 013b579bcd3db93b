"""Fuzzing: schemathesis against the live ``/openapi.json``, hypothesis protobuf bodies against
``forward_backward``, then a known-good client. Pass/fail: 0 × 5xx and the good client served.

Method.

1. One ``openrl-service serve`` child (the tiny model, a temporary data dir, a free loopback port;
   ``openrl_jupyter.local.start_service``) with two tenants, ``fuzz`` and ``good``, and the fuzz
   profile of ``SERVICE_ENV``: ``retrieve_future`` holds 0.5 s (``OPENRL_LONG_POLL_S``), a gap a
   generated ``seq_id`` left never expires (see the known bug noted there), no cap on runs or live
   sessions, and
   small sampling limits (the schema publishes them, so generated bodies stay within them and the
   largest one is still quick on a CPU).
2. schemathesis (``st run``, the CLI in this venv) on the live ``/openapi.json`` with the fuzz key
   and a fixed seed, in three passes: the stateless phases (examples, coverage, fuzzing; positive and
   negative bodies, ``--examples`` per operation; ``--short`` leaves coverage out), then the stateful
   phase twice (positive bodies, ``--stateful-examples`` scenarios of up to ``--stateful-steps``
   calls), once over the Tinker and REST routes and once over the notebook API and REST, each
   without the routes that neither make nor take an id. The request bodies are described exactly
   and the links say which reply feeds which request (``openrl_service/api/schemas.py``), so
   scenarios walk real sessions, runs, samplers and checkpoints. The one check is
   ``not_a_server_error``; every request is read back from schemathesis' HAR reports and counted
   per operation: requests, 2xx, 4xx, 5xx. ``GET /openrl/v1/events`` (an endless SSE stream) is
   left out; ``bench/fuzz_hooks.py`` sends generated protobuf bodies as bytes.
3. Hypothesis-generated protobuf ``ForwardBackwardRequest`` bodies (``--proto-examples``) against
   ``/api/v1/forward_backward`` on two runs it created: well-formed requests at the run's next
   ``seq_id`` with at most one flaw (these train), messages with random fields (any ``seq_id``;
   token ids in or out of the vocabulary; loss inputs of any shape, dtype and encoding; any loss and
   config), byte-mutated serialisations and raw random bytes. Every accepted request at the run's
   next ``seq_id`` has its future retrieved (one with a random ``seq_id`` waits for the gap before it;
   it is counted as parked): an error result of category ``server`` counts as a failure like a 5xx.
4. The known-good client, as the ``good`` tenant: ``tests/_support/tinker_conformance.py`` (the
   unmodified Tinker SDK: create, forward_backward, optim_step, sample, save/load, REST listing)
   and a notebook-API round (create a run, sample, train_step on the samples, checkpoint).

Prints a table (per operation: requests, 2xx, 4xx, 5xx) and ends with one line ``fuzz: requests=…
ok_2xx=… http_5xx=… server_errors=… ops_with_2xx=…/… good_client=… wall_s=…``; writes
``bench/results/fuzz.json``; exits 1 on any 5xx, a future failed as ``server``, or a good-client
failure. The HAR reports and the service's log are kept beside the JSON.

    python bench/fuzz.py [--short] [--examples 40] [--stateful-examples 300] [--stateful-steps 12]
                         [--proto-examples 600] [--seed 11] [--out bench/results/fuzz.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
STREAMS = ("native_events",)  # endless responses: not fuzzable by request/response
# Routes that neither make nor take an id (the hub mirror, health, bootstrap flags, listings).
STATELESS_ROUTES = (
    r"^(info|tree|hub_|healthz|readyz|metrics|native_list_runs|rest_list_"
    r"|tinker_(api_healthz|client_config|dynamic_config|telemetry|capabilities))"
)
# The fuzzed service: short waits, so generated requests do not idle; no cap on runs or live
# sessions (generated sessions are never finished: thousands stay live); small sampling limits, so the largest valid request the
# schema allows (it publishes these limits) is quick on a CPU.
SERVICE_ENV = {
    "OPENRL_LONG_POLL_S": "0.5",
    # Gaps expire quickly, so far-ahead seq_ids (10**12 once took all memory: the scheduler kept
    # every skipped id; it keeps ranges now) are exercised too.
    "OPENRL_SEQ_GAP_TIMEOUT_S": "2",
    "OPENRL_MAX_RUNS_PER_TENANT": "1000000",
    "OPENRL_MAX_SESSIONS_PER_TENANT": "1000000",
    "OPENRL_MAX_TOKENS": "16",
    "OPENRL_MAX_NUM_SAMPLES": "4",
    "OPENRL_MAX_DATUMS": "8",
}


class FuzzError(RuntimeError):
    pass


# -- schemathesis ------------------------------------------------------------------------------
def operation_matcher(spec: dict):
    """(method, path) → operation id, matching concrete paths against the schema's templates."""
    table = []
    for path, methods in spec["paths"].items():
        parts = re.split(r"(\{[^}]+\})", path)
        rx = "".join(
            ("(.+)" if p.endswith(":path}") or p == "{filename}" or p == "{sub}" else "([^/]+)")
            if p.startswith("{")
            else re.escape(p)
            for p in parts
        )
        static = sum(len(p) for p in parts if not p.startswith("{"))
        for method, op in methods.items():
            table.append((static, method.upper(), re.compile(f"^{rx}$"), op.get("operationId", path)))
    table.sort(key=lambda t: -t[0])  # the most specific template first

    def match(method: str, path: str) -> str:
        for _, m, rx, op in table:
            if m == method and rx.match(path):
                return op
        return "(other methods and paths)"  # schemathesis also tries methods a route lacks

    return match


def run_schemathesis(url: str, key: str, args: argparse.Namespace, work: Path) -> tuple[list[dict], str]:
    """``st run`` against the live schema, twice: the stateless phases (examples, coverage, fuzzing;
    ``--examples`` cases per operation), then the stateful phase (``--stateful-examples`` scenarios of
    up to ``--stateful-steps`` linked calls). The HAR entries both recorded and their output tails."""
    entries, tails = [], []
    stateless = "examples,fuzzing" if args.short else "examples,coverage,fuzzing"
    passes = (
        ("stateless", stateless, args.examples, "all", None),
        # positive bodies only: a scenario goes deeper while each step's reply feeds the next one.
        # Two passes, the Tinker API's chains and the notebook API's, so that neither starves the other.
        ("stateful-tinker", "stateful", args.stateful_examples, "positive", r"^native_"),
        ("stateful-native", "stateful", args.stateful_examples, "positive", r"^tinker_"),
    )
    for name, phases, examples, mode, skip in passes:
        har = work / f"{name}.har"
        config = work / "schemathesis.toml"
        # the schema's own links, not links guessed from names
        config.write_text(
            f"[phases.stateful]\nmax-steps = {args.stateful_steps}\n"
            "[phases.stateful.inference]\nalgorithms = []\n"
        )
        argv = [str(Path(sys.executable).with_name("st")), "--config-file", str(config), "run"]
        argv += [f"{url}/openapi.json", "--header", f"X-API-Key: {key}", "--checks", "not_a_server_error"]
        argv += [
            "--phases",
            phases,
            "--max-examples",
            str(examples),
            "--mode",
            mode,
            "--seed",
            str(args.seed),
        ]
        argv += ["--workers", "1", "--no-shrink", "--request-timeout", "60", "--generation-database", "none"]
        argv += ["--continue-on-failure", "--suppress-health-check", "all", "--no-color"]
        argv += ["--report", "har", "--report-har-path", str(har)]
        for op in STREAMS:
            argv += ["--exclude-operation-id", op]
        if skip:  # scenarios spend their steps on the routes that create and use state
            argv += ["--exclude-operation-id-regex", f"{STATELESS_ROUTES}|{skip}"]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks", "PYTHONPATH": str(ROOT / "bench")}
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout_s, cwd=work, env=env)
        if not har.exists():
            raise FuzzError(
                f"schemathesis wrote no HAR report (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
            )
        shutil.copyfile(har, Path(args.out).with_suffix(f".{name}.har"))  # every request and reply
        entries += json.loads(har.read_text())["log"]["entries"]
        tails.append(f"--- {name} ---\n{proc.stdout[-3000:]}{proc.stderr[-1500:]}")
    return entries, "\n".join(tails)


def count_har(entries: list[dict], match, base: str) -> dict[str, Counter]:
    counts: dict[str, Counter] = defaultdict(Counter)
    for e in entries:
        req, status = e["request"], int(e["response"]["status"])
        path = req["url"][len(base) :].split("?", 1)[0] if req["url"].startswith(base) else req["url"]
        bump(counts[match(req["method"].upper(), path)], status)
    return counts


def bump(c: Counter, status: int) -> None:
    c["requests"] += 1
    c[f"{status // 100}xx" if status else "no_response"] += 1
    c[f"status_{status}"] += 1


# -- protobuf bodies ---------------------------------------------------------------------------
def proto_strategies(model_ids: list[str], vocab: int, context: int):
    """Hypothesis strategies of ForwardBackwardRequest bodies: (bytes, model_id or None, uses next seq)."""
    import numpy as np
    from hypothesis import strategies as st

    from openrl_service.api import proto

    dtypes = st.sampled_from([0, 1, 2, 3, 4, 9])
    token = st.one_of(st.integers(0, vocab - 1), st.integers(-(2**31), 2**31 - 1))
    losses = st.sampled_from(
        ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "", "custom", "nope"]
    )
    input_names = st.sampled_from(
        ["target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask", "mask", ""]
    )
    numbers = st.floats(allow_nan=True, allow_infinity=True, width=64)

    @st.composite
    def tensor(draw, n: int):
        t = proto.MESSAGES["Tensor"]()
        dtype = draw(dtypes)
        t.dtype = dtype
        shape_kind = draw(st.sampled_from(["n", "nk", "none", "random"]))
        k = draw(st.integers(1, 4))
        shape = {
            "n": [n],
            "nk": [n, k],
            "none": [],
            "random": draw(st.lists(st.integers(-2, 70), max_size=3)),
        }[shape_kind]
        t.shape.extend(shape)
        np_dtype = {1: np.float32, 2: np.int64, 3: np.int32}.get(dtype, np.float32)
        count = int(np.prod([s for s in shape if s > 0])) if shape else n
        count = min(count, 8192)
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))  # bulk values: fast to draw
        if draw(st.booleans()) and len(shape) == 2:
            csr = t.sparse_csr
            rows = max(0, shape[0])
            nnz = draw(st.integers(0, 8))
            csr.values = np.zeros(nnz, dtype=np_dtype).tobytes()
            crow = sorted(draw(st.lists(st.integers(0, nnz), min_size=rows + 1, max_size=rows + 1)))
            if crow:
                crow[0], crow[-1] = 0, nnz
            csr.crow_indices = np.asarray(crow, dtype=np.int64).tobytes()
            csr.col_indices = np.asarray(
                draw(st.lists(st.integers(-1, 6), min_size=nnz, max_size=nnz)), dtype=np.int64
            ).tobytes()
        elif draw(st.booleans()):
            if np_dtype is np.float32:
                vals = rng.uniform(-3, 3, count).astype(np.float32)
                if count and draw(st.booleans()):
                    vals[rng.integers(count)] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 3e38]))
            else:
                vals = rng.integers(0, vocab + draw(st.sampled_from([0, 0, 1000])), count).astype(np_dtype)
            t.dense = vals.tobytes()
        else:
            t.dense = draw(st.binary(max_size=64))
        return t

    @st.composite
    def datum(draw, d):
        n = draw(st.integers(0, min(24, context)))
        tokens = draw(st.lists(token, min_size=n, max_size=n))
        chunk = d.model_input.add()
        kind = draw(st.sampled_from(["text", "text", "text", "image", "empty", "odd"]))
        if kind == "text":
            chunk.encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        elif kind == "image":
            chunk.image.data = draw(st.binary(max_size=16))
        elif kind == "odd":
            chunk.encoded_text.tokens = draw(st.binary(max_size=15))
        names = draw(st.lists(input_names, max_size=4, unique=True))
        for name in names:
            d.loss_fn_inputs[name].CopyFrom(draw(tensor(n)))

    @st.composite
    def request(draw):
        msg = proto.ForwardBackwardRequest()
        model_id = draw(st.sampled_from([*model_ids, None]))
        msg.model_id = model_id if model_id is not None else draw(st.text(max_size=12))
        next_seq = draw(st.booleans())
        if not next_seq:
            msg.seq_id = draw(st.integers(-(2**31), 2**31 - 1))
        for _ in range(draw(st.integers(0, 3))):
            draw(datum(msg.data.add()))
        msg.loss_fn = draw(losses)
        for name in draw(
            st.lists(st.sampled_from(["clip_low_threshold", "clip_high_threshold", "beta", "x"]), max_size=2)
        ):
            if draw(st.booleans()):
                msg.loss_fn_config[name] = draw(numbers)
            elif draw(st.booleans()):
                msg.loss_fn_config_v2[name].number = draw(numbers)
            else:
                msg.loss_fn_config_v2[name].text = draw(st.text(max_size=4))
        msg.forward_only = draw(st.booleans())
        return msg, (model_id if next_seq else None)

    @st.composite
    def good_request(draw):
        """A request the service accepts (a real loss over in-vocabulary tokens) at the run's next
        seq_id, with at most one field made wrong: these reach the trainer."""
        msg = proto.ForwardBackwardRequest(model_id=draw(st.sampled_from(model_ids)))
        msg.loss_fn = draw(st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        for _ in range(draw(st.integers(1, 3))):
            n = draw(st.integers(1, min(32, context)))
            d = msg.data.add()
            d.model_input.add().encoded_text.tokens = rng.integers(0, vocab, n).astype(np.int32).tobytes()
            inputs = {"target_tokens": rng.integers(0, vocab, n).astype(np.int64)}
            if msg.loss_fn == "cross_entropy":
                inputs["weights"] = rng.uniform(0, 1, n).astype(np.float32)
            else:
                inputs["logprobs"] = rng.uniform(-5, 0, n).astype(np.float32)
                inputs["advantages"] = rng.normal(0, 1, n).astype(np.float32)
            for name, arr in inputs.items():
                t = d.loss_fn_inputs[name]
                t.dtype = proto.DTYPE_INT64 if arr.dtype == np.int64 else proto.DTYPE_FLOAT32
                t.dense = arr.tobytes()
                t.shape.extend(arr.shape)
        flaw = draw(st.sampled_from([None, None, None, "token", "nan", "extra", "config", "forward_only"]))
        d = msg.data[0]
        if flaw == "token":
            d.model_input[0].encoded_text.tokens = np.asarray([vocab + 5], dtype=np.int32).tobytes()
        elif flaw == "nan":
            name = "weights" if msg.loss_fn == "cross_entropy" else "advantages"
            d.loss_fn_inputs[name].dense = np.full(
                len(d.loss_fn_inputs[name].dense) // 4, np.nan, np.float32
            ).tobytes()
        elif flaw == "extra":
            d.loss_fn_inputs["mask"].CopyFrom(d.loss_fn_inputs["target_tokens"])
        elif flaw == "config":
            msg.loss_fn_config["clip_low_threshold"] = draw(numbers)
        elif flaw == "forward_only":
            msg.forward_only = True
        return msg, msg.model_id

    @st.composite
    def body(draw):
        kind = draw(st.sampled_from(["good", "good", "message", "message", "mutated", "raw"]))
        if kind == "raw":
            return draw(st.binary(max_size=256)), None, None
        if kind == "good":
            msg, seq_model = draw(good_request())
            return None, msg, seq_model
        msg, seq_model = draw(request())
        if kind == "mutated":
            data = bytearray(msg.SerializeToString())
            for _ in range(draw(st.integers(1, 4))):
                if data:
                    i = draw(st.integers(0, len(data) - 1))
                    data[i] = draw(st.integers(0, 255))
            if data and draw(st.booleans()):
                data = data[: draw(st.integers(0, len(data)))]
            return bytes(data), None, None
        return None, msg, seq_model

    return body()


def run_protobuf(url: str, key: str, args: argparse.Namespace) -> tuple[Counter, Counter, Counter]:
    """POST generated bodies to forward_backward; retrieve every accepted future.
    (HTTP status counts of the posts, of the retrieves, future outcome counts)."""
    import httpx
    from hypothesis import HealthCheck, given, seed, settings

    from openrl_service.api.codec import PROTO

    http = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60)
    caps = http.get("/api/v1/get_server_capabilities").json()["supported_models"][0]
    vocab = int(caps.get("vocab_size") or 256)
    context = int(caps.get("max_context_length") or caps.get("context_length") or 128)
    created = http.post("/api/v1/create_session", json={})
    if created.status_code != 200:  # e.g. a quota the generated requests used up
        raise FuzzError(
            f"protobuf phase: create_session answered {created.status_code}: {created.text[:300]}"
        )
    sid = created.json()["session_id"]
    next_seq: dict[str, int] = {}
    for i in range(2):
        rep = http.post(
            "/api/v1/create_model",
            json={"session_id": sid, "model_seq_id": i, "lora_config": {"rank": 4}},
        ).json()
        wait_future(http, rep["request_id"])
        next_seq[rep["model_id"]] = 1
    statuses: Counter = Counter()
    retrieves: Counter = Counter()  # the retrieve_future calls that fetched their results
    outcomes: Counter = Counter()
    pending: list[str] = []
    parked = [0]

    @settings(
        max_examples=args.proto_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )
    @seed(args.seed)
    @given(proto_strategies(list(next_seq), vocab, context))
    def one(drawn):
        raw, msg, seq_model = drawn
        if msg is not None:
            if seq_model is not None:
                msg.seq_id = next_seq[seq_model]
            raw = msg.SerializeToString()
        r = http.post("/api/v1/forward_backward", content=raw, headers={"Content-Type": PROTO})
        bump(statuses, r.status_code)
        if r.status_code == 200:
            if seq_model is None:  # took a slot far ahead: it waits for a gap that never closes
                parked[0] += 1
                return
            next_seq[seq_model] += 1
            pending.append(r.json()["request_id"])
        if len(pending) >= 16:
            drain(http, pending, outcomes, retrieves)

    one()
    drain(http, pending, outcomes, retrieves)
    http.close()
    outcomes["parked_behind_a_gap"] = parked[0]
    return statuses, retrieves, outcomes


def wait_future(http, request_id: str, timeout_s: float = 120, statuses: Counter | None = None) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rep = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if statuses is not None:
            bump(statuses, rep.status_code)
        if rep.status_code >= 500:
            return {"error": f"HTTP {rep.status_code}", "category": "server"}
        out = rep.json()
        if out.get("type") != "try_again":
            return out
    return {"error": "no result in time", "category": "timeout"}


def drain(http, pending: list[str], outcomes: Counter, statuses: Counter) -> None:
    for rid in pending:
        out = wait_future(http, rid, statuses=statuses)
        outcomes["error:" + str(out.get("category")) if "error" in out else "result"] += 1
        if out.get("category") == "server":
            print(f"  future {rid} failed on the server: {out.get('error')}", file=sys.stderr)
    pending.clear()


# -- the known-good client ---------------------------------------------------------------------
def good_client(url: str, key: str) -> dict:
    """The unmodified Tinker SDK's conformance script, then a notebook-API round."""
    import httpx

    env = {**os.environ, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
    script = ROOT / "tests" / "_support" / "tinker_conformance.py"
    proc = subprocess.run(
        [sys.executable, str(script), url, "openrl/tiny"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    sdk_ok = proc.returncode == 0 and proc.stdout.strip().endswith("PASS")
    native_ok, why = False, ""
    try:
        with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120) as http:
            run = http.post("/openrl/v1/runs", json={"name": "good-client", "rank": 4})
            run.raise_for_status()
            run_id = run.json()["run_id"]
            smp = http.post(
                f"/openrl/v1/runs/{run_id}/sample",
                json={"prompts": ["Say hi:"], "num_samples": 2, "max_tokens": 6, "seed": 1},
            )
            smp.raise_for_status()
            samples = smp.json()["samples"]
            step = http.post(
                f"/openrl/v1/runs/{run_id}/train_step",
                json={
                    "samples": [
                        {"sample_id": s["sample_id"], "advantage": a}
                        for s, a in zip(samples, (1.0, -1.0), strict=True)
                    ]
                },
            )
            step.raise_for_status()
            ck = http.post(f"/openrl/v1/runs/{run_id}/checkpoints", json={"name": "good-client"})
            ck.raise_for_status()
            native_ok = step.json()["step"] == 1 and ck.json()["path"].startswith("tinker://")
    except (httpx.HTTPError, KeyError, ValueError) as e:
        why = repr(e)
    return {
        "sdk_ok": sdk_ok,
        "sdk_tail": (proc.stdout + proc.stderr)[-1500:],
        "native_ok": native_ok,
        "native_error": why,
        "ok": sdk_ok and native_ok,
    }


# -- the run -----------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    import httpx

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from openrl_jupyter.local import start_service

    key = "tml-fuzz-" + secrets.token_hex(16)
    good_key = "tml-good-" + secrets.token_hex(16)  # the good client is another tenant, as a neighbour is
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="openrl-fuzz-") as tmp:
        work = Path(tmp)
        keys = {"OPENRL_API_KEYS": f"fuzz:{key},good:{good_key}"}
        local = start_service(data_dir=work / "service", env={**SERVICE_ENV, **keys})
        try:
            spec = httpx.get(f"{local.url}/openapi.json", headers={"X-API-Key": key}).json()
            match = operation_matcher(spec)
            t_st = time.time()
            entries, st_tail = run_schemathesis(local.url, key, args, work)
            if local.process.poll() is not None:
                raise FuzzError(
                    f"the service died during the schemathesis passes (exit {local.process.returncode})"
                )
            st_wall = time.time() - t_st
            per_op = count_har(entries, match, local.url)
            t_pb = time.time()
            pb_status, pb_retrieves, pb_outcomes = run_protobuf(local.url, key, args)
            pb_wall = time.time() - t_pb
            good = good_client(local.url, good_key)
            alive = httpx.get(f"{local.url}/readyz").status_code == 200
        except BaseException:
            print(local.log_tail(), file=sys.stderr)
            raise
        finally:
            local.stop(15)
        service_log = (work / "service" / "service.log").read_text(errors="replace")
        Path(args.out).with_suffix(".service.log").write_text(service_log)
    tracebacks = service_log.count("Traceback (most recent call last)")
    all_ops = sorted(
        op.get("operationId", p)
        for p, ms in spec["paths"].items()
        for op in ms.values()
        if op.get("operationId") not in STREAMS
    )
    per_op["tinker_forward_backward (protobuf)"] = pb_status
    per_op["tinker_retrieve_future (protobuf)"] = pb_retrieves
    return {
        "seed": args.seed,
        "examples_per_operation": args.examples,
        "proto_examples": args.proto_examples,
        "schemathesis": {"requests": len(entries), "wall_s": round(st_wall, 1), "tail": st_tail},
        "protobuf": {"statuses": dict(pb_status), "futures": dict(pb_outcomes), "wall_s": round(pb_wall, 1)},
        "operations": {op: dict(c) for op, c in sorted(per_op.items())},
        "operations_total": len(all_ops),
        "operations_with_2xx": sorted(
            {op.removesuffix(" (protobuf)") for op, c in per_op.items() if c["2xx"]}
        ),
        "operations_never_2xx": sorted(set(all_ops) - {op for op, c in per_op.items() if c["2xx"]}),
        "requests": sum(c["requests"] for c in per_op.values()),
        "ok_2xx": sum(c["2xx"] for c in per_op.values()),
        "http_5xx": sum(c["5xx"] for c in per_op.values()),
        "server_errors": pb_outcomes.get("error:server", 0),
        "service_tracebacks": tracebacks,
        "good_client": good,
        "alive_after": alive,
        "wall_s": round(time.time() - t0, 1),
    }


def report(result: dict) -> str:
    rows = [f"{'operation':52} {'requests':>8} {'2xx':>6} {'4xx':>6} {'5xx':>5}"]
    for op, c in result["operations"].items():
        rows.append(
            f"{op:52} {c.get('requests', 0):>8} {c.get('2xx', 0):>6} {c.get('4xx', 0):>6} {c.get('5xx', 0):>5}"
        )
    rows.append(
        f"{'total':52} {result['requests']:>8} {result['ok_2xx']:>6} "
        f"{sum(c.get('4xx', 0) for c in result['operations'].values()):>6} {result['http_5xx']:>5}"
    )
    pb = result["protobuf"]
    rows.append(f"protobuf futures: {pb['futures']}")
    rows.append(f"operations never answered 2xx: {', '.join(result['operations_never_2xx']) or 'none'}")
    g = result["good_client"]
    rows.append(f"good client: Tinker SDK conformance {g['sdk_ok']}, notebook API round {g['native_ok']}")
    if not g["ok"]:
        rows.append(g["sdk_tail"] + g["native_error"])
    return "\n".join(rows)


def summary_line(result: dict) -> str:
    return (
        f"fuzz: requests={result['requests']} ok_2xx={result['ok_2xx']} http_5xx={result['http_5xx']} "
        f"server_errors={result['server_errors']} "
        f"ops_with_2xx={len(result['operations_with_2xx'])}/{result['operations_total']} "
        f"good_client={result['good_client']['ok']} wall_s={result['wall_s']:.0f}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="the test's mode: few examples, same seed")
    p.add_argument(
        "--examples", type=int, default=None, help="schemathesis cases per operation (40; short: 4)"
    )
    p.add_argument(
        "--stateful-steps", type=int, default=None, help="steps per stateful scenario (12; short: 8)"
    )
    p.add_argument("--stateful-examples", type=int, default=None, help="stateful scenarios (300; short: 40)")
    p.add_argument("--proto-examples", type=int, default=None, help="protobuf bodies (600; short: 60)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--timeout-s", type=float, default=3600.0, help="for the schemathesis run")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "fuzz.json"))
    args = p.parse_args(argv)
    for name, full, short in (
        ("examples", 40, 4),
        ("stateful_examples", 300, 40),
        ("stateful_steps", 12, 8),
        ("proto_examples", 600, 60),
    ):
        if getattr(args, name) is None:
            setattr(args, name, short if args.short else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")  # the service is stopped on the way out

    signal.signal(signal.SIGTERM, on_term)
    try:
        result = run(args)
    except FuzzError as e:
        print(f"fuzz: failed: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    print(f"(written to {out})")
    print(summary_line(result))
    bad = result["http_5xx"] or result["server_errors"] or not result["good_client"]["ok"]
    return 1 if bad or not result["alive_after"] else 0


if __name__ == "__main__":
    sys.exit(main())
