"""Load: 16 concurrent users of the unmodified Tinker SDK against one service, and its memory.

Measured: ops/s over the run, each future's latency as the client sees it (submit → ``result()``,
p50/p99 per kind), the HTTP statuses on the wire (5xx, 429 and connection errors), the service's
peak RSS and its RSS growth per 1,000 ops (the least-squares slope of RSS against ops done over the
second half of the run), with RSS at 25/50/75/100 % of the ops and its mean over each tenth: memory
should level off. Completed results are held for ``OPENRL_FUTURE_TTL_S`` (1 h), so within a run
shorter than that they are part of the growth; ``--service-env OPENRL_FUTURE_TTL_S=60`` shows the
level the service settles at once results expire.

Method.

1. One ``openrl-service serve`` child (the tiny model, a temporary data dir, a free loopback port, a
   fresh key; ``openrl_jupyter.local.start_service``). A thread here reads its ``VmRSS`` and
   ``VmHWM`` from ``/proc/<pid>/status`` every 0.2 s. The service is stopped at the end, also on
   Ctrl-C or a failure, as are the clients; the data dir (every run, checkpoint and sampler) goes
   with it.
2. ``--clients`` users (16), each its own process (this script with ``--client``) running the
   unmodified Tinker SDK: the SDK keeps ONE event-loop thread per process
   (``InternalClientHolderThreadSingleton``), so users as threads would all share that loop and the
   bench would measure it; processes are 16 independent users, as on 16 notebooks. The mix
   (``--mix sft,rl,sample``, default 6,6,4):

   - ``sft``: ``forward_backward(cross_entropy)`` + ``optim_step`` per step (submitted back to back);
   - ``rl``: ``save_weights_and_get_sampling_client`` → ``sample`` (``--prompts`` prompts ×
     ``--group``) → the letter-fraction reward → group-relative advantages →
     ``forward_backward(importance_sampling)`` + ``optim_step``;
   - ``sample``: a base-model ``SamplingClient``, ``--prompts`` ``sample`` calls per step.

   Each creates its client, reports ready and waits for a common start, then runs ``--steps`` (50;
   ``--short``: 5) steps and closes its ServiceClient (which finishes its session).
3. On the wire: every client process wraps ``httpx.AsyncClient.send`` (observation only; the SDK
   is not changed) and records each request's path, status and, for ``retrieve_future``, the
   ``request_id`` and whether the answer was a result or ``try_again``. From that: no future lost
   (every ``request_id`` a submit returned got a result) or duplicated (none got two), and the 5xx
   count (the SDK retries 5xx silently, so only the wire shows them).
4. Each training run's ``optim_step`` metrics carry the run's step count (``step:max``): a run's
   steps must read 1..N in order.
5. After the load, one fresh client (an ``rl`` user, one step) must still be served.

Not a test of speed: it prints a table, writes ``bench/results/load.json`` and ends with one line
``load: clients=16 steps=50 ops=… ops_per_s=… p50_ms=… p99_ms=… http_5xx=… peak_rss_mb=…
growth_mb_per_1k_ops=… lost=… duplicated=… order_ok=… fresh_ok=…``. It exits 1 when a check of
3-5 fails (``tests/bench/test_load_bench.py`` runs ``--short`` and asserts them).

    python bench/load.py [--short] [--clients 16] [--steps 50] [--mix 6,6,4] [--prompts 2]
                         [--group 4] [--max-tokens 8] [--service-env NAME=VALUE ...]
                         [--out bench/results/load.json]
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from packing import BenchError, Clients, bench_main  # noqa: E402
from tinker_rl_letters import decode, letter_fraction, rl_datum  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ("Say hi:", "Name a colour:", "Count to three:", "A fruit:")
SFT_TEXTS = ("the cat sat on the mat", "a red apple", "one two three four", "hello there, world")
KINDS = ("sft", "rl", "sample")


# -- the client process ------------------------------------------------------------------------
def emit(msg: dict) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def record_wire(log: list[dict]) -> None:
    """Wrap ``httpx.AsyncClient.send`` so each request's path, status and (for retrieve_future) its
    request_id and answer land in ``log``. Observation only: the response is handed back unchanged."""
    import httpx

    send = httpx.AsyncClient.send

    async def recording_send(self, request, **kw):
        t0 = time.time()
        # "unfinished" until it returns: the report may be taken while a background call (the
        # SDK's session heartbeat) is still in flight
        entry = {"path": request.url.path, "t0": t0, "status": None, "error": "unfinished"}
        log.append(entry)
        try:
            response = await send(self, request, **kw)
        except BaseException as exc:  # also a cancelled request (the SDK cancels pending polls at close)
            entry.update(status=None, error=type(exc).__name__, t1=time.time())
            raise
        entry.pop("error")
        entry.update(status=response.status_code, t1=time.time())
        path = request.url.path
        if path.endswith("/retrieve_future"):
            try:
                entry["request_id"] = json.loads(request.content)["request_id"]
            except (ValueError, KeyError, TypeError):
                entry["request_id"] = None
        if response.status_code == 200 and not path.endswith(("/healthz", "/heartbeat")):
            await response.aread()  # cached: the SDK reads the same bytes afterwards
            ctype = response.headers.get("content-type", "")
            if ctype.startswith("application/json"):
                try:
                    body = response.json()
                except ValueError:
                    body = None
                if isinstance(body, dict):
                    if body.get("type") == "try_again":
                        entry["try_again"] = True
                    elif "request_id" in body and not path.endswith("/retrieve_future"):
                        entry["submitted"] = body["request_id"]
        return response

    httpx.AsyncClient.send = recording_send


def client_main(cfg: dict) -> int:
    """One user: set up, report ready, wait for the start, run the steps, report everything."""
    wire: list[dict] = []
    record_wire(wire)
    import tinker
    from tinker import types

    kind, steps, seed = cfg["kind"], cfg["steps"], cfg["seed"]
    prompts = [list(p.encode()) for p in PROMPTS[: cfg["prompts"]]]
    ops: list[dict] = []
    step_counts: list[int] = []

    def timed(name: str, submit):
        """Submit, then wait: the future's latency as the user sees it."""
        t0 = time.time()
        fut = submit()
        return name, t0, fut

    def wait(item) -> object:
        name, t0, fut = item
        try:
            out = fut.result()
        except Exception as exc:
            ops.append({"kind": name, "t0": t0, "t1": time.time(), "ok": False, "error": repr(exc)[:300]})
            raise
        ops.append({"kind": name, "t0": t0, "t1": time.time(), "ok": True})
        return out

    svc = tinker.ServiceClient(base_url=cfg["url"])
    base = cfg["base_model"]
    params = types.SamplingParams(max_tokens=cfg["max_tokens"], temperature=1.0)
    if kind == "sample":
        sampler = svc.create_sampling_client(base_model=base).result()
    else:
        tc = svc.create_lora_training_client(base_model=base, rank=cfg["rank"], seed=seed).result()
    adam = types.AdamParams(learning_rate=1e-3)
    emit({"ready": kind})
    line = sys.stdin.readline()
    if not line:
        return 1  # the parent went away before the start
    time.sleep(max(0.0, json.loads(line)["start"] - time.time()))
    t_start = time.time()

    def train(datums, loss_fn: str) -> None:
        fb = timed("forward_backward", lambda: tc.forward_backward(datums, loss_fn))
        ob = timed("optim_step", lambda: tc.optim_step(adam))
        wait(fb)
        step_counts.append(int(wait(ob).metrics["step:max"]))

    for _ in range(steps):
        if kind == "sft":
            datums = []
            for text in SFT_TEXTS:
                toks = list(text.encode())
                datums.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(toks[:-1]),
                        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)},
                    )
                )
            train(datums, "cross_entropy")
        elif kind == "sample":
            futs = [
                timed(
                    "sample", lambda p=p: sampler.sample(types.ModelInput.from_ints(p), cfg["group"], params)
                )
                for p in prompts
            ]
            for f in futs:
                wait(f)
        else:
            sc = wait(timed("save_weights_for_sampler", tc.save_weights_and_get_sampling_client))
            futs = [
                timed(
                    "sample",
                    lambda p=p, sc=sc: sc.sample(types.ModelInput.from_ints(p), cfg["group"], params),
                )
                for p in prompts
            ]
            datums = []
            for prompt, f in zip(prompts, futs, strict=True):
                seqs = wait(f).sequences
                rewards = [letter_fraction(decode(s.tokens)) for s in seqs]
                mean = statistics.fmean(rewards)
                # + 1e-3: a group of equal rewards still trains, so every RL step has datums
                datums += [
                    rl_datum(prompt, s.tokens, s.logprobs, r - mean + 1e-3)
                    for s, r in zip(seqs, rewards, strict=True)
                    if s.tokens
                ]
            train(datums, "importance_sampling")
    t_end = time.time()
    svc.close("success").result()
    # copies (dict() runs under the GIL): a call still in flight on the SDK's thread may update its entry
    wire_out = [dict(w) for w in list(wire) if w["path"] != "/api/v1/healthz"]
    emit(
        {"kind": kind, "t_start": t_start, "t_end": t_end, "ops": ops, "steps": step_counts, "wire": wire_out}
    )
    return 0


