"""Reward functions: a versioned registry, and scoring that never blocks the network loop.

    @openrl_jupyter.reward("letters")
    def reward(prompt, completion, **info):
        return sum(c.isalpha() for c in completion) / max(1, len(completion))

Registering a name again makes the next version; a run picks up the newest version at its next
step. A reward is either per sample, ``reward(prompt, completion, **info) -> float``, or per group,
``reward_group(prompts, completions, infos) -> list[float]``, and may be ``async def`` (awaited on
the caller's loop). Plain functions run in a scoring thread pool, so one run's slow reward never
stalls another's requests. A sample whose reward raises or returns something that is not a finite
number is marked failed with the error, and is left out of the advantages; what the reward prints
is captured per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import html
import inspect
import io
import math
import numbers
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from openrl_jupyter._exceptions import UsageError
from openrl_jupyter.summary import clip

SAMPLE_CHARS = 200  # a failing sample's prompt and completion, as shown


@dataclass(frozen=True)
class RewardVersion:
    name: str
    version: int
    fn: Callable[..., Any]
    per_group: bool
    is_async: bool
    kind: str = "reward"  # or "environment" (openrl_jupyter/env.py): the same versioning and failures


@dataclass
class Scored:
    """One step's rewards: ``rewards[i]`` is None where sample i failed (``errors[i]`` says why)."""

    rewards: list[float | None]
    errors: list[str | None]
    stdout: str = ""
    traceback: str | None = None  # the first failure's traceback, shown when a whole step fails
    version: RewardVersion | None = field(default=None, repr=False)

    @property
    def all_failed(self) -> bool:
        return all(r is None for r in self.rewards)

    def failure(
        self, *, run: str, step: int, prompts: Sequence[str], completions: Sequence[str]
    ) -> RewardFailure | None:
        """The step's reward failure, with the first sample that failed (None when none did)."""
        first = next((i for i, e in enumerate(self.errors) if e is not None), None)
        if first is None or self.version is None:
            return None
        return RewardFailure(
            run=run,
            reward=self.version.name,
            version=self.version.version,
            step=step,
            error=str(self.errors[first]),
            prompt=str(prompts[first]),
            completion=str(completions[first]),
            failed=sum(e is not None for e in self.errors),
            n=len(self.errors),
            paused=self.all_failed,
            traceback=self.traceback,
            kind=self.version.kind,
        )


FAILURE_BOX = (
    "border:1px solid #cf222e;border-left:4px solid #cf222e;background:rgba(207,34,46,0.08);"
    "padding:6px 10px;margin:4px 0;border-radius:4px"
)


@dataclass(frozen=True)
class RewardFailure:
    """A reward that raised (or returned no finite number) on some of a step's samples: what the cell
    that started the run and its dashboard show at once, with one sample that triggered it.

        run.reward_failure            # the last one (None while the reward never failed)
        run.reward_failure.error      # "ZeroDivisionError: division by zero"
    """

    run: str
    reward: str
    version: int
    step: int
    error: str  # the exception, one line ("ZeroDivisionError: division by zero"), or what was returned
    prompt: str  # the first failing sample's prompt and completion
    completion: str
    failed: int  # how many of the step's n samples failed
    n: int
    paused: bool  # every sample failed: the run paused on this step
    traceback: str | None = None  # the user's frames only
    kind: str = "reward"  # "environment": an episode raised

    @property
    def headline(self) -> str:
        return (
            f"openrl run {self.run!r}: {self.kind} {self.reward} v{self.version} failed on "
            f"{self.failed} of {self.n} samples at step {self.step}: {self.error}"
        )

    @property
    def consequence(self) -> str:
        if self.paused:
            return f"the run is paused: fix the {self.kind}, then run.resume() (run.wait() raises RunPaused)"
        return "those samples are left out of the update; the run goes on"

    def text(self) -> str:
        lines = [
            self.headline,
            f"  {self.consequence}",
            f"  sample prompt:     {clip(self.prompt, SAMPLE_CHARS)!r}",
            f"  sample completion: {clip(self.completion, SAMPLE_CHARS)!r}",
        ]
        if self.traceback:
            lines.append(self.traceback)
        return "\n".join(lines)

    def html(self) -> str:
        """A red box (escaped HTML): headline, consequence, the sample, the traceback folded."""
        e = html.escape
        cell = "text-align:left;white-space:pre-wrap;font-family:monospace;padding:1px 6px"
        trace = (
            f"<details><summary>traceback</summary><pre style='margin:0'>{e(self.traceback)}</pre></details>"
            if self.traceback
            else ""
        )
        return (
            f"<div class='openrl-reward-failure' style='{FAILURE_BOX}'>"
            f"<b>{e(self.kind)} {e(self.reward)} v{self.version} failed</b> on {self.failed} of {self.n} samples"
            f" at step {self.step} of run <b>{e(self.run)}</b>: <code>{e(self.error)}</code>"
            f"<br>{e(self.consequence)}"
            "<table style='margin:4px 0'>"
            f"<tr><th style='text-align:left'>prompt</th><td style='{cell}'>{e(clip(self.prompt, SAMPLE_CHARS))}</td></tr>"
            f"<tr><th style='text-align:left'>completion</th><td style='{cell}'>"
            f"{e(clip(self.completion, SAMPLE_CHARS))}</td></tr>"
            f"</table>{trace}</div>"
        )

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self.html()}


