"""Tool calls in a model's text, per model family: one parser, shared by the notebook's environments and
the service's ``/v1`` and Anthropic endpoints, so a call reads the same wherever the model made it.

Families (``FAMILIES``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, text
  around them is content (the Qwen2.5 and SmolLM families; the service's installed tools template).
- ``llama3``: the reply is the call itself, ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``; several calls separated by ``;``), as Llama 3.1-3.3's templates ask for.

A malformed call is never an exception: :class:`ParsedReply` lists it in ``errors`` with what was wrong,
so an environment can show it to the model as an observation and an endpoint can return the text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("hermes", "llama3")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


class ToolFormatError(ValueError):
    """The model's family has no tool-call parser here (the message names the family and the ones
    that have one)."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedReply:
    """A reply split into its text and its calls; ``errors`` says why any call could not be read."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def _call_of(obj: Any, args_key: str, where: str) -> tuple[ToolCall | None, str | None]:
    if not isinstance(obj, dict):
        return None, f"{where}: a call must be a JSON object; got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f'{where}: a call needs a string "name"'
    other = "parameters" if args_key == "arguments" else "arguments"  # models mix the two names
    args = obj.get(args_key, obj.get(other))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None, f'{where}: "{args_key}" of {name} is not JSON: {args[:100]!r}'
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None, f'{where}: "{args_key}" of {name} must be a JSON object; got {type(args).__name__}'
    return ToolCall(name=name, arguments=args), None


def parse_hermes(text: str) -> ParsedReply:
    """``<tool_call>`` blocks out of ``text``; the text outside them (stripped) is the content."""
    calls, errors, content = [], [], []
    pos = 0
    for i, m in enumerate(_HERMES_BLOCK.finditer(text)):
        content.append(text[pos : m.start()])
        pos = m.end()
        where = f"tool call {i + 1}"
        if not m.group(2):
            errors.append(f"{where}: {HERMES_OPEN} is never closed with {HERMES_CLOSE}")
            continue
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except ValueError as e:
            errors.append(f"{where}: not JSON ({e.msg} at character {e.pos}): {body[:200]!r}")
            continue
        call, error = _call_of(obj, "arguments", where)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)  # type: ignore[arg-type]
    content.append(text[pos:])
    return ParsedReply(content="".join(content).strip(), calls=calls, errors=errors)


def parse_llama3(text: str) -> ParsedReply:
    """A reply that is a JSON call (or calls joined by ``;``); any other reply is content."""
    body = text.strip()
    tagged = body.startswith(LLAMA3_TAG)
    body = body.removeprefix(LLAMA3_TAG).strip()
    if not body.startswith("{"):
        return ParsedReply(content=text.strip())
    decoder = json.JSONDecoder()
    calls, errors, pos, i = [], [], 0, 0
    while pos < len(body):
        i += 1
        where = f"tool call {i}"
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError as e:
            if not tagged and i == 1 and '"name"' not in body[:200]:
                return ParsedReply(content=text.strip())  # JSON-looking prose, not a call
            errors.append(f"{where}: not JSON ({e.msg} at character {e.pos}): {body[pos : pos + 200]!r}")
            break
        if not tagged and i == 1 and not (isinstance(obj, dict) and "name" in obj):
            return ParsedReply(content=text.strip())  # a JSON answer, not a call
        call, error = _call_of(obj, "parameters", where)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)  # type: ignore[arg-type]
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return ParsedReply(content="", calls=calls, errors=errors)


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3}


def parse(text: str, family: str) -> ParsedReply:
    """The calls in ``text`` for a model of ``family`` (one of ``FAMILIES``)."""
    parser = PARSERS.get(family)
    if parser is None:
        raise ToolFormatError(
            f"no tool-call parser for the {family!r} format (parsers: {', '.join(FAMILIES)})"
        )
    return parser(text)


def call_prefix(family: str, name: str | None) -> str:
    """The start of a call that forces the model to call ``name`` (any function when None): what
    ``tool_choice`` "required" or a named function appends to the generation prompt."""
    if family == "hermes":
        return f'{HERMES_OPEN}\n{{"name": "{name}", "arguments": ' if name else f'{HERMES_OPEN}\n{{"name": "'
    if family == "llama3":
        return f'{{"name": "{name}", "parameters": ' if name else '{"name": "'
    raise ToolFormatError(f"no tool-call parser for the {family!r} format (parsers: {', '.join(FAMILIES)})")


def call_start(family: str) -> str:
    """The text that begins a call in this family's replies (where streamed content must pause)."""
    return HERMES_OPEN if family == "hermes" else "{"


def detect_family(rendered_call: str, template: str) -> str | None:
    """Which family a chat template writes tool calls in, from an assistant tool call it rendered
    (``rendered_call``) and its source; None when it is neither."""
    if HERMES_OPEN in rendered_call:
        return "hermes"
    if LLAMA3_TAG in template or ('"parameters"' in rendered_call and "<|start_header_id|>" in template):
        return "llama3"
    return None


def check_tools(tools: Any, field_name: str = "tools") -> list[dict]:
    """OpenAI-form tools (``{"type": "function", "function": {name, description?, parameters?}}``)
    checked and rebuilt in one key order, so equal tools render to equal tokens; errors name the field."""
    if not isinstance(tools, list):
        raise ValueError(f"{field_name} must be a list of {{type: function, function: {{name, parameters}}}}")
    out, names = [], set()
    for i, t in enumerate(tools):
        where = f"{field_name}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ValueError(f"{where} must be {{type: 'function', function: {{...}}}}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object {{name, description, parameters}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(
                f"{where}.function.name must be 1-64 characters of A-Z a-z 0-9 _ . -; got {name!r}"
            )
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        spec: dict[str, Any] = {"name": name}
        desc = fn.get("description")
        if desc is not None:
            if not isinstance(desc, str):
                raise ValueError(f"{where}.function.description must be a string")
            spec["description"] = desc
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        spec["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": spec})
    return out
