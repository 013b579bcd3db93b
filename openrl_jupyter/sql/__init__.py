"""Text-to-SQL: generated databases and questions (``data``) and an execution-match reward (``reward``).

Imports only the standard library (sqlite3), so it loads without torch.
"""

from openrl_jupyter.sql.data import (
    DEFAULT_TEST_SCHEMAS,
    SCHEMAS,
    SQLDataset,
    build_database,
    database_path,
    generate,
    render_prompt,
    schema_text,
    skeleton,
)
from openrl_jupyter.sql.reward import MatchResult, execution_match, extract_sql, sql_reward

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