class RewardRegistry:
    """Versions by name: rewards (``registry``), or environments (``kind="environment"``: factories,
    openrl_jupyter/env.py)."""

    def __init__(self, kind: str = "reward") -> None:
        self.kind = kind
        self._versions: dict[str, list[RewardVersion]] = {}
        self._lock = threading.Lock()

    def register(
        self, name: str, fn: Callable[..., Any], *, per_group: bool | None = None, version: int | None = None
    ) -> RewardVersion:
        """The next version of ``name`` (``version``: that number, when it is past the newest; a
        detached job's worker keeps the notebook's numbering)."""
        if not isinstance(name, str) or not name.isidentifier():
            raise UsageError(f"{self.kind} name must be an identifier (letters, digits, _); got {name!r}")
        if self.kind == "reward":
            per_group, is_async = _kind(name, fn, per_group)
        elif not callable(fn):
            raise UsageError(f"{self.kind} {name}: give a factory (prompt, info) -> environment; got {fn!r}")
        else:
            per_group, is_async = False, False
        with self._lock:
            versions = self._versions.setdefault(name, [])
            number = len(versions) + 1
            if (
                version is not None
                and versions
                and version > versions[-1].version
                or version is not None
                and not versions
                and version >= 1
            ):
                number = version
            elif versions:
                number = versions[-1].version + 1
            v = RewardVersion(name, number, fn, per_group, is_async, self.kind)
            versions.append(v)
        return v

    def latest(self, name: str) -> RewardVersion:
        with self._lock:
            versions = self._versions.get(name)
            if not versions:
                known = ", ".join(sorted(self._versions)) or "none yet"
                cell = "reward" if self.kind == "reward" else "env"
                raise UsageError(
                    f"unknown {self.kind} {name!r} (registered: {known}); define it with %%openrl {cell} {name}"
                )
            return versions[-1]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._versions)


registry = RewardRegistry()


def pinned(fn: Callable[..., Any]) -> RewardVersion:
    """A reward function given to one run (``train(reward=fn)``): checked like a registered one,
    but kept by that run alone, so another run's function, or a ``%%openrl reward`` of the same
    name, never replaces it. Named after the function (``lambda`` for a lambda), version 1."""
    name = getattr(fn, "__name__", "") or "reward"
    name = "lambda" if name == "<lambda>" else name
    per_group, is_async = _kind(name, fn, None)
    return RewardVersion(name, 1, fn, per_group, is_async)


def _kind(name: str, fn: Callable[..., Any], per_group: bool | None) -> tuple[bool, bool]:
    """(per_group, is_async) of a reward function, after checking it can take its arguments."""
    if not callable(fn):
        raise UsageError(f"reward {name!r} must be a function; got {type(fn).__name__}")
    if per_group is None:
        per_group = getattr(fn, "__name__", "") == "reward_group"
    _check_signature(name, fn, per_group)
    return per_group, inspect.iscoroutinefunction(fn)


