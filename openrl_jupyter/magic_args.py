"""The ``%openrl`` verbs' argument parsers and the manual written from them (``%openrl?``,
``%openrl help``): each verb's options, their help and defaults, in one place (magics.py handles them).
"""

from __future__ import annotations

import argparse
import difflib
import re

from IPython.core.magic_arguments import MagicArgumentParser, MagicHelpFormatter

from openrl_jupyter._exceptions import UsageError
from openrl_jupyter.config import LOSSES
from openrl_jupyter.knobs import LOSS_AGGS, LR_SCHEDULES


class HelpFormatter(MagicHelpFormatter):
    """IPython's magic help, each option's default shown (unless its help already says it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS) and "default" not in text
        if shown and action.option_strings:
            text += " (default: %(default)s)"
        return text


class Parser(MagicArgumentParser):
    """A verb's parser: no abbreviations (``--step 5`` is not ``--steps 5``), a refusal that suggests
    the closest option or choice, and help headed ``%openrl VERB`` as one types it."""

    def __init__(self, prog: str, description: str):
        super().__init__(
            prog=f"%openrl {prog}", description=description, add_help=True, formatter_class=HelpFormatter
        )
        self.allow_abbrev = False  # (MagicArgumentParser does not take the argument)

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {self._explain(message)}")

    def _explain(self, message: str) -> str:
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            flags = [w for w in unknown.group(1).split() if w.startswith("-")]
            if flags:
                word = flags[0].split("=", 1)[0]
                close = difflib.get_close_matches(word, list(self._option_string_actions), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]}?" if close else ""
                return f"unknown option {word}{hint} ({self.prog} --help lists them)"
            return f"{message} ({self.prog} --help says what it takes)"
        choice = re.match(r"argument (\S+): invalid choice: '(.*)' \(choose from (.*)\)", message)
        if choice:
            flag, got, allowed = choice.groups()
            options = [c.strip().strip("'") for c in allowed.split(",")]
            close = difflib.get_close_matches(got, options, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            return f"{flag} must be one of {', '.join(options)}; got {got!r}{hint}"
        return message

    def format_usage(self) -> str:
        return _as_typed(super().format_usage())

    def format_help(self) -> str:
        return _as_typed(super().format_help())


def _as_typed(text: str) -> str:
    """IPython writes usage as reST (``::`` and ``%%openrl``); the help shows what one types. Only the
    usage is rewritten: the text below it names the cell magics (``%%openrl reward``) as they are."""
    if text.startswith("::\n\n  "):
        text = "usage: " + text[len("::\n\n  ") :]
    usage, gap, rest = text.partition("\n\n")
    return usage.replace(":: ", "").replace("%%openrl", "%openrl") + gap + rest.replace(":: ", "")


def rungs_value(text: str) -> int | list[int]:
    """``--rungs``: a count ("2") or the rungs' steps ("5,10,20")."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes a count (2) or comma-separated steps (5,10,20); got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(
            f"takes a count (2) or comma-separated steps (5,10,20); got {text!r}"
        )
    return values[0] if len(values) == 1 and "," not in text else values


def parser(prog: str, description: str) -> Parser:
    return Parser(prog, description)


