"""IPython magics: ``%openrl`` (verbs) and ``%%openrl reward NAME`` (a reward from the cell).

The magics only parse arguments, find the session and call the Python API (``connect``,
``Session.train``, ``Run``); everything they do works from plain Python too. A user mistake is an
IPython ``UsageError`` (one line, no traceback); a failure of the service is one line naming the
service and the remedy (``OpenRLError._render_traceback_``). Keys never come from the magic line.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable

from IPython.core.error import UsageError as IPythonUsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from traitlets import Float, Unicode

import openrl_jupyter.session as sessions
from openrl_jupyter import hub, listing
from openrl_jupyter._exceptions import OpenRLError, RewardCellError, UsageError
from openrl_jupyter.chat_reply import blank_note
from openrl_jupyter.listing import Table
from openrl_jupyter.magic_args import detach_kwargs, help_text, knob_kwargs, parsers, reward_weights, suggest
from openrl_jupyter.rewards import registry

KEY_SOURCES = {
    "hub": "this JupyterHub server's own token (your hub user)",
    "OPENRL_TOKEN": "$OPENRL_TOKEN",
    "TINKER_API_KEY": "$TINKER_API_KEY (for $TINKER_BASE_URL, as openrl-service serve printed them)",
    "config": "configuration",
    "argument": "given to connect",
    "local": "the embedded service's",
    "none": "none",
}


@magics_class
class OpenRLMagics(Magics):
    url = Unicode(
        None,
        allow_none=True,
        config=True,
        help="Service URL used by %openrl connect when no URL is given and $OPENRL_URL is unset.",
    )
    token_file = Unicode(
        None,
        allow_none=True,
        config=True,
        help="A file holding the service key (used when $OPENRL_TOKEN is unset); keys never go on the "
        "magic line.",
    )
    dashboard_interval = Float(0.5, config=True, help="Seconds between dashboard refreshes (≤ 2 per second).")

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self._parsers = parsers()
        self._service_dashboard = None
        self._chats: dict[tuple[str, str], list[dict]] = {}  # (session, model) -> the conversation so far
        self._verbs: dict[str, Callable] = {
            "connect": self._connect,
            "train": self._train,
            "sweep": self._sweep,
            "pause": self._pause,
            "resume": self._resume,
            "stop": self._stop,
            "save": self._save,
            "chat": self._chat,
            "export": self._export,
            "runs": self._runs,
            "attach": self._attach,
            "logs": self._logs,
            "status": self._status,
            "dashboard": self._dashboard,
            "sessions": self._sessions,
            "token": self._token,
            "disconnect": self._disconnect,
            "help": self._help,
        }

    @line_cell_magic
    def openrl(self, line: str, cell: str | None = None):
        try:
            if cell is not None:
                return self._cell(line, cell)
            words = _split(line)
            if not words:
                return self._help(None)
            verb = words[0]
            if verb in ("--help", "-h"):
                return self._help(None)
            if verb not in self._verbs:
                raise UsageError(
                    f"unknown subcommand {verb!r}{suggest(verb, list(self._verbs))} (one of: "
                    f"{', '.join(self._verbs)}; %openrl help explains them)"
                )
            args = self._parsers[verb].parse_args(words[1:])
            return self._verbs[verb](args)
        except UsageError as exc:
            raise IPythonUsageError(str(exc)) from None
        except SystemExit:  # argparse after printing --help
            return None

    openrl.__doc__ = help_text(parsers())

    # -- verbs ----------------------------------------------------------------------------------------
    def _connect(self, a):
        token = None
        if self.token_file and not os.environ.get("OPENRL_TOKEN"):
            try:
                with open(os.path.expanduser(self.token_file), encoding="utf-8") as f:
                    token = sessions.Secret(f.read().strip())
            except OSError as e:
                raise UsageError(
                    f"c.OpenRLMagics.token_file: cannot read {self.token_file!r} ({e.strerror})"
                ) from None
        if a.detached and not a.local:
            raise UsageError("--detached goes with --local: %openrl connect --local --detached")
        if not (
            a.url or a.local or os.environ.get("OPENRL_URL") or self.url or os.environ.get("TINKER_BASE_URL")
        ):
            raise UsageError(
                "no openrl service to connect to: %openrl connect URL (key in $OPENRL_TOKEN), set "
                "$OPENRL_URL or $TINKER_BASE_URL (the lines `openrl-service serve` prints), set "
                "c.OpenRLMagics.url, or start one here with %openrl connect --local"
            )
        session = sessions.connect(
            a.url,
            token=token,
            name=a.name,
            local=a.local,
            model=a.model,
            config={"url": self.url} if self.url else None,
            progress=lambda msg: print(msg, flush=True),
            detached=a.detached,
        )
        local = session.local
        kind = "the service"
        if local is not None:
            pid = local.process.pid
            if local.detached:
                kind = f"your detached embedded service (pid {pid}, it outlives kernels)"
            elif local.owned:
                kind = f"your embedded service (pid {pid}, it stops with this kernel)"
            else:
                kind = f"your embedded service another kernel started (pid {pid}, it stops with that kernel)"
        who = " as your JupyterHub user" if session.credential == "hub" else ""
        print(
            f"openrl: session {session.name!r} connected to {kind} at {session.url}{who} "
            f"(model {session.model})"
        )
        if local is not None:
            print(
                f"openrl: its data (checkpoints, the key, service.log) stay in {local.data_dir} and the next "
                "%openrl connect --local finds them"
                + (
                    f"; stop it with: openrl-service stop --data-dir {local.data_dir}"
                    if local.detached
                    else ""
                )
            )

    def _session(self, name: str | None):
        if not sessions.sessions():
            raise UsageError("not connected: run %openrl connect URL (or %openrl connect --local) first")
        return sessions.get_session(name)

    def _train(self, a):
        session = self._session(a.session)
        prompts = self._resolve_prompts(a.prompts)
        if (a.reward is None) == (a.env is None):
            raise UsageError("%openrl train takes --reward NAME or --env NAME (one of them)")
        env_options = {
            k: getattr(a, k)
            for k in ("max_turns", "max_episode_tokens", "step_timeout_s")
            if getattr(a, k) is not None
        }
        return session.train(
            reward=reward_weights(a.reward),
            env=a.env,
            **env_options,
            prompts=prompts,
            model=a.model,
            steps=a.steps,
            group=a.group,
            batch=a.batch,
            lr=a.lr,
            rank=a.rank,
            max_tokens=a.max_tokens,
            temperature=a.temperature,
            loss=a.loss,
            name=a.name,
            normalize_std=a.normalize_std,
            seed=a.seed,
            overlap=a.overlap,
            load_from=a.load_from,
            log=",".join(a.log) if a.log else None,
            **knob_kwargs(a, self._resolve_prompts),
            **detach_kwargs(a),
        )

    def _sweep(self, a):
        session = self._session(a.session)
        prompts = self._resolve_prompts(a.prompts)
        grid: dict = {}
        kinds = {"lr": float, "rank": int, "loss": str, "temperature": float, "seed": int, "kl_coef": float}
        for key, kind in kinds.items():
            raw = getattr(a, key)
            if raw is None:
                continue
            try:
                grid[key] = [kind(v.strip()) for v in raw.split(",") if v.strip()]
            except ValueError:
                raise UsageError(
                    f"--{key} takes comma-separated {kind.__name__} values, e.g. --lr 1e-4,3e-4; got {raw!r}"
                ) from None
        weighted = reward_weights(a.reward)  # --reward a=1,b=0.5: one weighted reward for every run
        rewards = (
            [weighted]
            if isinstance(weighted, dict)
            else [r.strip() for r in a.reward.split(",") if r.strip()]
        )
        reward = rewards[0] if len(rewards) == 1 else None
        if len(rewards) > 1:
            grid["reward"] = rewards
        if not grid:
            raise UsageError(
                "give at least one list to sweep over: --lr, --rank, --loss, --temperature, --seed, --kl-coef"
            )
        options = {k: getattr(a, k) for k in ("group", "batch", "max_tokens") if getattr(a, k) is not None}
        if a.log:
            options["log"] = ",".join(a.log)
        options.update(knob_kwargs(a, self._resolve_prompts, skip=("kl_coef",)))
        return session.sweep(
            reward=reward,
            prompts=prompts,
            grid=grid,
            steps=a.steps,
            budget=a.budget,
            rungs=a.rungs,
            keep=a.keep,
            metric=a.metric,
            name=a.name,
            **options,
            **detach_kwargs(a),
        )

    def _resolve_prompts(self, src: str):
        ns = self.shell.user_ns
        if src.isidentifier():
            if src in ns:
                return ns[src]
            raise UsageError(
                f"--prompts {src}: no variable {src!r} in this notebook (define it, or give a .txt/.jsonl path)"
            )
        if src.endswith((".txt", ".jsonl")):
            return src
        raise UsageError(f"--prompts {src!r}: give a notebook variable name or a .txt/.jsonl path")

    def _job(self, a, name: str | None = None):
        """The detached job ``a.run`` names, when no run of this kernel has that name: one this
        kernel started, or one the service has for this key (started by another kernel)."""
        from openrl_jupyter.jobs.handle import Job

        session = self._session(a.session)
        name = a.run if name is None else name
        if name is None or name in session.runs:
            return None
        if name in session.detached:
            return session.detached[name]
        try:
            entry = session.client.get_job(name)
        except OpenRLError:  # no such job (or a service without jobs): the caller says what is there
            return None
        job = session.detached[entry["name"]] = Job(session, entry)
        return job

    def _pause(self, a):
        job = self._job(a)
        if job is not None:
            job.pause(reason="paused with %openrl pause")
            print(f"openrl: asked detached {job.kind} {job.name!r} to pause after its current step")
            return
        run = self._session(a.session).get_run(a.run)
        run.pause(wait=a.wait)
        print(f"openrl: run {run.name!r} is {run.state} at step {run.step}/{run.total_steps}")

    def _resume(self, a):
        job = self._job(a)
        if job is not None:
            job.resume(reason="resumed with %openrl resume")
            print(f"openrl: asked detached {job.kind} {job.name!r} to resume")
            return
        run = self._session(a.session).get_run(a.run)
        run.resume()
        print(f"openrl: run {run.name!r} is {run.state} from step {run.step}/{run.total_steps}")

    def _stop(self, a):
        job = self._job(a)
        if job is not None:
            job.stop(reason="stopped with %openrl stop", wait=a.wait)
            state = job.entry.get("state")
            if a.wait or state in ("stopped", "finished", "failed"):
                print(f"openrl: detached {job.kind} {job.name!r} is {state}")
            else:  # it obeys at its next step: say so, not only that it is (still) running
                print(
                    f"openrl: asked detached {job.kind} {job.name!r} to stop after its current step "
                    f"(it is {state} now; %openrl stop {job.name} --wait waits for it)"
                )
            return
        run = self._session(a.session).get_run(a.run)
        run.stop(wait=a.wait)
        print(f"openrl: run {run.name!r} is {run.state} at step {run.step}/{run.total_steps}")

    def _save(self, a):
        run = self._session(a.session).get_run(a.run)
        try:
            path = run.save(a.checkpoint, overwrite=a.overwrite)
        except OpenRLError as e:  # the service's hint names the Python keyword; here it is a flag
            if "already exists" not in str(e):
                raise
            raise UsageError(str(e).replace("pass overwrite=True", "add --overwrite")) from None
        print(f"openrl: saved run {run.name!r} at step {run.step}: {path}")

    def _chat(self, a):
        session = self._session(a.session)
        key = (session.name, a.model)
        if a.new or key not in self._chats:
            self._chats[key] = [{"role": "system", "content": a.system}] if a.system else []
        history = self._chats[key]
        params = {"max_tokens": a.max_tokens, "temperature": a.temperature}
        if a.message:
            reply = session.chat(a.model, " ".join(a.message), history=history, **params)
            note = blank_note(reply, a.model)
            print(reply if note is None else f"openrl: {note}")
            return None
        from openrl_jupyter.chat import ChatBox

        return ChatBox(lambda text: session.chat(a.model, text, history=history, **params), title=a.model)

    def _export(self, a):
        session = self._session(a.session)
        if not a.force:
            sessions.refuse_full_folder(a.dir, "--force")
        info = session.export(a.model, a.dir, merged=a.merged, overwrite=a.force)
        kind = "Hugging Face model folder (merged)" if info["format"] == "merged" else "PEFT adapter folder"
        print(
            f"openrl: exported {info['tinker_path']} to {a.dir}: a {kind} on {info['base_model']} "
            f"(base weights sha256 {info['base_weights_sha256'][:16]}…)"
        )

    def _runs(self, a):
        return listing.runs_table(self._session(a.session), prune=a.prune)

    def _attach(self, a):
        session = self._session(a.session)
        return session.attach(a.name)

    def _status(self, a):
        session = self._session(a.session)
        job = self._job(a)
        if job is not None:
            return listing.job_status(job)
        if a.run is not None:
            run = session.get_run(a.run)
            return Table(
                ["field", "value"],
                [
                    ["run", run.name],
                    ["state", str(run.state)],
                    ["step", f"{run.step}/{run.total_steps}"],
                    ["reward", f"{run.reward_name} v{run.reward_version or '-'}"],
                    ["last error", run.last_error or "-"],
                ],
            )
        ready = session.client.ready()
        tick = session.feed().last_tick if session._feed is not None else None
        util = tick["utilisation"] if tick else None
        active = sum(1 for r in session.runs.values() if not r.done)
        rows = [
            ["session", session.name],
            ["service", session.url + (" (embedded)" if session.local else "")],
            ["key", KEY_SOURCES.get(session.credential, session.credential)],
        ]
        reporter = hub.reporter()
        if reporter is not None:
            failed = f", {reporter.failures} failed" if reporter.failures else ""
            rows.append(
                [
                    "hub activity",
                    f"reported {reporter.reports} times{failed}; every {reporter.interval:g} s while a run steps",
                ]
            )
        return Table(
            ["field", "value"],
            [
                *rows,
                ["status", ready.get("status", "?")],
                ["model", session.model or "-"],
                ["runs here", f"{len(session.runs)} ({active} active)"],
                ["rewards", ", ".join(f"{n} v{registry.latest(n).version}" for n in registry.names()) or "-"],
                ["utilisation", f"{util['value']:.0%} ({util['label']})" if util else "-"],
            ],
        )

    def _logs(self, a):
        job = self._job(a, a.run)
        if job is None:
            session = self._session(a.session)
            if a.run in session.runs:
                raise UsageError(
                    f"{a.run!r} runs in this kernel: its messages are on its dashboard and in run.history; "
                    "%openrl logs shows a detached run's log"
                )
            raise UsageError(f"no detached run named {a.run!r} on {session.url} (see %openrl runs)")
        if job.log_path is None:
            k8s = job.entry.get("k8s") or {}
            if k8s.get("job"):
                ns = f" -n {k8s['namespace']}" if k8s.get("namespace") else ""
                where = f"its pod's log: kubectl logs{ns} job/{k8s['job']}"
            else:
                where = "its log is on the machine that started it, not this one"
            print(f"openrl: detached {job.kind} {job.name!r} runs {job.where}: {where}")
            return
        text = job.logs(a.chars)
        lines = text.splitlines()[-a.lines :] if a.lines else text.splitlines()
        print(f"openrl: the last {len(lines)} lines of {job.log_path}")
        print("\n".join(lines))

    def _dashboard(self, a):
        from openrl_jupyter.dashboard import ServiceDashboard

        session = self._session(a.session)
        if self._service_dashboard is not None:
            self._service_dashboard.close()
        runs = session.client.list_runs()
        board = ServiceDashboard(session.feed(), runs=runs, interval_s=max(0.5, self.dashboard_interval))
        for r in runs:  # the curves so far, then live events
            if r.get("metrics_count"):
                for row in session.client.metrics(r["run_id"]):
                    board.handle({"type": "run", "event": "metrics", "run_id": r["run_id"], "metrics": row})
        self._service_dashboard = board
        return board

    def _token(self, a):
        session = self._session(a.session)
        if a.action == "list":
            if a.id is not None or a.name is not None:
                raise UsageError("%openrl token list takes no id or --name")
            rows = [
                [
                    k.get("id"),
                    k.get("name") or "-",
                    k.get("prefix") or "-",
                    _when(k.get("created")),
                    _when(k.get("expires")) if k.get("expires") else "-",
                ]
                for k in session.list_keys()
            ]
            return Table(
                ["id", "name", "prefix", "created", "expires"], rows, f"keys minted on {session.url}"
            )
        if a.action == "revoke":
            if not a.id:
                raise UsageError("%openrl token revoke ID: give the id of a key (see %openrl token list)")
            session.revoke_key(a.id)
            print(f"openrl: key {a.id} revoked; it no longer works")
            return None
        if a.id is not None:
            raise UsageError(f"unexpected {a.id!r}: %openrl token [--name LABEL] | list | revoke ID")
        key = session.mint_key(a.name)
        label = f" ({key.name})" if key.name else ""
        print(
            f"openrl: minted key {key.id}{label} for {key.tenant}; exported TINKER_API_KEY and "
            f"TINKER_BASE_URL={session.url} in this kernel (tinker.ServiceClient() uses them; the key "
            "is not shown). Revoke it with %openrl token revoke " + key.id
        )
        return None

    def _sessions(self, a):
        rows = [
            [s.name, s.url, "embedded" if s.local else "remote", s.model or "-", len(s.runs)]
            for s in sessions.sessions().values()
        ]
        return Table(["name", "url", "kind", "model", "runs"], rows)

    def _disconnect(self, a):
        session = self._session(a.name)
        local = session.local
        if a.stop_service and local is None:
            raise UsageError(
                f"--stop-service: session {session.name!r} is connected to {session.url}, not an embedded service"
            )
        stopped = sessions.disconnect(session.name)
        note = f"; stopped its active runs: {', '.join(stopped)}" if stopped else ""
        print(f"openrl: session {session.name!r} disconnected{note}")
        if a.stop_service:
            from openrl_common.datadirs import stop_on

            pid = stop_on(local.data_dir)
            print(
                f"openrl: stopped the embedded service (pid {pid}); its data stay in {local.data_dir}"
                if pid is not None
                else f"openrl: the embedded service had already stopped; its data stay in {local.data_dir}"
            )
        elif local is not None and (local.detached or not local.owned):
            print(
                f"openrl: the embedded service (pid {local.process.pid}) goes on; "
                "%openrl disconnect --stop-service stops it"
            )

    def _help(self, a):
        verb = getattr(a, "verb", None)
        if verb is None:
            print(help_text(self._parsers))
        elif verb in self._parsers:
            print(self._parsers[verb].format_help())
        else:
            raise UsageError(
                f"%openrl help: no subcommand {verb!r}{suggest(verb, list(self._parsers))} (one of: "
                f"{', '.join(self._parsers)})"
            )

    # -- %%openrl env NAME ----------------------------------------------------------------------------
    def _env_cell(self, name: str, cell: str):
        """Run the cell; register its ``env`` (a factory (prompt, info) -> Env | MessageEnv) as the next
        version of environment ``name``; runs on it pick it up at their next step."""
        from openrl_jupyter.env import envs

        if not name.isidentifier():
            raise UsageError(f"environment name must be an identifier (letters, digits, _); got {name!r}")
        ns = self.shell.user_ns
        before = ns.get("env")
        cell = self.shell.transform_cell(cell)
        filename = self.shell.compile.cache(cell)
        try:
            exec(compile(cell, filename, "exec"), ns)  # noqa: S102 - the user's own cell, in the user's kernel
        except Exception as e:
            raise RewardCellError(name, e, filename) from None
        factory = ns.get("env")
        if factory is before or not callable(factory):
            raise UsageError(
                f"the cell defines no environment: write def env(prompt, info) -> Env (or a class env) "
                f"in the %%openrl env {name} cell"
            )
        v = envs.register(name, factory)
        live = [
            r.name
            for s in sessions.sessions().values()
            for r in s.runs.values()
            if r.config.env and r.reward_name == name and not r.done
        ]
        note = (
            f"; running {', '.join(live)} pick{'s' if len(live) == 1 else ''} it up at the next step"
            if live
            else ""
        )
        print(f"openrl: environment {name} v{v.version} registered{note}")

    # -- %%openrl reward NAME -------------------------------------------------------------------------
    def _cell(self, line: str, cell: str):
        words = _split(line)
        if len(words) == 2 and words[0] == "env":
            return self._env_cell(words[1], cell)
        if len(words) != 2 or words[0] != "reward":
            raise UsageError(
                "the cell forms are %%openrl reward NAME (a cell that defines reward(...)) and "
                "%%openrl env NAME (a cell that defines env(prompt, info))"
            )
        name = words[1]
        if not name.isidentifier():
            raise UsageError(f"reward name must be an identifier (letters, digits, _); got {name!r}")
        ns = self.shell.user_ns
        before = {k: ns.get(k) for k in ("reward", "reward_group")}
        cell = self.shell.transform_cell(cell)  # %magics and !commands work in a reward cell too
        filename = self.shell.compile.cache(cell)
        try:
            exec(compile(cell, filename, "exec"), ns)  # noqa: S102 - the user's own cell, in the user's kernel
        except Exception as e:  # shown as the user's own lines (RewardCellError._render_traceback_)
            raise RewardCellError(name, e, filename) from None
        defined = [
            k for k in ("reward_group", "reward") if ns.get(k) is not before[k] and callable(ns.get(k))
        ]
        if not defined:
            raise UsageError(
                f"the cell defines no reward: write def reward(prompt, completion, **info) -> float "
                f"(or def reward_group(prompts, completions, infos) -> list) in the %%openrl reward {name} cell"
            )
        kind = defined[0]
        v = registry.register(name, ns[kind], per_group=kind == "reward_group")
        form = "per group" if v.per_group else "per sample"
        live = [
            r.name
            for s in sessions.sessions().values()
            for r in s.runs.values()
            if r.reward_name == name and not r.done
        ]
        note = (
            f"; running {', '.join(live)} pick{'s' if len(live) == 1 else ''} it up at the next step"
            if live
            else ""
        )
        sent, refused = self._send_to_jobs(name, v)
        if sent:
            note += "; sent to detached " + ", ".join(f"{j} (its payload v{n})" for j, n in sent)
            note += ", which pick" + ("s" if len(sent) == 1 else "") + " it up at the next step"
        print(
            f"openrl: reward {name} v{v.version} registered ({form}{', async' if v.is_async else ''}){note}"
        )
        if refused:
            raise UsageError(
                f"reward {name} v{v.version} is registered here but was NOT sent to "
                + "; ".join(f"detached {j}: {why}" for j, why in refused)
            )

    def _send_to_jobs(self, name: str, v) -> tuple[list, list]:
        """Send a new version of reward ``name`` to the active detached jobs of the open sessions
        that use it (hot swap); (sent [(job, payload version)], refused [(job, why)])."""
        from openrl_jupyter.jobs import TERMINAL

        sent, refused = [], []
        for s in sessions.sessions().values():
            for job in list(s.detached.values()):
                if name not in job.reward_names or job.entry.get("state") in TERMINAL:
                    continue
                try:
                    if job.refresh().get("state") in TERMINAL:
                        continue
                    sent.append((job.name, job.send_reward(v)))
                except (UsageError, OpenRLError) as exc:
                    refused.append((job.name, str(exc)))
        return sent, refused


def _when(created) -> str:
    if not isinstance(created, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(created))


def _split(line: str) -> list[str]:
    try:
        return shlex.split(_without_comment(line))
    except ValueError as e:
        raise UsageError(f"cannot parse {line!r}: {e}") from None


def _without_comment(line: str) -> str:
    """The line up to a ``#`` that starts a word outside quotes, as in Python and the shell
    (``--name run#1`` and ``"a # b"`` keep theirs; shlex's own comments cut inside words)."""
    quote = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "\\":
            i += 1
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
        i += 1
    return line
