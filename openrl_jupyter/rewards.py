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
import inspect
import io
import math
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from openrl_jupyter.session import UsageError


@dataclass(frozen=True)
class RewardVersion:
    name: str
    version: int
    fn: Callable[..., Any]
    per_group: bool
    is_async: bool


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


class RewardRegistry:
    def __init__(self) -> None:
        self._versions: dict[str, list[RewardVersion]] = {}
        self._lock = threading.Lock()

    def register(self, name: str, fn: Callable[..., Any], *, per_group: bool | None = None) -> RewardVersion:
        if not isinstance(name, str) or not name.isidentifier():
            raise UsageError(f"reward name must be an identifier (letters, digits, _); got {name!r}")
        if not callable(fn):
            raise UsageError(f"reward {name!r} must be a function; got {type(fn).__name__}")
        if per_group is None:
            per_group = getattr(fn, "__name__", "") == "reward_group"
        is_async = inspect.iscoroutinefunction(fn)
        with self._lock:
            versions = self._versions.setdefault(name, [])
            v = RewardVersion(name, len(versions) + 1, fn, per_group, is_async)
            versions.append(v)
        return v

    def latest(self, name: str) -> RewardVersion:
        with self._lock:
            versions = self._versions.get(name)
            if not versions:
                known = ", ".join(sorted(self._versions)) or "none yet"
                raise UsageError(
                    f"unknown reward {name!r} (registered: {known}); define it with %%openrl reward {name}"
                )
            return versions[-1]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._versions)


registry = RewardRegistry()


def reward(name: str, *, per_group: bool | None = None) -> Callable[[Callable], Callable]:
    """Decorator: register the function as the next version of reward ``name``."""

    def register(fn: Callable) -> Callable:
        registry.register(name, fn, per_group=per_group)
        return fn

    return register


# -- stdout capture that works across threads ---------------------------------------------------------
class _ThreadStdout:
    """Routes writes of threads that asked for a capture into their buffer; everything else, and
    every other attribute (a kernel's ``set_parent``, ``fileno``...), goes to the original stream."""

    def __init__(self, original) -> None:
        self.original = original
        self.buffers: dict[int, io.StringIO] = {}

    def write(self, s: str) -> int:
        buf = self.buffers.get(threading.get_ident())
        return buf.write(s) if buf is not None else self.original.write(s)

    def flush(self) -> None:
        self.original.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)


_stdout_lock = threading.Lock()


@contextlib.contextmanager
def _capture() -> Any:
    with _stdout_lock:
        if not isinstance(sys.stdout, _ThreadStdout):
            sys.stdout = _ThreadStdout(sys.stdout)
        router = sys.stdout
    buf = io.StringIO()
    router.buffers[threading.get_ident()] = buf
    try:
        yield buf
    finally:
        router.buffers.pop(threading.get_ident(), None)


def _check(value: Any) -> tuple[float | None, str | None]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"returned {value!r}, not a number"
    if not math.isfinite(value):
        return None, f"returned {value!r}, not a finite number"
    return float(value), None


def _error(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _traceback(exc: BaseException) -> str:
    """The traceback without this module's frames: only the user's reward code."""
    frames = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in frames if f.filename != __file__]
    return "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) + _error(exc)


def _score_sync(v: RewardVersion, prompts, completions, infos) -> Scored:
    """Runs in a pool thread: the whole step's calls, with stdout captured."""
    rewards: list[float | None] = []
    first_tb: str | None = None
    errors: list[str | None] = []
    with _capture() as out:
        if v.per_group:
            try:
                values = list(v.fn(list(prompts), list(completions), list(infos)))
                if len(values) != len(prompts):
                    raise ValueError(f"reward_group returned {len(values)} values for {len(prompts)} samples")
                for value in values:
                    r, e = _check(value)
                    rewards.append(r)
                    errors.append(e)
            except Exception as exc:  # noqa: BLE001 - the user's code: every sample fails with its error
                rewards, errors = [None] * len(prompts), [_error(exc)] * len(prompts)
                first_tb = _traceback(exc)
        else:
            for p, c, info in zip(prompts, completions, infos, strict=True):
                try:
                    r, e = _check(v.fn(p, c, **info))
                except Exception as exc:  # noqa: BLE001
                    r, e = None, _error(exc)
                    first_tb = first_tb or _traceback(exc)
                rewards.append(r)
                errors.append(e)
    return Scored(rewards, errors, out.getvalue(), version=v, traceback=first_tb)


async def _score_async(v: RewardVersion, prompts, completions, infos) -> Scored:
    rewards: list[float | None] = []
    first_tb: str | None = None
    errors: list[str | None] = []
    if v.per_group:
        try:
            values = list(await v.fn(list(prompts), list(completions), list(infos)))
            if len(values) != len(prompts):
                raise ValueError(f"reward_group returned {len(values)} values for {len(prompts)} samples")
            checked = [_check(x) for x in values]
        except Exception as exc:  # noqa: BLE001
            checked = [(None, _error(exc))] * len(prompts)
            first_tb = _traceback(exc)
    else:
        results = await asyncio.gather(
            *(v.fn(p, c, **info) for p, c, info in zip(prompts, completions, infos, strict=True)),
            return_exceptions=True,
        )
        checked = [(None, _error(x)) if isinstance(x, BaseException) else _check(x) for x in results]
        first_tb = next((_traceback(x) for x in results if isinstance(x, BaseException)), None)
    for r, e in checked:
        rewards.append(r)
        errors.append(e)
    return Scored(rewards, errors, "", version=v, traceback=first_tb)


async def score(
    v: RewardVersion,
    prompts: Sequence[str],
    completions: Sequence[str],
    infos: Sequence[dict] | None = None,
    *,
    pool: ThreadPoolExecutor | None = None,
) -> Scored:
    """Score one step's samples with reward version ``v``; never blocks the calling loop."""
    infos = list(infos) if infos is not None else [{} for _ in prompts]
    if v.is_async:
        return await _score_async(v, prompts, completions, infos)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool, _score_sync, v, prompts, completions, infos)
