"""The text-to-SQL agent's environment (openrl_jupyter/sql/agent.py), played by hand: run_sql returns rows
or the sandbox's error as the model's next observation, a write is refused, and the final answer is scored
by execution match."""

from __future__ import annotations

import asyncio
import json

import pytest

from openrl_jupyter.sql import generate, render_prompt
from openrl_jupyter.sql.agent import RUN_SQL, sql_env


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    data = generate(0, directory=tmp_path_factory.mktemp("agent"), per_template=1)
    ex = next(e for e in data.train if e["db_id"] == "shop")
    return {**ex, "db_path": str(data.db_path("shop"))}


def call(query: str, i: int = 0) -> dict:
    return {
        "id": f"c{i}",
        "type": "function",
        "function": {"name": "run_sql", "arguments": json.dumps({"query": query})},
    }


def test_the_agent_queries_sees_errors_and_is_scored_on_its_answer(example):
    env = sql_env(render_prompt(example), example)

    async def play():
        (first,) = await env.initial_observation()
        assert example["question"] in first["content"] and "run_sql" in first["content"]
        assert env.tools == [RUN_SQL]
        looked = await env.step({"role": "assistant", "content": "", "tool_calls": [call(example["sql"])]})
        assert not looked.episode_done and looked.reward == 0.0
        seen = json.loads(looked.next_messages[-1]["content"])
        assert (
            seen["rows"]
            and len(seen["rows"]) <= 20
            and seen["note"].startswith(f"{len(seen['rows'])} rows")
            or ("the first 20 shown" in seen["note"])
        )
        wrong = await env.step(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("DELETE FROM customers", 1), call("SELEC nope", 2)],
            }
        )
        errors = [m["content"] for m in wrong.next_messages[-2:]]
        assert all(e.startswith("error: SQLError") for e in errors) and wrong.metrics["tool_failures"] == 2
        done = await env.step({"role": "assistant", "content": example["sql"]})
        assert done.episode_done and done.reward == 1.0

    asyncio.run(play())


def test_a_wrong_answer_scores_0_and_the_turn_limit_ends_the_episode(example):
    env = sql_env(render_prompt(example), example, max_turns=2)

    async def play():
        await env.initial_observation()
        first = await env.step({"role": "assistant", "content": "", "tool_calls": [call("SELECT 1")]})
        assert not first.episode_done
        second = await env.step({"role": "assistant", "content": "", "tool_calls": [call("SELECT 2")]})
        assert second.episode_done and second.reward == 0.0
        other = sql_env(render_prompt(example), example)
        await other.initial_observation()
        assert (await other.step({"role": "assistant", "content": "SELECT 42"})).reward == 0.0

    asyncio.run(play())
