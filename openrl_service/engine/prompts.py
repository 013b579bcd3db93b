"""Text prompts into tokens without holding up other tenants: the raw length checked before any encoding,
then the chat template and the tokenizer run off the event loop.

A model's longest token spells at most ``longest`` characters (its vocabulary says), so a text longer
than ``context_length × longest`` characters encodes to more tokens than the context holds, whatever
it says: it is refused at once (413, with the numbers), never tokenised; chat messages count their
roles and contents, and no more messages than the context has tokens. Anything shorter is encoded
in a worker thread (``off_loop``): a long prompt's template and tokenizer never stall the loop that
answers everyone's requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from openrl_service.errors import PayloadTooLarge

T = TypeVar("T")
_LONGEST: dict[int, int] = {}  # id(tokenizer) -> its longest token's characters


def longest_token(tok: Any) -> int:
    """The most characters one token of ``tok`` stands for (a byte-level token's bytes, which is at
    least its characters), at least 1; read from the vocabulary once."""
    key = id(tok)
    if key not in _LONGEST:
        vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
        _LONGEST[key] = max((len(t) for t in vocab), default=64) or 1
    return _LONGEST[key]


def max_chars(base) -> int:
    """The longest text (characters) that can still fit ``base``'s context (a models.loading.BaseModel)."""
    return base.context_length * longest_token(base.tokenizer)


def check_text(base, chars: int, field: str) -> None:
    """Refuse (413) ``chars`` characters of prompt text that cannot fit ``base``'s context, before any
    encoding."""
    limit = max_chars(base)
    if chars > limit:
        raise PayloadTooLarge(
            f"{field}: {chars:,} characters of text cannot fit {base.name}'s context of "
            f"{base.context_length:,} tokens (its longest token spells {longest_token(base.tokenizer)} "
            f"characters, so at most {limit:,} characters could); send a shorter text",
            field=field,
        )


def check_messages(base, messages: list, field: str) -> None:
    """Refuse (413) chat messages that cannot fit ``base``'s context, before the chat template runs: their
    roles and contents counted, and as many messages as the context has tokens at most (a template
    gives each message a token or more, however empty)."""
    if len(messages) > base.context_length:
        raise PayloadTooLarge(
            f"{field}: {len(messages):,} messages cannot fit {base.name}'s context of "
            f"{base.context_length:,} tokens (each message takes one or more); send fewer",
            field=field,
        )
    chars = 0
    for m in messages:
        if isinstance(m, dict):
            chars += sum(len(v) for v in (m.get("role"), m.get("content")) if isinstance(v, str))
    check_text(base, chars, field)


async def off_loop(fn: Callable[[], T]) -> T:
    """Run ``fn`` (a chat template, a tokenizer call) on a worker thread, not the event loop."""
    return await anyio.to_thread.run_sync(fn)
