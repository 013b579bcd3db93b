"""What ``%openrl runs`` and ``%openrl status`` show: the runs of this kernel, the key's detached jobs
and the service's other runs (another kernel's: ended, or orphaned when its kernel went away), as
small tables with text and HTML reprs."""

from __future__ import annotations

import html
import textwrap

from openrl_jupyter._exceptions import OpenRLError


class Table:
    """A small result table with text and HTML reprs (what ``%openrl runs`` returns)."""

    def __init__(self, columns: list[str], rows: list[list], title: str = ""):
        self.columns, self.rows, self.title = columns, rows, title

    MAX_WIDTH = 60  # a column wider than this wraps (a long error does not pad every other row)
    LAST_WIDTH = 100  # the last column is never padded; it wraps at this

    def __repr__(self) -> str:
        last = len(self.columns) - 1
        cap = [self.LAST_WIDTH if i == last else self.MAX_WIDTH for i in range(len(self.columns))]
        widths = [
            min(cap[i], max([len(str(c)), *(len(str(r[i])) for r in self.rows)]))
            for i, c in enumerate(self.columns)
        ]

        def lines(row: list) -> list[str]:
            cells = [
                textwrap.wrap(str(v), w, break_on_hyphens=False) or [""]
                for v, w in zip(row, widths, strict=True)
            ]
            out = []
            for k in range(max(len(c) for c in cells)):
                parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths, strict=True)]
                out.append("  ".join(parts).rstrip())
            return out

        body = [text for r in [self.columns, *self.rows] for text in lines(r)]
        return "\n".join(([self.title] if self.title else []) + body)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(str(c))}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in self.rows
        )
        title = f"<b>{html.escape(self.title)}</b>" if self.title else ""
        return f"{title}<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def runs_table(session, *, prune: bool = False) -> Table:
    """``%openrl runs``: this kernel's runs, the key's detached jobs and the service's other runs of
    this key (another kernel's, marked ended or orphaned); ``prune`` forgets those first."""
    rows = []
    mine = set()
    for run in session.runs.values():
        mine.add(run.run_id)
        last = run.history[-1] if run.step else {}
        mean = last.get("reward_mean")
        rows.append(
            [
                run.name,
                run.run_id or "-",
                "kernel",
                str(run.state),
                f"{run.step}/{run.total_steps}",
                f"{run.reward_name} v{run.reward_version or '-'}",
                f"{mean:.3f}" if mean is not None else "-",
            ]
        )
    service_runs = {r["run_id"]: r for r in session.client.list_runs()}
    try:
        jobs = session.jobs()
    except OpenRLError:  # a service without the jobs API: its runs are listed below all the same
        jobs = []
    for job in jobs:
        run_ids = list(job.get("runs") or [])
        mine.update(run_ids)
        runs = [service_runs[r] for r in run_ids if r in service_runs]
        # steps done: the rows a run stored (a step with nothing to train stores one too)
        done = [int(r.get("metrics_count") or 0) + int(r.get("metrics_dropped") or 0) for r in runs]
        per_run = (job.get("meta") or {}).get("steps") or next((r.get("steps") for r in runs), None) or "?"
        if job.get("kind") == "run":  # its newest run (a retried Kubernetes pod creates another)
            steps_text = f"{done[-1] if done else 0}/{per_run}"
        else:  # a sweep: per run; runs dropped at a rung by halving stop early on purpose
            steps_text = f"{max(done, default=0)}/{per_run} per run"
            if job.get("state") == "finished" and isinstance(per_run, int) and any(d < per_run for d in done):
                steps_text += " (halved)"
        mean = next((r["last_reward"] for r in runs[::-1] if r.get("last_reward") is not None), None)
        where = job.get("where", "?") + (f" pid {job['pid']}" if job.get("pid") else "")
        kind = "" if job.get("kind") == "run" else f" ({len(run_ids)} runs)"
        rows.append(
            [
                job.get("name", "?") + kind,
                ", ".join(run_ids) or "-",
                where,
                str(job.get("state")),
                steps_text,
                (job.get("meta") or {}).get("reward", "-"),
                f"{mean:.3f}" if isinstance(mean, (int, float)) else "-",
            ]
        )
    others = [r for r in service_runs.values() if r["run_id"] not in mine]
    pruned = []
    if prune:
        for r in [r for r in others if _abandoned(r)]:
            try:
                session.client.delete_run(r["run_id"])
            except OpenRLError as exc:  # gone meanwhile, or refused: say so, keep the rest going
                print(f"openrl: could not forget run {r['name']!r} ({r['run_id']}): {exc}")
                continue
            pruned.append(r)
            others.remove(r)
    for r in others:
        where = "Tinker SDK" if r.get("kind") == "sdk" else "another kernel"
        state = str(r.get("state") or "?") + (" (orphaned)" if r.get("orphaned") else "")
        done = int(r.get("metrics_count") or 0) + int(r.get("metrics_dropped") or 0)  # a row a step
        steps = f"{done}/{r['steps']}" if r.get("steps") else str(r["step"])
        last = r.get("last_reward")
        mean = f"{last:.3f}" if isinstance(last, (int, float)) else "-"
        rows.append([r["name"], r["run_id"], where, state, steps, "-", mean])
    caption = f"runs on {session.url}"
    if pruned:
        caption += f"; forgot {len(pruned)} ended or orphaned: " + ", ".join(r["name"] for r in pruned)
    elif prune:
        caption += "; nothing to prune (no ended or orphaned run of another kernel)"
    elif any(_abandoned(r) for r in others):
        caption += "; %openrl runs --prune forgets the ended and orphaned ones (their checkpoints stay)"
    return Table(["name", "run_id", "where", "state", "step", "reward", "reward mean"], rows, caption)


def job_status(job) -> Table:
    """A detached run or sweep in the rows a kernel run's status has, and where it logs."""
    e = job.refresh()
    meta = e.get("meta") or {}
    steps = meta.get("steps") or "?"
    runs = list(e.get("runs") or [])
    step = "-"
    mean = None
    if runs:
        described = {r["run_id"]: r for r in job.session.client.list_runs() if r.get("run_id") in runs}
        newest = [described[r] for r in runs if r in described]
        if newest:
            done = [int(r.get("metrics_count") or 0) + int(r.get("metrics_dropped") or 0) for r in newest]
            step = f"{done[-1]}/{steps}" if job.kind == "run" else f"{max(done)}/{steps} per run"
            mean = next((r["last_reward"] for r in newest[::-1] if r.get("last_reward") is not None), None)
    where = job.where + (f" pid {e['pid']}" if e.get("pid") else "")
    rows = [
        ["run" if job.kind == "run" else "sweep", f"{job.name} (detached, {where})"],
        ["state", str(e.get("state"))],
        ["step", step],
        [
            "reward",
            f"{meta.get('reward', '-')}" + (f", last mean {mean:.3f}" if mean is not None else ""),
        ],
        ["message", e.get("message") or "-"],
    ]
    if job.log_path:
        rows.append(["log", f"{job.log_path} (%openrl logs {job.name})"])
    return Table(["field", "value"], rows)


def _abandoned(run: dict) -> bool:
    """A notebook run nothing drives any more: its kernel ended it, or went away (orphaned). A Tinker
    SDK session ends by its own heartbeat rules; it is never pruned from here."""
    if run.get("kind") == "sdk":
        return False
    return bool(run.get("orphaned")) or run.get("state") in ("stopped", "finished", "failed", "ended")