# -- the parent: service, memory, clients, figures --------------------------------------------
class RssSampler:
    """The service's ``VmRSS``/``VmHWM`` (kB → MB) from ``/proc/<pid>/status`` every ``period_s``."""

    def __init__(self, pid: int, period_s: float = 0.2):
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, float]] = []  # (time, RSS MB)
        self.hwm_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def read(self) -> tuple[float, float] | None:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
        except (OSError, KeyError, ValueError):
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            got = self.read()
            if got is not None:
                self.samples.append((time.time(), got[0]))
                self.hwm_mb = max(self.hwm_mb, got[1])
            self._stop.wait(self.period_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def at(self, t: float) -> float | None:
        """The last RSS sampled at or before ``t``."""
        before = [rss for ts, rss in self.samples if ts <= t]
        return before[-1] if before else None


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def futures_check(reports: list[dict]) -> dict:
    """From the wire: request_ids a submit returned, and how many results each got."""
    submitted: dict[str, int] = {}
    results: dict[str, int] = {}
    statuses: dict[str, int] = {}
    for rep in reports:
        for w in rep["wire"]:
            key = str(w["status"]) if w["status"] is not None else w.get("error", "error")
            statuses[key] = statuses.get(key, 0) + 1
            if "submitted" in w:
                submitted[w["submitted"]] = submitted.get(w["submitted"], 0) + 1
            if w.get("request_id") and w["status"] == 200 and not w.get("try_again"):
                results[w["request_id"]] = results.get(w["request_id"], 0) + 1
    lost = sorted(r for r in submitted if results.get(r, 0) == 0)
    dup = sorted(r for r, n in results.items() if n > 1)
    dup += sorted(r for r, n in submitted.items() if n > 1)  # one id handed out twice
    unknown = sorted(r for r in results if r not in submitted)
    http_5xx = sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500)
    return {
        "submitted": len(submitted),
        "results": sum(results.values()),
        "lost": len(lost),
        "duplicated": len(dup),
        "unknown": len(unknown),
        "lost_ids": lost[:10],
        "duplicated_ids": dup[:10],
        "http_statuses": dict(sorted(statuses.items())),
        "http_5xx": http_5xx,
        "http_429": statuses.get("429", 0),
        # connection-level failures (the SDK retries them): a keep-alive connection closed under a request
        "transport_errors": sum(n for s, n in statuses.items() if not s.isdigit()),
        "http_requests": sum(statuses.values()),
    }