def suggest(word: str, choices: list[str]) -> str:
    """ "; did you mean X?" for the closest of ``choices``, or nothing."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def detach_options(parser: MagicArgumentParser, what: str) -> None:
    parser.add_argument(
        "--detach",
        nargs="?",
        const="local",
        default=None,
        choices=("local", "k8s"),
        help=f"run the {what} in a process that outlives this kernel: local (a process here, the "
        "default) or k8s (a Kubernetes Job the service submits); returns its job",
    )
    parser.add_argument(
        "--image", default=None, help="with --detach k8s: one of the service's allowed images"
    )
    parser.add_argument(
        "--volume",
        action="append",
        default=None,
        dest="volumes",
        metavar="NAME",
        help="with --detach k8s: a volume the service allows (repeatable)",
    )
    parser.add_argument("--cpu", default=None, help="with --detach k8s: CPU for the reward work, e.g. 2")
    parser.add_argument("--memory", default=None, help="with --detach k8s: memory, e.g. 4Gi")


KNOB_FLAGS = (  # train's RL knobs (docs/knobs.md), the same for %openrl train and %openrl sweep
    ("--kl-coef", "kl_coef", float, "KL to the run's starting weights, times this, in the loss (0: off)"),
    (
        "--lr-schedule",
        "lr_schedule",
        LR_SCHEDULES,
        "the learning rate over the run: constant, linear or cosine",
    ),
    ("--warmup-steps", "warmup_steps", int, "steps of linear learning-rate warmup (0)"),
    ("--epochs", "epochs", int, "optimizer passes over each step's batch (1)"),
    ("--minibatches", "minibatches", int, "optimizer updates per pass, each on a share of the batch (1)"),
    ("--loss-agg", "loss_agg", LOSS_AGGS, "token: every token weighs the same; sequence: every sample"),
    ("--top-p", "top_p", float, "rollouts: nucleus sampling's share of probability (1: off)"),
    ("--top-k", "top_k", int, "rollouts: sample among the k likeliest tokens only"),
    ("--stop", "stop", str, "rollouts: a string that ends a completion (repeatable)"),
    (
        "--eval-every",
        "eval_every",
        int,
        "evaluate on --eval-prompts every N steps, keeping RUN-best (0: off)",
    ),
    ("--eval-prompts", "eval_prompts", "prompts", "held-out prompts: a notebook variable or a path"),
    ("--eval-metric", "eval_metric", str, "the reward that scores the evaluation (default: the run's)"),
    ("--save-every", "save_every", int, "save a checkpoint RUN-stepN every N steps (0: off)"),
)


def knob_options(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """The RL knobs' flags (``KNOB_FLAGS``) and --no-skip-zero-variance."""
    for flag, dest, kind, text in KNOB_FLAGS:
        if dest in skip:
            continue
        if isinstance(kind, tuple):
            parser.add_argument(flag, dest=dest, default=None, choices=kind, help=text)
        elif dest == "stop":
            parser.add_argument(flag, dest=dest, default=None, action="append", help=text)
        else:
            parser.add_argument(
                flag, dest=dest, default=None, type=kind if kind != "prompts" else str, help=text
            )
    parser.add_argument(
        "--no-skip-zero-variance",
        dest="skip_zero_variance",
        action="store_false",
        default=True,
        help="keep groups whose samples all scored the same instead of replacing them with fresh prompts",
    )


def knob_kwargs(a, resolve, *, skip: tuple[str, ...] = ()) -> dict:
    """The knobs given on the magic line, as ``train`` keywords (``resolve`` turns a prompts flag's
    value into prompts); ``skip``: those the verb reads itself (a sweep's lists)."""
    out = {}
    for _, dest, kind, _ in KNOB_FLAGS:
        value = None if dest in skip else getattr(a, dest, None)
        if value is not None:
            out[dest] = resolve(value) if kind == "prompts" else value
    if not a.skip_zero_variance:
        out["skip_zero_variance"] = False
    return out


def reward_weights(raw: str | None) -> str | dict | None:
    """``--reward correct=1,format=0.2`` as ``{"correct": 1.0, "format": 0.2}``; a plain name as is."""
    if raw is None or "=" not in raw:
        return raw
    out = {}
    for part in raw.split(","):
        name, sep, weight = part.partition("=")
        try:
            out[name.strip()] = float(weight) if sep else 1.0
        except ValueError:
            raise UsageError(f"--reward takes NAME or NAME=WEIGHT,NAME=WEIGHT...; got {raw!r}") from None
    return out


def detach_kwargs(a) -> dict:
    """``detach=`` and ``k8s=`` for train/sweep from the parsed magic line."""
    k8s = {"image": a.image, "volumes": a.volumes, "cpu": a.cpu, "memory": a.memory}
    k8s = {k: v for k, v in k8s.items() if v}
    if k8s and a.detach != "k8s":
        flags = {"image": "--image", "volumes": "--volume", "cpu": "--cpu", "memory": "--memory"}
        raise UsageError(f"{'/'.join(flags[k] for k in k8s)} go with --detach k8s")
    if a.detach is None:
        return {}
    return {"detach": a.detach, **({"k8s": k8s} if k8s else {})}


