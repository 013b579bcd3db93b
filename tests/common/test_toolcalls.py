"""The tool-call parsers (openrl_common/toolcalls.py): calls read per model family, malformed calls reported
(never raised), an unknown family refused by name, and tools checked and rebuilt in one key order."""

from __future__ import annotations

import re

import pytest

from openrl_common.toolcalls import (
    ToolFormatError,
    call_prefix,
    check_tools,
    parse,
    parse_hermes,
    parse_llama3,
)


def test_hermes_reads_each_block_and_keeps_the_text_around_them():
    text = 'Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>'
    got = parse_hermes(text)
    assert got.ok and got.content == "Let me look."
    assert [(c.name, c.arguments) for c in got.calls] == [("a", {"x": 1}), ("b", {"y": [2]})]
    assert len({c.id for c in got.calls}) == 2 and all(c.id.startswith("call_") for c in got.calls)
    assert parse_hermes("just text ").content == "just text" and not parse_hermes("just text").calls


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('<tool_call>{"name": oops}</tool_call>', "not JSON"),
        ('<tool_call>{"name": "a", "arguments": {"x": 1}', "never closed"),
        ('<tool_call>["a"]</tool_call>', "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a string "name"'),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ],
)
def test_a_malformed_hermes_call_is_reported_not_raised(text, why):
    got = parse_hermes(text)
    assert not got.ok and not got.calls
    assert why in got.errors[0] and got.errors[0].startswith("tool call 1")


def test_llama3_reads_json_calls_and_leaves_other_replies_as_text():
    got = parse_llama3('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')
    assert got.ok and [(c.name, c.arguments) for c in got.calls] == [("f", {"a": 1}), ("g", {})]
    assert parse_llama3('{"name": "f", "arguments": {"a": 2}}').calls[0].arguments == {"a": 2}
    assert parse_llama3("The answer is 4.").content == "The answer is 4."
    assert (
        parse_llama3('{"answer": 4}').content == '{"answer": 4}' and not parse_llama3('{"answer": 4}').calls
    )
    bad = parse_llama3('{"name": "f", "parameters": {"a": }')
    assert not bad.ok and "not JSON" in bad.errors[0]


def test_a_family_without_a_parser_is_named_in_the_error():
    with pytest.raises(ToolFormatError, match="'mistral'.*hermes, llama3"):
        parse("[TOOL_CALLS]", "mistral")
    with pytest.raises(ToolFormatError, match="'mistral'"):
        call_prefix("mistral", None)
    assert parse_hermes(call_prefix("hermes", "f") + '{"q": 1}}\n</tool_call>').calls[0].arguments == {"q": 1}


def test_tools_are_checked_and_rebuilt_in_one_key_order():
    a = check_tools(
        [
            {
                "function": {"parameters": {"type": "object"}, "name": "f", "description": "d"},
                "type": "function",
            }
        ]
    )
    b = check_tools(
        [
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
            }
        ]
    )
    assert a == b and list(a[0]["function"]) == ["name", "description", "parameters"]
    assert check_tools([{"type": "function", "function": {"name": "g"}}])[0]["function"]["parameters"] == {
        "type": "object",
        "properties": {},
    }
    for bad, why in (
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f"}}] * 2, "given twice"),
        ([{"type": "retrieval"}], "tools[0] must be"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters must be"),
    ):
        with pytest.raises(ValueError, match=re.escape(why)):
            check_tools(bad)
