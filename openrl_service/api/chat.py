"""A chat request as the model sees it, shared by ``/v1/chat/completions`` and the Anthropic Messages API
(api/anthropic.py): messages (text, tool calls, tool results) checked and rendered through the chat template
with the offered tools; ``tool_choice`` (auto, none, required, one named function); the reply read back
as content and tool calls (openrl_common/toolcalls.py); and the text a streamed reply may send so far.

The same messages and tools render to the same tokens on both endpoints and in
``apply_chat_template(messages, tools=...)`` on the tokenizer the hub mirror serves. ``required`` and a
named function start the reply with the family's call prefix (``<tool_call>\\n{"name": "`` ...), so the
model completes a call rather than being asked for one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from openrl_common.toolcalls import (
    HERMES_OPEN,
    LLAMA3_TAG,
    ParsedReply,
    ToolFormatError,
    call_prefix,
    check_tools,
    parse,
)
from openrl_service.errors import UserError
from openrl_service.sampling.base import SamplingParams


@dataclass(frozen=True)
class ChatPrompt:
    """The prompt's tokens; ``family``: read the reply for calls in this format (None: text only);
    ``forced``: the start of a call appended to the prompt (its text begins the reply)."""

    tokens: list[int]
    family: str | None = None
    forced: str = ""


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined (``where`` names the content field;
    the Anthropic API's text blocks are the same shape)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise UserError(f"{where}[{j}]: only text parts are supported by this service", field=where)
            parts.append(part["text"])
        return "".join(parts)
    raise UserError(f"{where} must be a string or text parts", field=where)


def _arguments(value: Any, where: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise UserError(
                f"{where} must be a JSON object (as a string); got {value[:100]!r}", field=where
            ) from None
    if not isinstance(value, dict):
        raise UserError(f"{where} must be a JSON object", field=where)
    return value


def openai_messages(messages: Any) -> list[dict]:
    """OpenAI chat messages checked and normalised for the template: text content, an assistant's
    ``tool_calls`` with their arguments as objects, ``tool`` results as text."""
    if not isinstance(messages, list) or not messages:
        raise UserError("messages must be a non-empty list of {role, content}", field="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(f"{where} must be an object with a string role", field=where)
        role = m["role"]  # any role the template takes (tool, ipython...): the template decides
        msg: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": text_of(m.get("content"), f"{where}.content"),
        }
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant":
                raise UserError(
                    f"{where}.tool_calls: only an assistant message makes tool calls",
                    field=f"{where}.tool_calls",
                )
            if not isinstance(calls, list):
                raise UserError(f"{where}.tool_calls must be a list", field=f"{where}.tool_calls")
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                cw = f"{where}.tool_calls[{j}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise UserError(
                        f"{cw} must be {{id, type: function, function: {{name, arguments}}}}", field=cw
                    )
                msg["tool_calls"].append(
                    {
                        "id": str(c.get("id") or f"call_{i}_{j}"),
                        "type": "function",
                        "function": {
                            "name": fn["name"],
                            "arguments": _arguments(fn.get("arguments", {}), f"{cw}.function.arguments"),
                        },
                    }
                )
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    return out


def tool_choice(value: Any, tools: list[dict], field: str = "tool_choice") -> tuple[str, str | None]:
    """(mode, name): mode is auto, none or required; name the function a named choice forces."""
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise UserError(f"{field}: 'required' needs tools", field=field)
        return value, None
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
    ):
        name = value["function"].get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise UserError(f"{field}: {name!r} is not one of the tools", field=field)
        return "required", name
    raise UserError(
        f"{field} must be 'auto', 'none', 'required' or {{type: function, function: {{name}}}}", field=field
    )


def checked_tools(value: Any, field: str = "tools") -> list[dict]:
    if value is None:
        return []
    try:
        return check_tools(value, field)
    except ValueError as e:
        raise UserError(str(e), field=field) from None


def render(
    base: Any, messages: list[dict], tools: list[dict], mode: str, name: str | None, field: str = "messages"
) -> ChatPrompt:
    """The prompt's tokens (on a worker thread: templates and tokenizers are work)."""
    tok = base.tokenizer
    offered = tools if mode != "none" else []
    uses_tools = offered or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if uses_tools and base.tool_family is None:
        raise UserError(
            f"tools: {base.name}'s chat template has no tool-call format this service parses "
            f"(it parses hermes <tool_call> JSON and Llama 3 JSON calls)",
            field="tools",
        )
    try:
        text = tok.apply_chat_template(
            messages, tools=offered or None, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # noqa: BLE001 - the template refused these messages (roles, order)
        raise UserError(f"{field}: {base.name}'s chat template refused them: {e}", field=field) from None
    forced = ""
    if mode == "required" and offered:
        try:
            forced = call_prefix(base.tool_family, name)
        except ToolFormatError as e:
            raise UserError(f"tool_choice: {e}", field="tool_choice") from None
    return ChatPrompt(
        tokens=list(tok.encode(text + forced, add_special_tokens=False)),
        family=base.tool_family if offered else None,
        forced=forced,
    )


def read_reply(text: str, prompt: ChatPrompt) -> ParsedReply:
    """The reply's content and calls (plain text when no tools were offered)."""
    if prompt.family is None:
        return ParsedReply(content=text)
    return parse(prompt.forced + text, prompt.family)


class LiveText:
    """The content of a reply being decoded that is safe to send: never text a stop string might still
    cut, a partial character, or what may be the start of a tool call. Sent text is always a prefix of
    the final content, so a streamed reply's text equals the non-streamed one's."""

    def __init__(self, tok: Any, params: SamplingParams, prompt: ChatPrompt | None):
        self.tok, self.params = tok, params
        self.family = prompt.family if prompt is not None else None
        self.held = bool(prompt is not None and prompt.forced)
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token: int) -> None:
        self.tokens.append(token)

    def _safe(self) -> str:
        toks = self.tokens
        if toks and toks[-1] in self.params.stop_token_ids:
            toks = toks[:-1]
        text = self.tok.decode(toks, skip_special_tokens=True)
        while text.endswith("\ufffd"):
            text = text[:-1]
        cut = len(text)
        markers = list(self.params.stop_strings)
        if self.family == "hermes":
            markers.append(HERMES_OPEN)
        for s in markers:
            i = text.find(s)
            if i >= 0:
                cut = min(cut, i)
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    cut = min(cut, len(text) - k)
                    break
        text = text[:cut]
        if self.family is None:
            return text
        text = text.strip()
        if self.family == "llama3" and (text.startswith(("{", LLAMA3_TAG)) or LLAMA3_TAG.startswith(text)):
            return ""
        return text

    def ready(self) -> str:
        """The new text that may be sent now ("" when none)."""
        if self.held:
            return ""
        safe = self._safe()
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        new, self.sent = safe[len(self.sent) :], safe
        return new

    def rest(self, final: str) -> str:
        """What remains of ``final`` (the reply's content) once the whole reply has decoded."""
        new = final[len(self.sent) :] if final.startswith(self.sent) else ""
        self.sent = final
        return new


def reply_parts(text: str, finish: str, prompt: ChatPrompt) -> tuple[str | None, list, str]:
    """(content, calls, finish reason) of a decoded reply: a well-formed call makes ``tool_calls``;
    a malformed one leaves the whole reply as text."""
    if prompt.family is None:
        return text, [], finish
    parsed = read_reply(text, prompt)
    if parsed.calls and parsed.ok:
        return (parsed.content or None), parsed.calls, "tool_calls"
    return (parsed.content if parsed.ok else (prompt.forced + text).strip()), [], finish
