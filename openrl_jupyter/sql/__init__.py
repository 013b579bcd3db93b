"""Text-to-SQL: generated databases (``schemas``, cached privately by ``cache``), questions
(``questions``, ``dataset``) and an execution-match reward (``reward``, run in ``sandbox``).

Imports only the standard library (sqlite3), so it loads without torch.
"""

from openrl_jupyter.sql.cache import database_path
from openrl_jupyter.sql.dataset import SQLDataset, generate, render_prompt, schema_text, skeleton
from openrl_jupyter.sql.reward import MatchResult, execution_match, extract_sql, sql_reward
from openrl_jupyter.sql.schemas import DEFAULT_TEST_SCHEMAS, SCHEMAS, build_database

__all__ = [
    "DEFAULT_TEST_SCHEMAS",
    "SCHEMAS",
    "MatchResult",
    "SQLDataset",
    "build_database",
    "database_path",
    "execution_match",
    "extract_sql",
    "generate",
    "render_prompt",
    "schema_text",
    "skeleton",
    "sql_reward",
]