def _check_signature(name: str, fn: Callable[..., Any], per_group: bool) -> None:
    """A reward that cannot take the arguments it will get is refused now, not at a run's next step."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some callables have no signature: trust them
    try:
        if per_group:
            sig.bind([], [], [])
        else:
            sig.bind("prompt", "completion")
    except TypeError as e:
        want = (
            "reward_group(prompts, completions, infos) -> list[float]"
            if per_group
            else "reward(prompt, completion, **info) -> float"
        )
        raise UsageError(f"reward {name!r} has the signature {name}{sig} ({e}); it must be {want}") from None


def reward(name: str, *, per_group: bool | None = None) -> Callable[[Callable], Callable]:
    """Decorator: register the function as the next version of reward ``name``."""

    def register(fn: Callable) -> Callable:
        registry.register(name, fn, per_group=per_group)
        return fn

    return register


# -- stdout capture that works across threads and tasks ----------------------------------------------
_task_buffer: contextvars.ContextVar[io.StringIO | None] = contextvars.ContextVar(
    "openrl_reward_out", default=None
)


class _ThreadStdout:
    """Routes writes of threads (and asyncio tasks) that asked for a capture into their buffer;
    everything else, and every other attribute (a kernel's ``set_parent``, ``fileno``...), goes to
    the original stream."""

    def __init__(self, original) -> None:
        self.original = original
        self.buffers: dict[int, io.StringIO] = {}

    def write(self, s: str) -> int:
        buf = _task_buffer.get() or self.buffers.get(threading.get_ident())
        return buf.write(s) if buf is not None else self.original.write(s)

    def flush(self) -> None:
        self.original.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)


_stdout_lock = threading.Lock()


def _router() -> _ThreadStdout:
    with _stdout_lock:
        if not isinstance(sys.stdout, _ThreadStdout):
            sys.stdout = _ThreadStdout(sys.stdout)
        return sys.stdout


@contextlib.contextmanager
def _capture() -> Any:
    router = _router()
    buf = io.StringIO()
    router.buffers[threading.get_ident()] = buf
    try:
        yield buf
    finally:
        router.buffers.pop(threading.get_ident(), None)


def _check(value: Any) -> tuple[float | None, str | None]:
    """Any real number counts (numpy scalars too; a bool is 0 or 1); the value must be finite."""
    if not isinstance(value, numbers.Real):
        return None, f"returned {value!r}, not a number"
    value = float(value)
    if not math.isfinite(value):
        return None, f"returned {value!r}, not a finite number"
    return value, None


def _error(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _traceback(exc: BaseException) -> str:
    """The traceback without this module's frames: only the user's reward code."""
    frames = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in frames if f.filename != __file__]
    return "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) + _error(exc)


class _Collector:
    """Fills ``rewards``/``errors`` slot by slot and keeps the first failure's traceback."""

    def __init__(self, n: int) -> None:
        self.rewards: list[float | None] = [None] * n
        self.errors: list[str | None] = ["not scored"] * n
        self.traceback: str | None = None

    def value(self, i: int, value: Any) -> None:
        self.rewards[i], self.errors[i] = _check(value)

    def failed(self, idx: Sequence[int], exc: BaseException) -> None:
        for i in idx:
            self.rewards[i], self.errors[i] = None, _error(exc)
        self.traceback = self.traceback or _traceback(exc)

    def group(self, idx: Sequence[int], values: Any) -> None:
        values = list(values)
        if len(values) != len(idx):
            self.failed(idx, ValueError(f"reward_group returned {len(values)} values for {len(idx)} samples"))
            return
        for i, value in zip(idx, values, strict=True):
            self.value(i, value)


def _pick(seq: Sequence, idx: Sequence[int]) -> list:
    return [seq[i] for i in idx]


def _score_sync(v: RewardVersion, prompts, completions, infos, groups) -> Scored:
    """Runs in a pool thread: the whole step's calls, with stdout captured."""
    out = _Collector(len(prompts))
    with _capture() as buf:
        if v.per_group:
            for idx in groups:
                try:
                    out.group(idx, v.fn(_pick(prompts, idx), _pick(completions, idx), _pick(infos, idx)))
                except Exception as exc:  # noqa: BLE001 - the user's code: the group fails with its error
                    out.failed(idx, exc)
        else:
            for i, (p, c, info) in enumerate(zip(prompts, completions, infos, strict=True)):
                try:
                    out.value(i, v.fn(p, c, **info))
                except Exception as exc:  # noqa: BLE001
                    out.failed([i], exc)
    return Scored(out.rewards, out.errors, buf.getvalue(), version=v, traceback=out.traceback)


async def _score_async(v: RewardVersion, prompts, completions, infos, groups) -> Scored:
    out = _Collector(len(prompts))
    buf = io.StringIO()
    _router()

    async def call(*args, **kwargs):
        _task_buffer.set(buf)  # this task's own context: its prints go to the step's buffer
        return await v.fn(*args, **kwargs)

    if v.per_group:
        calls = [call(_pick(prompts, idx), _pick(completions, idx), _pick(infos, idx)) for idx in groups]
        units = list(groups)
    else:
        calls = [call(p, c, **info) for p, c, info in zip(prompts, completions, infos, strict=True)]
        units = [[i] for i in range(len(prompts))]
    results = await asyncio.gather(*calls, return_exceptions=True)
    for idx, result in zip(units, results, strict=True):
        if isinstance(result, Exception):
            out.failed(idx, result)
        elif isinstance(result, BaseException):
            raise result
        elif v.per_group:
            out.group(idx, result)
        else:
            out.value(idx[0], result)
    return Scored(out.rewards, out.errors, buf.getvalue(), version=v, traceback=out.traceback)


async def score(
    v: RewardVersion,
    prompts: Sequence[str],
    completions: Sequence[str],
    infos: Sequence[dict] | None = None,
    *,
    groups: Sequence[Sequence[int]] | None = None,
    pool: Executor | None = None,
) -> Scored:
    """Score one step's samples with reward version ``v``; never blocks the calling loop.

    ``groups`` lists the sample indices of each prompt's group: a ``reward_group`` is called once
    per group (default: the whole step is one group).
    """
    infos = list(infos) if infos is not None else [{} for _ in prompts]
    groups = [list(g) for g in groups] if groups is not None else [list(range(len(prompts)))]
    if v.is_async:
        return await _score_async(v, prompts, completions, infos, groups)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool, _score_sync, v, prompts, completions, infos, groups)
