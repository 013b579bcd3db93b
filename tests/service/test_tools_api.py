"""Tool calls on the OpenAI-compatible and Anthropic endpoints, driven by the `openai` and `anthropic` SDKs
against a real service: a LoRA trained (Tinker SDK) to answer with a Hermes tool call comes back as parsed
``tool_calls`` and as a ``tool_use`` block; streamed replies equal non-streamed ones; the tokens each
endpoint renders are the served tokenizer's ``apply_chat_template(messages, tools=...)``."""

from __future__ import annotations

import json
import sys

import anthropic
import httpx
import openai
import pytest
import tinker
from tinker import types

from tests._support.clientenv import client_env, run_client
from tests.conftest import ALICE_KEY, BOB_KEY, TINY

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ANTHROPIC_TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# A conversation after the call: the call, its result, and the question again (rendered, never trained)
AFTER = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
ANTHROPIC_AFTER = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}],
    },
]

RENDER = r"""
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = {}
for name, messages in json.loads(sys.argv[2]).items():
    text = tok.apply_chat_template(messages, tools=json.loads(sys.argv[3]), add_generation_prompt=True, tokenize=False)
    out[name] = tok.encode(text, add_special_tokens=False)
out["end"] = tok.convert_tokens_to_ids("<|im_end|>")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def rendered(server, tmp_path_factory):
    """The served tokenizer's tokens for ASK and AFTER with TOOLS, loaded through the hub mirror as a
    user's process would (HF_ENDPOINT), and the end-of-turn token."""
    home = tmp_path_factory.mktemp("hf")
    args = ["-c", RENDER, TINY, json.dumps({"ask": ASK, "after": AFTER}), json.dumps(TOOLS)]
    proc = run_client(sys.executable, args, client_env(server.url, ALICE_KEY, home / "hf"), home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def caller(server, rendered):
    """A sampler checkpoint of alice's trained to answer ASK (with TOOLS) with CALL."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    tc = sc.create_lora_training_client(base_model=TINY, rank=8, seed=3).result()
    prompt = rendered["ask"]
    target = list(CALL.encode()) + [rendered["end"]]
    seq = prompt + target
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(target)},
    )
    for _ in range(110):  # the loss falls from ~300 to ~0.3 (summed over the call's 76 tokens)
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    path = tc.save_weights_for_sampler("caller").result().path
    yield path
    sc.close("success").result()


def oai(server, key=ALICE_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def claude(server, key=ALICE_KEY, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url + "/anthropic/api", api_key=key, max_retries=0, **kw)


def test_a_trained_tool_call_comes_back_as_tool_calls_from_the_openai_sdk(server, rendered, caller):
    client = oai(server)
    reply = client.chat.completions.create(
        model=caller, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    assert not choice.message.content
    # the prompt is exactly what the served tokenizer renders for these messages and tools
    assert reply.usage.prompt_tokens == len(rendered["ask"])

    # streamed: the same call, assembled from the deltas as the SDK's users do
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(
        model=caller, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0, stream=True
    ):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"name": "", "arguments": ""})
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"})
    ]

    # without tools the same model's reply is text: the call is not parsed out of it
    plain = client.chat.completions.create(
        model=caller, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in (
        "stop",
        "length",
    )


def test_a_trained_tool_call_comes_back_as_a_tool_use_block_from_the_anthropic_sdk(server, rendered, caller):
    client = claude(server)
    args = {
        "model": caller,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": ANTHROPIC_TOOLS,
        "max_tokens": 120,
        "extra_body": {"temperature": 0},  # the SDK has no temperature argument any more
    }
    msg = client.messages.create(**args)
    assert msg.stop_reason == "tool_use", msg
    (block,) = [b for b in msg.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.input == {"city": "Paris"}
    assert block.id.startswith("toolu_")
    # the same tokens as the equivalent OpenAI request, and count_tokens agrees
    assert msg.usage.input_tokens == len(rendered["ask"])
    counted = client.messages.count_tokens(
        model=caller, system="Be brief.", messages=args["messages"], tools=ANTHROPIC_TOOLS
    )
    assert counted.input_tokens == len(rendered["ask"])

    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == [
        (b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in msg.content
    ]


def test_tool_results_render_alike_on_both_endpoints_and_in_the_served_tokenizer(server, rendered, caller):
    """A conversation holding a call and its result: /v1's prompt tokens, the Anthropic form's, and the
    served tokenizer's apply_chat_template(messages, tools=...) are the same tokens."""
    got = oai(server).chat.completions.create(
        model=caller, messages=AFTER, tools=TOOLS, max_tokens=1, temperature=0
    )
    assert got.usage.prompt_tokens == len(rendered["after"])
    counted = claude(server).messages.count_tokens(
        model=caller, system="Be brief.", messages=ANTHROPIC_AFTER, tools=ANTHROPIC_TOOLS
    )
    assert counted.input_tokens == len(rendered["after"])
    # and the same tokens, not only as many: greedy sampling from both equals the Tinker SDK's on them
    sc = tinker.ServiceClient(base_url=server.url, api_key=ALICE_KEY)
    sampler = sc.create_sampling_client(model_path=caller)
    want = (
        sampler.sample(
            types.ModelInput.from_ints(rendered["after"]),
            1,
            types.SamplingParams(max_tokens=16, temperature=0.0),
        )
        .result()
        .sequences[0]
        .tokens
    )
    text = bytes(t for t in want if t < 256).decode("utf-8", "replace")
    a = oai(server).chat.completions.create(
        model=caller, messages=AFTER, tools=TOOLS, max_tokens=16, temperature=0
    )
    b = claude(server).messages.create(
        model=caller,
        system="Be brief.",
        messages=ANTHROPIC_AFTER,
        tools=ANTHROPIC_TOOLS,
        max_tokens=16,
        extra_body={"temperature": 0},
    )
    # 16 tokens cannot hold a whole call: both replies are the text, as the Tinker SDK sampled it
    assert a.choices[0].finish_reason == "length" and b.stop_reason == "max_tokens"
    assert a.choices[0].message.content == text.strip() == b.content[0].text


def test_a_named_tool_choice_starts_the_call(server, caller):
    got = oai(server).chat.completions.create(
        model=caller,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    assert got.choices[0].finish_reason == "tool_calls"
    assert got.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_streamed_text_equals_the_non_streamed_text_on_both_endpoints(server, caller):
    chat_args = {
        "model": TINY,
        "messages": [{"role": "user", "content": "Tell me"}],
        "max_tokens": 40,
        "temperature": 0,
    }
    whole = oai(server).chat.completions.create(**chat_args).choices[0].message.content
    streamed = "".join(
        c.delta.content or ""
        for chunk in oai(server).chat.completions.create(stream=True, **chat_args)
        for c in chunk.choices
    )
    assert streamed == whole and whole
    args = {
        "model": TINY,
        "messages": [{"role": "user", "content": "Tell me"}],
        "max_tokens": 40,
        "extra_body": {"temperature": 0},
    }
    msg = claude(server).messages.create(**args)
    with claude(server).messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text == whole
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens


def test_the_anthropic_endpoint_takes_either_key_header_and_keeps_tenants_apart(server, caller):
    body = {"model": TINY, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    url = server.url + "/anthropic/api/v1/messages"
    for headers in ({"x-api-key": ALICE_KEY}, {"Authorization": f"Bearer {ALICE_KEY}"}):
        r = httpx.post(url, json=body, headers={**headers, "anthropic-version": "2023-06-01"}, timeout=60)
        assert r.status_code == 200 and r.json()["type"] == "message"
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 401
    with pytest.raises(anthropic.NotFoundError) as e:
        claude(server, BOB_KEY).messages.create(model=caller, max_tokens=4, messages=body["messages"])
    assert e.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "bad name!"}],
            },
            "tools[0].function.name",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "tool_choice",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [""]},
            "stop_sequences",
        ),
    ],
)
def test_bad_anthropic_input_is_a_400_naming_the_field_in_anthropics_shape(server, body, field):
    r = httpx.post(
        server.url + "/anthropic/api/v1/messages",
        json={"model": TINY, **body},
        headers={"x-api-key": ALICE_KEY},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"]
    assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200


def test_bad_tools_on_v1_are_a_400_naming_the_field(server):
    client = oai(server)
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "x y"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ]
    for extra, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=TINY, messages=ASK, max_tokens=4, **extra)
        assert field in e.value.body["message"], e.value.body


def test_a_chatml_template_that_ignores_tools_gets_the_hermes_block_and_renders_as_before_without():
    """SmolLM2's template (ChatML, tools ignored): the service installs the tools block in front of it;
    conversations without tools render byte for byte as before. A template in another format that
    ignores tools has no tool format here (its /v1 tools requests are refused naming the field)."""
    from openrl_service.models import tiny
    from openrl_service.models.tools_template import tool_family

    tok = tiny._build_tokenizer()
    tok.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
        "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    plain = [{"role": "user", "content": "hi"}]
    before = tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert tool_family(tok) == "hermes"
    assert tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == before
    offered = tok.apply_chat_template(plain, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in offered and '"name": "get_weather"' in offered and offered.endswith(before)
    called = tok.apply_chat_template(AFTER, tools=TOOLS, tokenize=False)
    assert CALL in called and "<tool_response>\nsunny, 21 C\n</tool_response>" in called

    tok.chat_template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    assert tool_family(tok) is None
