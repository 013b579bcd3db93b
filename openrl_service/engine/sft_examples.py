"""Supervised examples (``{prompt, completion}``) into the token arrays of a cross-entropy step.

The prompt is rendered as ``/sample`` renders it (the model's chat template with the generation prompt,
or the raw text with ``chat: false``), so a model warm-started on these examples is sampled on exactly
the tokens it was taught on. The completion's tokens, then the end of the assistant's turn, are trained
at weight 1; the prompt's at weight 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from openrl_service.errors import UserError
from openrl_service.training.trainer import DatumArrays


def _head(tok: Any, prompt: Any, chat: bool) -> tuple[str, list[dict] | None]:
    """The prompt as text, and as chat messages where the chat template renders it."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if chat and getattr(tok, "chat_template", None):
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), messages
    if not isinstance(prompt, str):
        raise UserError("chat messages need chat=true (the model's chat template renders them)", field="chat")
    return prompt, None


def _answer(tok: Any, head: str, messages: list[dict] | None, completion: str, where: str) -> str:
    """The text the model should write after ``head``: the completion and the end of its turn."""
    if messages is None:  # raw text: the completion, then end of sequence
        return completion + (tok.eos_token or "")
    full = tok.apply_chat_template([*messages, {"role": "assistant", "content": completion}], tokenize=False)
    if not full.startswith(head):  # a template that rewrites earlier turns cannot be taught this way
        raise UserError(
            f"{where}: the chat template does not render the answer after the prompt; send raw text "
            "with chat=false",
            field=where,
        )
    tail = full[len(head) :]
    end = tail.find(tok.eos_token) if tok.eos_token else -1
    return tail[: end + len(tok.eos_token)] if end >= 0 else tail  # the turn's end, not what follows it


def sft_datums(tok: Any, examples: list[dict], chat: bool, vocab: int) -> tuple[list[DatumArrays], int]:
    """The examples as cross-entropy datums, and how many completion tokens they train."""
    data, trained = [], 0
    for i, ex in enumerate(examples):
        where = f"examples[{i}]"
        head, messages = _head(tok, ex["prompt"], chat)
        answer = _answer(tok, head, messages, ex["completion"], f"{where}.completion")
        prompt_ids = list(tok.encode(head, add_special_tokens=False))
        answer_ids = list(tok.encode(answer, add_special_tokens=False))
        if not prompt_ids:
            raise UserError(f"{where}.prompt encodes to no tokens", field=f"{where}.prompt")
        ids = prompt_ids + answer_ids
        if any(not 0 <= t < vocab for t in ids):
            raise UserError(f"{where} encodes to token ids outside [0, {vocab})", field=where)
        weights = [0.0] * len(prompt_ids) + [1.0] * len(answer_ids)
        data.append(
            DatumArrays(
                np.asarray(ids[:-1], dtype=np.int64),
                {
                    "target_tokens": np.asarray(ids[1:], dtype=np.int64),
                    "weights": np.asarray(weights[1:], dtype=np.float32),
                },
            )
        )
        trained += len(answer_ids)
    return data, trained