def memory_figures(rss: RssSampler, done_times: list[float], t_begin: float) -> dict:
    """RSS before the load, at 25/50/75/100 % of the ops, its mean over each tenth of the ops, and
    its growth per 1,000 ops: the least-squares slope of RSS against ops done over the second half
    (after the first allocations), and end minus start over the whole run."""
    done = sorted(done_times)
    n = len(done)
    at = {pct: rss.at(done[max(0, round(n * pct / 100) - 1)]) for pct in (25, 50, 75, 100)} if n else {}
    before = rss.at(t_begin)
    tenths = []
    for i in range(10 if n else 0):
        lo, hi = (t_begin if i == 0 else done[i * n // 10 - 1]), done[(i + 1) * n // 10 - 1]
        xs = [v for t, v in rss.samples if lo <= t <= hi]
        tenths.append(statistics.fmean(xs) if xs else rss.at(hi))
    pts = [
        (bisect.bisect_right(done, t), v) for t, v in rss.samples if t_begin <= t <= (done[-1] if n else t)
    ]
    half = [(x, y) for x, y in pts if x >= n / 2]
    slope = None
    if len(half) >= 2 and len({x for x, _ in half}) >= 2:
        slope = statistics.linear_regression([x for x, _ in half], [y for _, y in half]).slope * 1000
    whole = None if before is None or at.get(100) is None or not n else (at[100] - before) / n * 1000
    return {
        "rss_before_mb": before,
        "rss_at_pct_mb": {str(k): v for k, v in at.items()},
        "rss_mean_by_tenth_mb": tenths,
        "peak_rss_mb": rss.hwm_mb,
        "growth_mb_per_1k_ops_second_half": slope,
        "growth_mb_per_1k_ops_whole": whole,
        "samples": len(rss.samples),
    }


def run(args: argparse.Namespace) -> dict:
    mix = [int(x) for x in args.mix.split(",")]
    if len(mix) != 3 or sum(mix) <= 0:
        raise BenchError("--mix: three counts sft,rl,sample")
    kinds = [k for k, m in zip(KINDS, mix, strict=True) for _ in range(m)]
    kinds = [kinds[i % len(kinds)] for i in range(args.clients)] if len(kinds) != args.clients else kinds
    key = "tml-load-" + secrets.token_hex(16)
    t_wall = time.time()
    from openrl_jupyter.local import start_service

    with tempfile.TemporaryDirectory(prefix="openrl-load-") as tmp:
        try:
            env = dict(kv.split("=", 1) for kv in args.service_env)
            local = start_service(data_dir=Path(tmp) / "service", api_key=key, env=env)
        except Exception as exc:  # noqa: BLE001 - the bench reports it as its own error
            raise BenchError(str(exc)) from None
        clients = Clients(Path(__file__).resolve(), env={"TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"})
        rss = RssSampler(local.process.pid)
        rss.start()
        try:
            import httpx

            caps = httpx.get(f"{local.url}/api/v1/get_server_capabilities", headers={"X-API-Key": key}).json()
            base = caps["supported_models"][0]["model_name"]
            common = {"url": local.url, "base_model": base, "steps": args.steps, "rank": 4}
            common |= {"prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens}
            procs = [clients.spawn({**common, "kind": k, "seed": i}) for i, k in enumerate(kinds)]
            clients.collect(procs, "ready", timeout_s=600)
            print(f"{len(procs)} clients ready after {time.time() - t_wall:.1f} s; go", flush=True)
            t_begin = clients.start(procs)
            reports = clients.collect(procs, "ops", timeout_s=args.timeout_s)
            clients.reap(procs)
            t_done = time.time()
            fresh = clients.spawn({**common, "kind": "rl", "seed": 999, "steps": 1})
            clients.collect([fresh], "ready", timeout_s=300)
            clients.start([fresh], delay_s=0.0)
            fresh_rep = clients.collect([fresh], "ops", timeout_s=300)[0]
            clients.reap([fresh])
        except BenchError:
            print(local.log_tail(), file=sys.stderr)
            raise
        finally:
            rss.stop()
            clients.stop_all()
            local.stop(15)
    ops = [op for rep in reports for op in rep["ops"]]
    done_times = [op["t1"] for op in ops]
    window = max(rep["t_end"] for rep in reports) - t_begin
    lat = {}
    for name in sorted({op["kind"] for op in ops}) + ["all"]:
        xs = [op["t1"] - op["t0"] for op in ops if name in ("all", op["kind"])]
        lat[name] = {
            "n": len(xs),
            "p50_ms": percentile(xs, 0.5) * 1000,
            "p99_ms": percentile(xs, 0.99) * 1000,
        }
    order = [
        {"kind": rep["kind"], "steps": rep["steps"], "ok": rep["steps"] == list(range(1, args.steps + 1))}
        for rep in reports
        if rep["kind"] != "sample"
    ]
    checks = futures_check(reports)
    fresh_ok = fresh_rep["steps"] == [1] and all(op["ok"] for op in fresh_rep["ops"])
    return {
        "bench": "load",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "params": {
            k: getattr(args, k)
            for k in ("clients", "steps", "mix", "prompts", "group", "max_tokens", "service_env")
        },
        "kinds": {k: kinds.count(k) for k in KINDS},
        "ops": len(ops),
        "failed_ops": sum(not op["ok"] for op in ops),
        "window_s": window,
        "ops_per_s": len(ops) / window if window > 0 else None,
        "latency": lat,
        "futures": checks,
        "steps_in_order": all(o["ok"] for o in order),
        "runs": order,
        "fresh_client_ok": fresh_ok,
        "memory": memory_figures(rss, done_times, t_begin),
        "total_s": t_done - t_wall,
        "machine": {
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "torch_threads": os.environ.get("OPENRL_TORCH_THREADS"),
        },
    }


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def report(result: dict) -> str:
    f, m, lat = result["futures"], result["memory"], result["latency"]
    lines = [
        f"load: {result['params']['clients']} clients ({result['kinds']}) × {result['params']['steps']} steps, "
        f"{result['ops']} ops in {result['window_s']:.1f} s",
        "",
        f"  {'op':<26}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}",
    ]
    for name, row in lat.items():
        lines.append(f"  {name:<26}{row['n']:>6}{row['p50_ms']:>10.0f}{row['p99_ms']:>10.0f}")
    pct = m["rss_at_pct_mb"]
    lines += [
        "",
        f"  ops/s                     {fmt(result['ops_per_s'], '.2f')}",
        f"  HTTP requests             {f['http_requests']}  (statuses {f['http_statuses']})",
        f"  5xx / 429 / transport     {f['http_5xx']} / {f['http_429']} / {f['transport_errors']}",
        f"  futures submitted/results {f['submitted']} / {f['results']}  (lost {f['lost']}, "
        f"duplicated {f['duplicated']})",
        f"  steps 1..N in order       {result['steps_in_order']}   fresh client served {result['fresh_client_ok']}",
        f"  service RSS MB            before {fmt(m['rss_before_mb'])}; at 25/50/75/100 % of ops "
        + " / ".join(fmt(pct.get(k)) for k in ("25", "50", "75", "100"))
        + f"; peak {m['peak_rss_mb']:.1f}",
        f"  RSS growth MB / 1k ops    {fmt(m['growth_mb_per_1k_ops_second_half'], '.2f')} (second half), "
        f"{fmt(m['growth_mb_per_1k_ops_whole'], '.2f')} (whole run)",
        "  RSS MB by tenth of ops    " + " ".join(fmt(v, ".0f") for v in m["rss_mean_by_tenth_mb"]),
    ]
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    f, m, lat = result["futures"], result["memory"], result["latency"]["all"]
    return (
        f"load: clients={result['params']['clients']} steps={result['params']['steps']} ops={result['ops']} "
        f"ops_per_s={fmt(result['ops_per_s'], '.2f')} p50_ms={lat['p50_ms']:.0f} p99_ms={lat['p99_ms']:.0f} "
        f"http_5xx={f['http_5xx']} peak_rss_mb={m['peak_rss_mb']:.0f} "
        f"growth_mb_per_1k_ops={fmt(m['growth_mb_per_1k_ops_second_half'], '.2f')} lost={f['lost']} "
        f"duplicated={f['duplicated']} order_ok={result['steps_in_order']} fresh_ok={result['fresh_client_ok']}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--short", action="store_true", help="16 clients × 5 steps (the test's mode)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--steps", type=int, default=None, help="steps per client (50; --short: 5)")
    p.add_argument("--mix", default="6,6,4", help="clients of each kind: sft,rl,sample")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--service-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment for the service, e.g. OPENRL_FUTURE_TTL_S=60 (repeatable)",
    )
    p.add_argument("--timeout-s", type=float, default=3600.0, help="for the whole load phase")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "load.json"))
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 5 if args.short else 50
    return args


def measure(args: argparse.Namespace) -> int:
    """Run the load, print the table and the line, write the JSON; 1 when a check failed."""
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    print(f"(written to {out})")
    print(summary_line(result))
    f = result["futures"]
    ok = not (f["lost"] or f["duplicated"] or f["http_5xx"] or result["failed_ops"])
    return 0 if ok and result["steps_in_order"] and result["fresh_client_ok"] else 1


def main(argv: list[str] | None = None) -> int:
    return bench_main("load", parse_args(argv), client_main, measure)


if __name__ == "__main__":
    sys.exit(main())
