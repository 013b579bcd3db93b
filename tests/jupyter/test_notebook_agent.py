"""notebooks/05-agent.ipynb executed headless by nbclient in a real kernel on the tiny model: an SFT warm
start teaches the tool-call format, a multi-turn tool environment trains with RL from the kernel, and the
trained checkpoint answers the openai and anthropic SDKs with a parsed tool call."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "05-agent.ipynb"
sys.path.insert(0, str(ROOT / "examples"))

from notebook_demo import execute  # noqa: E402


@pytest.mark.timeout(1200)
def test_the_agent_notebook_trains_a_tool_environment_and_serves_tool_calls(tmp_path):
    env = {
        "OPENRL_URL": "",
        "OPENRL_TOKEN": "",
        "OPENRL_AGENT_MODEL": "tiny",
        "OPENRL_AGENT_RL_STEPS": "2",
        "OPENRL_AGENT_GROUP": "2",
        "OPENRL_AGENT_BATCH": "2",
        "OPENRL_AGENT_CITIES": "2",
        "OPENRL_AGENT_TEMPERATURE": "1.3",  # some episodes fail: advantages are not all 0
    }
    nb = execute(NOTEBOOK, tmp_path, env, timeout_s=900)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, "\n".join("\n".join(e.get("traceback", [])) for e in errors)[-3000:]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "openrl: environment weather v1 registered" in text
    # RL played multi-turn episodes with tool calls (the warm start taught the format)
    m = re.search(
        r"episodes: ([0-9.]+) turns and ([0-9.]+) tool calls on average; (\d+) episodes trained on", text
    )
    assert m, text[-3000:]
    assert float(m.group(1)) > 1.0 and float(m.group(2)) > 0.0 and int(m.group(3)) > 0
    assert re.search(r"held-out reward after SFT: [0-9.]+, after RL: [0-9.]+", text)
    # the trained checkpoint's call, parsed by both SDKs, streamed and not
    assert "openai finish_reason: tool_calls" in text
    assert re.search(r'openai tool call: get_weather \{"city": "Paris"\}', text), text[-3000:]
    assert 'openai streamed tool call arguments: [\'{"city": "Paris"}\']' in text
    assert "anthropic stop_reason: tool_use" in text
    assert "anthropic tool_use: get_weather {'city': 'Paris'}" in text
    counted = re.search(r"input tokens: (\d+) = count_tokens: (\d+)", text)
    assert counted and counted.group(1) == counted.group(2)
    assert "anthropic streamed: [('tool_use', {'city': 'Paris'})]" in text
