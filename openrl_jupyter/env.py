"""Environments for multi-turn RL from a notebook, in tinker-cookbook's shape: a cookbook ``Env`` runs
unchanged apart from its import line.

    from openrl_jupyter.env import Env, StepResult, ModelInput

    class Guess(Env):                      # token level: observations and actions are token ids
        async def initial_observation(self):
            return ModelInput.from_ints(self.prompt_tokens), self.stop
        async def step(self, action, *, extra=None):
            ...
            return StepResult(reward=1.0, episode_done=True, next_observation=ModelInput.from_ints([]),
                              next_stop_condition=self.stop, metrics={"tool_calls": 1})

A ``MessageEnv`` works in chat messages instead (the conversation in, the model's message out, tool calls
parsed); ``EnvFromMessageEnv`` turns it into an ``Env`` with a :class:`Renderer`, which renders through
the service's chat template (``/openrl/v1/render``). Environments run in this kernel (or a detached job),
never on the service; ``oj.env(NAME)`` and ``%%openrl env NAME`` register a factory ``(prompt, info) ->
env`` per dataset row, versioned and re-definable mid-run as rewards are. Rollouts and training:
openrl_jupyter/rollouts.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from openrl_common.toolcalls import ParsedReply, parse
from openrl_jupyter.rewards import RewardRegistry

StopCondition: TypeAlias = "list[str] | list[int]"
Action: TypeAlias = "list[int]"
Message: TypeAlias = "dict[str, Any]"
Metrics: TypeAlias = "dict[str, float | int]"


class ModelInput:
    """Token ids the model reads (``tinker.ModelInput``'s text-only subset: ``from_ints``, ``to_ints``,
    ``length``, ``append_int``, ``empty``). Anything with ``to_ints()`` (a ``tinker.ModelInput``) is
    accepted wherever one is."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens = [int(t) for t in tokens]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls(tokens)

    @classmethod
    def empty(cls) -> ModelInput:
        return cls()

    def to_ints(self) -> list[int]:
        return list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def append_int(self, token: int) -> ModelInput:
        return ModelInput([*self.tokens, token])

    def __eq__(self, other: object) -> bool:
        return hasattr(other, "to_ints") and list(other.to_ints()) == self.tokens  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"ModelInput({len(self.tokens)} tokens)"


def tokens_of(observation: Any) -> list[int]:
    """An observation's token ids (a ModelInput, a tinker.ModelInput or a list of ints)."""
    if hasattr(observation, "to_ints"):
        return [int(t) for t in observation.to_ints()]
    if isinstance(observation, (list, tuple)) and all(isinstance(t, int) for t in observation):
        return list(observation)
    raise TypeError(f"an observation must be a ModelInput (or token ids); got {type(observation).__name__}")


@dataclass
class StepResult:
    """What :meth:`Env.step` returns (tinker-cookbook's fields)."""

    reward: float
    episode_done: bool
    next_observation: Any  # ModelInput
    next_stop_condition: Any  # StopCondition
    metrics: dict = field(default_factory=dict)
    logs: dict = field(default_factory=dict)


class Env(ABC):
    """One episode's environment (single use): an initial observation, then a step per model turn."""

    @abstractmethod
    async def initial_observation(self) -> tuple[Any, Any]:
        """(ModelInput, StopCondition) of the first turn."""

    @abstractmethod
    async def step(self, action: list[int], *, extra: dict | None = None) -> StepResult:
        """The model's tokens (``action``) in; the reward, whether it is over, the next observation."""


@dataclass
class MessageStepResult:
    """What :meth:`MessageEnv.step` returns: ``next_messages`` is the whole conversation so far."""

    reward: float
    episode_done: bool
    next_messages: list[dict]
    metrics: dict = field(default_factory=dict)
    logs: dict = field(default_factory=dict)
    next_stop_condition: Any = None


class MessageEnv(ABC):
    """An environment in chat messages. ``tools`` (OpenAI-form JSON-schema functions) are offered to the
    model through the chat template; the model's message reaches ``step`` with ``tool_calls`` parsed."""

    tools: list[dict] = []

    @abstractmethod
    async def initial_observation(self) -> list[dict]:
        """The conversation the model answers first."""

    @abstractmethod
    async def step(self, message: dict) -> MessageStepResult:
        """The model's message in (``content``, ``tool_calls``, ``parse_errors``)."""


class Renderer:
    """Messages to tokens and back with the served model's chat template: ``build_generation_prompt``,
    ``get_stop_sequences``, ``parse_response`` (tinker-cookbook's renderer methods; ``a``-prefixed
    ones for a coroutine). Tool calls are read in the model family's format (openrl_common/toolcalls.py)."""

    def __init__(self, session: Any, model: str | None = None):
        self.session, self.model = session, model  # a Session (openrl_jupyter.get_session())
        self._stop: list[int] | None = None
        self.tool_family: str | None = None

    def _rendered(self, reply: dict) -> ModelInput:
        self._stop = list(reply.get("stop_tokens") or [])
        self.tool_family = reply.get("tool_family")
        return ModelInput(reply["tokens"])

    def build_generation_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> ModelInput:
        return self._rendered(self.session.client.render(_plain(messages), tools or None, self.model))

    async def abuild_generation_prompt(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> ModelInput:
        client = self.session.async_client()
        return self._rendered(await client.render(_plain(messages), tools or None, self.model))

    def get_stop_sequences(self) -> list[int]:
        """The end-of-turn token ids (known once a prompt has been built)."""
        if self._stop is None:
            self.build_generation_prompt([{"role": "user", "content": ""}])
        return list(self._stop or [])

    def _message(self, tokens: list[int], text: str) -> tuple[dict, bool]:
        stop = set(self._stop or [])
        ended = bool(tokens) and tokens[-1] in stop
        parsed = parse(text, self.tool_family) if self.tool_family else ParsedReply(content=text)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed.content if self.tool_family else text,
        }
        if parsed.calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_json()},
                }
                for c in parsed.calls
            ]
        if parsed.errors:
            message["parse_errors"] = list(parsed.errors)
        return message, ended and parsed.ok

    def parse_response(self, tokens: list[int]) -> tuple[dict, bool]:
        """The model's tokens as an assistant message, and whether it ended cleanly (its end-of-turn
        token, every tool call well formed)."""
        body = _without_stop(tokens, self._stop)
        return self._message(tokens, self.session.client.decode(body, self.model)["text"])

    async def aparse_response(self, tokens: list[int]) -> tuple[dict, bool]:
        body = _without_stop(tokens, self._stop)
        reply = await self.session.async_client().decode(body, self.model)
        return self._message(tokens, reply["text"])