def parsers() -> dict[str, MagicArgumentParser]:
    p: dict[str, MagicArgumentParser] = {}
    c = p["connect"] = parser("connect", "Connect to a service, or start an embedded one with --local.")
    c.add_argument("url", nargs="?", help="service URL (default: $OPENRL_URL, then c.OpenRLMagics.url)")
    c.add_argument("--local", action="store_true", help="start an embedded service in a child process")
    c.add_argument(
        "--model",
        default=None,
        help="base model for this session's runs, one the service serves (default: its first); "
        "with --local, the model to serve (openrl/tiny, HF dir, GGUF)",
    )
    c.add_argument("--name", default=None, help="session name (several sessions can be open)")
    c.add_argument(
        "--detached",
        action="store_true",
        help="with --local: a service that outlives this kernel (for --detach local runs); a later "
        "kernel's %%openrl connect --local --detached finds it again",
    )
    t = p["train"] = parser(
        "train",
        "Start a background RL run (--prompts: a notebook variable or a .txt/.jsonl path); returns at once.",
    )
    t.add_argument(
        "--reward",
        default=None,
        help="a reward registered with %%%%openrl reward NAME, or several weighted: correct=1,format=0.2",
    )
    t.add_argument(
        "--env", default=None, help="instead of --reward: an environment registered with %%%%openrl env NAME"
    )
    t.add_argument("--prompts", required=True, help="a notebook variable (list) or a .txt/.jsonl path")
    t.add_argument(
        "--max-turns", type=int, default=None, dest="max_turns", help="with --env: turns per episode (8)"
    )
    t.add_argument(
        "--max-episode-tokens",
        type=int,
        default=None,
        dest="max_episode_tokens",
        help="with --env: an episode's tokens, all turns (default: the model's context)",
    )
    t.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        dest="step_timeout_s",
        help="with --env: seconds one environment call may take (60)",
    )
    t.add_argument("--model", default=None, help="a model the service serves (default: the session's)")
    t.add_argument("--steps", type=int, default=60, help="RL steps to run")
    t.add_argument("--group", type=int, default=None, help="samples per prompt (default: the model's)")
    t.add_argument("--batch", type=int, default=None, help="prompts per step (default: the model's)")
    t.add_argument("--lr", type=float, default=None, help="learning rate (default: the model's)")
    t.add_argument(
        "--rank", type=int, default=None, help="LoRA rank (default: the model's); 0: a full fine-tune"
    )
    t.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        dest="max_tokens",
        help="the longest completion (default: the model's)",
    )
    t.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (default: the model's)"
    )
    t.add_argument("--loss", default="importance_sampling", choices=LOSSES, help="the RL loss")
    t.add_argument("--normalize-std", action="store_true", dest="normalize_std", help="divide by group std")
    t.add_argument("--seed", type=int, default=0, help="seeds the LoRA initialisation and the sampling")
    t.add_argument(
        "--load-from",
        default=None,
        dest="load_from",
        help="a tinker:// checkpoint whose LoRA weights the run starts from (e.g. an SFT run's save_state)",
    )
    t.add_argument(
        "--overlap",
        type=int,
        default=0,
        choices=(0, 1),
        help="1: sample step k+1 while step k is scored (one step off-policy, corrected by the ratio)",
    )
    t.add_argument("--name", default=None, help="run name (default: generated)")
    t.add_argument(
        "--log",
        action="append",
        default=None,
        help="log the run to a tracker: wandb, mlflow or tensorboard (repeat, or comma-separate; default: $OPENRL_LOG)",
    )
    knob_options(t)
    detach_options(t, "run")
    t.add_argument("--session", default=None)
    w = p["sweep"] = parser(
        "sweep",
        "Start one run per combination of the listed values at once, stopping the worse half at each "
        "rung (successive halving); returns the sweep. Lists are comma-separated: --lr 1e-4,3e-4.",
    )
    w.add_argument(
        "--reward",
        required=True,
        help="registered reward name(s), comma-separated (a list to sweep over), or one weighted: a=1,b=0.2",
    )
    w.add_argument("--prompts", required=True, help="a notebook variable (list) or a .txt/.jsonl path")
    for flag, what in (
        ("--lr", "learning rates"),
        ("--rank", "LoRA ranks"),
        ("--loss", f"losses ({', '.join(LOSSES)})"),
        ("--temperature", "sampling temperatures"),
        ("--seed", "seeds"),
        ("--kl-coef", "KL coefficients"),
    ):
        w.add_argument(flag, default=None, help=f"{what}, comma-separated")
    w.add_argument("--steps", type=int, default=60, help="the most steps of each run")
    w.add_argument("--budget", type=int, default=None, help="the most steps of all runs together")
    w.add_argument(
        "--rungs",
        type=rungs_value,
        default=None,
        help="how many rungs, or their steps: 5,10,20 (default: as many as halve the runs to one, each "
        "twice as far in as the one before: ..., steps/4, steps/2; none before steps/8, at least step 2 "
        "and at most step 10, nor within 2 steps of another: a 4-step sweep has one rung, at step 2)",
    )
    w.add_argument("--keep", type=float, default=0.5, help="the share kept at each rung")
    w.add_argument("--metric", default="reward_mean", help="the history column runs are ranked by")
    w.add_argument("--group", type=int, default=None, help="samples per prompt (default: the model's)")
    w.add_argument("--batch", type=int, default=None, help="prompts per step (default: the model's)")
    w.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        dest="max_tokens",
        help="the longest completion (default: the model's)",
    )
    w.add_argument("--name", default=None, help="sweep name (its runs are NAME-lr1e-4-r8-...)")
    w.add_argument(
        "--log",
        action="append",
        default=None,
        help="log every run to a tracker: wandb, mlflow or tensorboard (repeat, or comma-separate; default: $OPENRL_LOG)",
    )
    knob_options(w, skip=("kl_coef",))
    detach_options(w, "sweep")
    w.add_argument("--session", default=None)
    for verb, desc in (
        ("pause", "Pause a run (it finishes its current step first)."),
        ("resume", "Resume a paused run (a step that paused on an error is retried)."),
        ("stop", "Stop a run (it finishes its current step first)."),
    ):
        v = p[verb] = parser(verb, desc)
        v.add_argument(
            "run",
            nargs="?",
            default=None,
            help="run name, or a detached run's (default: the latest run of this kernel)",
        )
        v.add_argument("--session", default=None)
        if verb != "resume":
            v.add_argument("--wait", action="store_true", help="return once no step is in flight")
    s = p["save"] = parser("save", "Save a run's weights and optimizer; prints the tinker:// path.")
    s.add_argument("run", nargs="?", default=None, help="run name (default: the latest run of this kernel)")
    s.add_argument("checkpoint", nargs="?", default=None, help="checkpoint name (default: RUN-stepN)")
    s.add_argument("--overwrite", action="store_true", help="replace a checkpoint of the same name")
    s.add_argument("--session", default=None)
    ch = p["chat"] = parser(
        "chat",
        "Talk to a model through the service's OpenAI-compatible API: a tinker:// checkpoint, a base model or "
        "a run of this kernel (its current weights). With a message, prints the reply (the conversation "
        "continues on the next %openrl chat of the same model); without one, shows a chat box.",
    )
    ch.add_argument("model", help="a tinker:// checkpoint, a base model, or a run name")
    ch.add_argument("message", nargs="*", help="what to say (quote it or not)")
    ch.add_argument("--new", action="store_true", help="start a new conversation with this model")
    ch.add_argument("--system", default=None, help="a system message for a new conversation")
    ch.add_argument("--max-tokens", type=int, default=128, help="longest reply in tokens")
    ch.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    ch.add_argument("--session", default=None)
    ex = p["export"] = parser(
        "export",
        "Download a checkpoint (or a run's current weights) as a PEFT adapter folder, or with --merged a "
        "Hugging Face model folder that AutoModelForCausalLM loads.",
    )
    ex.add_argument("model", help="a tinker:// checkpoint or a run name")
    ex.add_argument("dir", help="the folder to create")
    ex.add_argument("--merged", action="store_true", help="merge the adapter into a full model folder")
    ex.add_argument(
        "--force", "--overwrite", action="store_true", dest="force", help="replace DIR if it exists"
    )
    ex.add_argument("--session", default=None)
    r = p["runs"] = parser(
        "runs",
        "This session's runs, the detached runs (where they run: local pid, k8s) and the other runs the "
        "service has for this key (an earlier kernel's: ended, or orphaned when its kernel went away).",
    )
    r.add_argument(
        "--prune",
        action="store_true",
        help="forget this key's runs that nothing drives any more (ended, or orphaned: an earlier "
        "kernel's); their saved checkpoints stay; detached runs and this kernel's are kept",
    )
    r.add_argument("--session", default=None)
    lg = p["logs"] = parser("logs", "A detached run's log: a line per step, its state changes and messages.")
    lg.add_argument("run", help="the detached run's (job's) name, as %%openrl runs lists it")
    lg.add_argument("--lines", type=int, default=40, help="how many of the last lines (0: all)")
    lg.add_argument("--chars", type=int, default=200_000, help="read at most this much of the log's end")
    lg.add_argument("--session", default=None)
    for verb, desc in (
        ("dashboard", "The service-wide dashboard: every run of this key plus device utilisation."),
        ("sessions", "The open connections."),
    ):
        v = p[verb] = parser(verb, desc)
        v.add_argument("--session", default=None)
    st = p["status"] = parser("status", "The service, or one run, in a few lines.")
    st.add_argument("run", nargs="?", default=None, help="a run's name (default: the whole service)")
    st.add_argument("--session", default=None)
    k = p["token"] = parser(
        "token",
        "Mint a tml- key for the Tinker SDK as your JupyterHub user and export it in this kernel as "
        "TINKER_API_KEY (never shown); 'list' your keys, 'revoke ID' one.",
    )
    k.add_argument(
        "action",
        nargs="?",
        default="mint",
        choices=("mint", "list", "revoke"),
        metavar="mint|list|revoke",
        help="mint a key (the default), list yours, or revoke one",
    )
    k.add_argument(
        "id", nargs="?", default=None, metavar="ID", help="the key id to revoke (see %%openrl token list)"
    )
    k.add_argument("--name", default=None, help="a label for the new key")
    k.add_argument("--session", default=None)
    at = p["attach"] = parser(
        "attach",
        "A detached run (by its name, or a sweep's job), or any run of this key: its whole history "
        "from the service and a live dashboard.",
    )
    at.add_argument("name", help="the detached run's (job's) name, as %%openrl runs lists it")
    at.add_argument("--session", default=None)
    d = p["disconnect"] = parser(
        "disconnect", "Close a connection (an embedded service this kernel started stops; its data stay)."
    )
    d.add_argument("name", nargs="?", default=None, help="the connection's name (default: the only one)")
    d.add_argument(
        "--stop-service",
        action="store_true",
        dest="stop_service",
        help="also stop the embedded service, even a detached one or another kernel's (its data stay)",
    )
    h = p["help"] = parser("help", "This text, or one subcommand's options: %openrl help train.")
    h.add_argument("verb", nargs="?", default=None, metavar="SUBCOMMAND", help="the subcommand to explain")
    for v in p.values():  # every verb that picks a connection says how
        for action in v._actions:
            if action.dest == "session" and not action.help:
                action.help = "the connection to use, by name (default: the only open one)"
    return p


