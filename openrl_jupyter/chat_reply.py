"""A chat turn's reply: its text, why the model stopped, and what to say when it is blank."""

from __future__ import annotations


class ChatReply(str):
    """The reply's text (a ``str``), with ``finish_reason`` ("stop": the model ended it; "length":
    max_tokens ran out) and ``completion_tokens`` as the service reported them."""

    finish_reason: str | None
    completion_tokens: int | None

    def __new__(cls, text: str, *, finish_reason: str | None = None, completion_tokens: int | None = None):
        reply = super().__new__(cls, text)
        reply.finish_reason = finish_reason
        reply.completion_tokens = completion_tokens
        return reply


def blank_note(reply: str, model: str) -> str | None:
    """Why a reply shows nothing (empty, whitespace or control characters), and what to try; None
    when it has text to show."""
    if any(c.isprintable() and not c.isspace() for c in reply):
        return None
    # a byte-level model (openrl/tiny) may answer with control characters, which print as nothing
    shown = repr(reply[:12]) + ("…" if len(reply) > 12 else "")
    what = "nothing" if not reply else f"nothing printable ({len(reply)} characters: {shown})"
    finish = getattr(reply, "finish_reason", None)
    tokens = getattr(reply, "completion_tokens", None)
    if finish == "length":
        why = f"it used its max_tokens ({tokens}) on them" if tokens else "max_tokens ran out"
    elif finish == "stop":
        why = "it ended its answer at once (its end-of-text token or a stop sequence came first)"
    else:
        why = f"it stopped ({finish or 'no reason given'})"
    return (
        f"{model} replied with {what}: {why}. Greedy decoding (temperature 0) picks the same first "
        "token every time: try --temperature 0.8 (temperature=0.8) or more --max-tokens, or chat with "
        "a trained checkpoint (run.save() gives its tinker:// path); a base model may not be tuned to chat"
    )
