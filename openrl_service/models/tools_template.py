"""Tools in a served model's chat template: which tool-call family its template writes, and, for a ChatML
template that ignores ``tools`` (the tiny model's, SmolLM2's), a Hermes-style tools block installed in
front of it, so ``apply_chat_template(messages, tools=...)`` offers the tools and renders calls and
results. Conversations without tools render exactly as the model's own template renders them.

The installed part follows the layout of Qwen2.5's tools block (the tools as JSON lines inside
``<tools>`` in the system turn; calls as ``<tool_call>`` JSON in the assistant turn (arguments given as a JSON string written verbatim, as
an object through ``tojson``); results as
``<tool_response>`` in a user turn), written for ChatML's turn markers.
"""

from __future__ import annotations

import logging
from typing import Any

from openrl_common.toolcalls import detect_family

log = logging.getLogger("openrl_service")

_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_fn", "description": "p", "parameters": {"type": "object", "properties": {}}},
}
_PROBE_CALL = [
    {"role": "user", "content": "q"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "probe_fn", "arguments": {"x": 1}}}],
    },
    {"role": "tool", "content": "r"},
]

HERMES_CHATML = (
    "{%- set offered = tools is defined and tools -%}"
    "{%- set first = 0 -%}"
    "{%- if offered -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}"
    "{{- messages[0].content + '\\n\\n' -}}{%- set first = 1 -%}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call the functions below to help with the request. Their signatures, "
    "one JSON object per line, are inside <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object holding its name and its "
    "arguments inside <tool_call></tool_call> tags, one block per call:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <arguments-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- endif -%}"
    "{%- for m in messages[first:] -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (m.content or '') -}}"
    "{%- if m.tool_calls is defined and m.tool_calls -%}"
    "{%- for call in m.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if m.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' -}}'
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def with_tools(template: str) -> str:
    """A ChatML ``template`` with the Hermes tools block in front: used when tools are offered or the
    conversation holds a tool call or result, ``template`` itself otherwise."""
    return (
        "{%- set tooling = namespace(on=(tools is defined and tools)) -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'tool' or (m.tool_calls is defined and m.tool_calls) -%}"
        "{%- set tooling.on = true -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if tooling.on -%}" + HERMES_CHATML + "{%- else -%}" + template + "{%- endif -%}"
    )


def _render(tok: Any, messages: list[dict], tools: list | None) -> str | None:
    try:
        return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=False, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe does not take tools
        return None


def tool_family(tok: Any) -> str | None:
    """The family the tokenizer's chat template writes tool calls in (installing the Hermes block
    first where the template is ChatML and ignores tools); None when it has no tool format here."""
    template = getattr(tok, "chat_template", None)
    if not isinstance(template, str) or not template:
        return None
    plain = _render(tok, [{"role": "user", "content": "q"}], None)
    offered = _render(tok, [{"role": "user", "content": "q"}], [_PROBE_TOOL])
    if plain is not None and plain == offered:  # the template ignores tools
        if "<|im_start|>" not in template:
            log.info("the chat template ignores tools and is not ChatML: no tool calls for this model")
            return None
        tok.chat_template = with_tools(template)
        template = tok.chat_template
    rendered = _render(tok, _PROBE_CALL, [_PROBE_TOOL]) or ""
    return detect_family(rendered, template)