def _without_stop(tokens: list[int], stop: list[int] | None) -> list[int]:
    return tokens[:-1] if tokens and stop and tokens[-1] in stop else list(tokens)


def _plain(messages: list[dict]) -> list[dict]:
    """Messages as the service takes them (only the keys a chat template reads)."""
    keep = ("role", "content", "tool_calls", "tool_call_id", "name")
    return [{k: m[k] for k in keep if k in m} for m in messages]


class EnvFromMessageEnv(Env):
    """A :class:`MessageEnv` as a token-level :class:`Env`: each turn rendered by the ``renderer``; tool
    calls and malformed calls counted in the turn's metrics (``tool_calls``, ``tool_errors``)."""

    def __init__(self, env: MessageEnv, renderer: Renderer):
        self.env, self.renderer = env, renderer
        self.tools = list(getattr(env, "tools", None) or [])

    async def initial_observation(self) -> tuple[ModelInput, list[int]]:
        messages = await self.env.initial_observation()
        ob = await self.renderer.abuild_generation_prompt(messages, self.tools)
        return ob, self.renderer.get_stop_sequences()

    async def step(self, action: list[int], *, extra: dict | None = None) -> StepResult:
        message, _ = await self.renderer.aparse_response(action)
        result = await self.env.step(message)
        ob = (
            ModelInput.empty()
            if result.episode_done
            else await self.renderer.abuild_generation_prompt(result.next_messages, self.tools)
        )
        metrics = {
            "tool_calls": len(message.get("tool_calls") or []),
            "tool_errors": len(message.get("parse_errors") or []),
            **result.metrics,
        }
        stop = result.next_stop_condition or self.renderer.get_stop_sequences()
        return StepResult(result.reward, result.episode_done, ob, stop, metrics, result.logs)


class ToolEnv(MessageEnv):
    """A message environment whose tools are Python functions: the model's calls run here (in the
    kernel), their results (or errors) go back as ``tool`` messages, a malformed call is shown to the
    model as an error to fix; the episode ends when the model answers without a call, scored by
    ``score(answer, info) -> float``, or after ``max_turns`` turns (reward 0).

        env = ToolEnv(prompt, tools={"run_sql": run_sql}, schemas=[...], score=check, info=info)
    """

    def __init__(
        self,
        prompt: str | list[dict],
        *,
        tools: dict[str, Callable[..., Any]],
        schemas: list[dict],
        score: Callable[[str, dict], float],
        info: dict | None = None,
        max_turns: int = 4,
        system: str | None = None,
    ):
        self.functions, self.tools, self.score = tools, schemas, score
        self.info, self.max_turns = dict(info or {}), max_turns
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        self.messages = messages
        self.turns = 0

    async def initial_observation(self) -> list[dict]:
        return list(self.messages)

    async def step(self, message: dict) -> MessageStepResult:
        self.turns += 1
        calls = message.get("tool_calls") or []
        errors = message.get("parse_errors") or []
        self.messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")})
        if not calls and not errors:  # an answer: the episode is over
            reward = await asyncio.to_thread(self.score, message.get("content") or "", self.info)
            return MessageStepResult(float(reward), True, self.messages, {"answered": 1})
        results = []
        for error in errors:
            results.append(
                {"role": "tool", "content": f"error: {error}. Write the call as the tools block shows."}
            )
        failed = 0
        for call in calls:
            fn = self.functions.get(call["function"]["name"])
            try:
                if fn is None:
                    raise KeyError(
                        f"no tool named {call['function']['name']!r}; tools: {', '.join(self.functions)}"
                    )
                out = await asyncio.to_thread(fn, **json.loads(call["function"]["arguments"] or "{}"))
                content = out if isinstance(out, str) else json.dumps(out, default=str)
            except Exception as e:  # noqa: BLE001 - a failing tool is the model's observation
                failed += 1
                content = f"error: {type(e).__name__}: {e}"
            results.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": content})
        self.messages.extend(results)
        done = self.turns >= self.max_turns
        return MessageStepResult(0.0, done, self.messages, {"tool_failures": failed, "answered": 0})


envs = RewardRegistry(kind="environment")


def env(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register a factory ``(prompt, info) -> Env | MessageEnv`` (a function or a class) as
    the next version of environment ``name``; runs started with ``env=name`` pick it up at their next step."""

    def register(factory: Callable) -> Callable:
        envs.register(name, factory)
        return factory

    return register


class _CallableModule(types.ModuleType):
    """This module, callable: ``openrl_jupyter.env(NAME)`` is :func:`env` (as ``openrl_jupyter.reward(NAME)``
    is the reward decorator), while ``from openrl_jupyter.env import Env, StepResult`` imports from it."""

    def __call__(self, name: str) -> Callable[[Callable], Callable]:
        return env(name)


sys.modules[__name__].__class__ = _CallableModule