HELP_INTRO = """Train LLMs with RL from this notebook against an openrl service.

Subcommands (``%openrl VERB --help`` shows each one's options):
"""
REWARD_CELL = """  %%openrl reward NAME
        run the cell and register its reward(prompt, completion, **info) -> float (or
        reward_group(prompts, completions, infos) -> list) as the next version of NAME"""
ENV_CELL = """  %%openrl env NAME
        run the cell and register its env(prompt, info) -> Env | MessageEnv (a factory: a function or
        a class) as the next version of environment NAME (openrl_jupyter.env)"""
HELP_OUTRO = "\n\nOptions that pick a connection: --session NAME (the only open one is the default).\n"


def help_text(parsers: dict[str, MagicArgumentParser]) -> str:
    """The ``%openrl`` manual, written from the parsers themselves (so it names every option)."""
    parts = [HELP_INTRO]
    for verb, parser in parsers.items():
        # IPython's parsers write usage as reST (":: %%openrl ..."); the manual shows what one types
        usage = " ".join(parser.format_usage().split()).removeprefix("usage: ").removeprefix(":: ")
        usage = usage.replace("%%openrl", "%openrl").replace(" [-h]", "")
        if verb == "train":
            usage = "run = " + usage
        if verb == "sweep":
            usage = "sweep = " + usage
        parts.append(_wrap(re.findall(r"\[[^\]]*\]|\S+", usage), 100, "  ", "      "))
        parts.append("        " + (parser.description or ""))
        if verb == "connect":
            parts.append(REWARD_CELL)
            parts.append(ENV_CELL)
    return "\n".join(parts) + HELP_OUTRO


def _wrap(tokens: list[str], width: int, first: str, rest: str) -> str:
    """Join ``tokens`` with spaces into lines of at most ``width`` (an option never splits)."""
    lines = [first]
    for token in tokens:
        if len(lines[-1]) + 1 + len(token) > width and lines[-1].strip():
            lines.append(rest)
        lines[-1] += ("" if lines[-1] in (first, rest) else " ") + token
    return "\n".join(lines)
