"""The text-to-SQL agent's environment: the model may query the question's database with a ``run_sql`` tool
(read-only, time- and row-limited, in the same sandboxed scorer process as the reward) before it answers;
the episode ends when it answers without a call, scored by ``sql_reward`` (execution match), or after
``max_turns`` turns (reward 0). The base for the text-to-SQL agent recipe.

    %%openrl env sql_agent
    from openrl_jupyter.sql.agent import sql_env as env

    run = %openrl train --env sql_agent --prompts TRAIN --max-turns 4
"""

from __future__ import annotations

import json
import os
from typing import Any

from openrl_jupyter.env import ToolEnv
from openrl_jupyter.sql.cache import database_path
from openrl_jupyter.sql.reward import DEFAULT_MAX_ROWS, run_query, sql_reward

TOOL_ROWS = 20  # rows of a run_sql result the model sees
TOOL_TIMEOUT_S = 2.0
RUN_SQL = {
    "type": "function",
    "function": {
        "name": "run_sql",
        "description": "Run one read-only SQLite query on the question's database and see up to "
        f"{TOOL_ROWS} rows of its result, or its error.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "one SQLite SELECT query"}},
            "required": ["query"],
        },
    },
}
INSTRUCTION = (
    "You may call run_sql to look at the data first. When you know the answer, reply with the final "
    "SQLite query only, without a tool call."
)


def _database(info: dict) -> str:
    db = info.get("db_path")
    if not db or not os.path.exists(db):  # e.g. a kernel's path, in a detached job: rebuilt from the seed
        db = database_path(info["db_id"], int(info.get("seed", 0)))
    return os.fspath(db)


def sql_env(prompt: str, info: dict, *, max_turns: int = 4) -> ToolEnv:
    """One question's environment: ``prompt`` (a text-to-SQL prompt, e.g. ``render_prompt``) with the
    instruction to use ``run_sql``; ``info`` the example's fields (``sql``, ``db_id``, ``seed``...)."""
    db = _database(info)

    def run_sql(query: str) -> str:
        rows = run_query(query, db, timeout_s=TOOL_TIMEOUT_S, max_rows=DEFAULT_MAX_ROWS)
        shown = [list(r) for r in rows[:TOOL_ROWS]]
        note = f"{len(rows)} rows" + (f", the first {TOOL_ROWS} shown" if len(rows) > TOOL_ROWS else "")
        return json.dumps({"rows": shown, "note": note}, default=str)

    def score(answer: str, info: dict) -> float:
        return sql_reward(prompt, answer, **{**info, "db_path": db})

    return ToolEnv(
        f"{prompt.rstrip()}\n{INSTRUCTION}",
        tools={"run_sql": run_sql},
        schemas=[RUN_SQL],
        score=score,
        info=info,
        max_turns=max_turns,
    )


def describe(env: Any) -> str:
    """A one-line summary of an episode's conversation (for logs)."""
    calls = sum(len(m.get("tool_calls") or []) for m in env.messages)
    return f"{len(env.messages)} messages, {calls} run_sql calls"
