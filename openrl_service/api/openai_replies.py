"""How sampled sequences become the OpenAI-compatible API's replies (api/openai.py): each sequence's text
and pieces (:class:`Decoded`), logprobs in completions' and chat's shapes, /completions' choices, usage,
and the SSE chunks of a streamed reply. Detokenising is work: the routes run it off the event loop.
"""

from __future__ import annotations

import asyncio
import copy
import math
from typing import Any

import orjson

from openrl_service.sampling.base import SampledSequence, SampleJob, SampleOutput, SamplingParams


class Decoded:
    """One sampled sequence as OpenAI shows it: its text (stop string and end-of-turn token cut off),
    the tokens behind that text, their pieces and logprobs, and why it ended."""

    def __init__(self, seq: SampledSequence, tok: Any, params: SamplingParams, k: int | None):
        tokens = list(seq.tokens)
        ended = "stop" if seq.stop_reason == "stop" else "length"
        if tokens and tokens[-1] in params.stop_token_ids:
            tokens = tokens[:-1]
        self.pieces = pieces(tok, tokens)
        text = "".join(self.pieces)
        cut = min((i for s in params.stop_strings if (i := text.find(s)) >= 0), default=None)
        if cut is not None:  # OpenAI returns the text before the stop sequence
            text = text[:cut]
            kept, width = 0, 0
            while kept < len(self.pieces) and width < cut:
                width += len(self.pieces[kept])
                kept += 1
            tokens, self.pieces = tokens[:kept], self.pieces[:kept]
            ended = "stop"
        self.text, self.tokens, self.finish_reason = text, tokens, ended
        self.generated = len(seq.tokens)
        n = len(tokens)
        self.logprobs = [float(x) for x in seq.logprobs[:n]] if k is not None else None
        self.top: list[list[tuple[int, float]]] | None = None
        if k and seq.topk_ids is not None and seq.topk_logprobs is not None:
            self.top = [
                [
                    (int(i), float(lp))
                    for i, lp in zip(seq.topk_ids[t][:k], seq.topk_logprobs[t][:k], strict=True)
                ]
                for t in range(n)
            ]

    def part(self, t: int) -> Decoded:
        """Token ``t`` alone (a streamed chunk's logprobs)."""
        one = copy.copy(self)
        one.pieces, one.tokens = self.pieces[t : t + 1], self.tokens[t : t + 1]
        one.logprobs = self.logprobs[t : t + 1] if self.logprobs is not None else None
        one.top = self.top[t : t + 1] if self.top is not None else None
        return one


def pieces(tok: Any, tokens: list[int]) -> list[str]:
    """Each token's share of the decoded text: a token that completes a multi-byte character carries
    it, the ones before it carry "". Incremental, as vLLM detokenizes: each step decodes only the
    tokens since the last emitted piece's predecessor (the same start for the text before and after
    the new token, so a tokenizer that treats a sequence's first token apart treats both alike), so
    the cost is linear in the length, not quadratic."""
    out: list[str] = []
    start, read = 0, 0  # decode from ``start``; what ``tokens[start:read]`` decodes to is emitted
    for i in range(len(tokens)):
        before = tok.decode(tokens[start:read], skip_special_tokens=True)
        text = tok.decode(tokens[start : i + 1], skip_special_tokens=True)
        whole = text.startswith(before) and not text.endswith("\ufffd")
        if not whole and i + 1 < len(tokens):
            out.append("")  # an incomplete character: it comes with a later token
            continue
        out.append(text[len(before) :] if text.startswith(before) else text)
        start, read = read, i + 1
    return out


def completion_logprobs(d: Decoded, tok: Any, offset: int, echo: tuple | None) -> dict:
    """/completions' ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset (prompt first
    when echoed; the first prompt token has no logprob)."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    if echo is not None:
        prompt_pieces, prompt_lps, prompt_tops = echo
        for piece, lp, top in zip(prompt_pieces, prompt_lps, prompt_tops, strict=True):
            tokens.append(piece)
            lps.append(lp)
            tops.append(top)
            offsets.append(pos)
            pos += len(piece)
    for i, piece in enumerate(d.pieces):
        tokens.append(piece)
        lps.append(d.logprobs[i] if d.logprobs else None)
        tops.append({tok.decode([t]): lp for t, lp in d.top[i]} if d.top else None)
        offsets.append(pos)
        pos += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(d: Decoded, tok: Any) -> dict:
    def entry(piece: str, lp: float) -> dict:
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}

    content = []
    for i, piece in enumerate(d.pieces):
        e = entry(piece, d.logprobs[i] if d.logprobs else 0.0)
        e["top_logprobs"] = [entry(tok.decode([t]), lp) for t, lp in d.top[i]] if d.top else []
        content.append(e)
    return {"content": content, "refusal": None}


def echo_parts(out: SampleOutput, prompt: list[int], tok: Any, k: int) -> tuple:
    ps = pieces(tok, prompt)
    lps: list[float | None] = [None]
    tops: list[dict | None] = [None]
    for t in range(1, len(prompt)):
        value = out.prompt_logprobs[t] if out.prompt_logprobs is not None else None
        lps.append(None if value is None or math.isnan(float(value)) else float(value))
        if k and out.topk_prompt_ids is not None and out.topk_prompt_logprobs is not None:
            tops.append(
                {
                    tok.decode([int(i)]): float(lp)
                    for i, lp in zip(out.topk_prompt_ids[t][:k], out.topk_prompt_logprobs[t][:k], strict=True)
                }
            )
        else:
            tops.append(None)
    return ps, lps, tops


def completion_choices(
    jobs: list[SampleJob], outs: list[SampleOutput], tok: Any, n: int, k: int | None, echo: bool
) -> tuple[list[dict], int]:
    """/completions' choices (their texts, logprobs, finish reasons) and the completion tokens."""
    choices, completion_tokens = [], 0
    for i, (job, out) in enumerate(zip(jobs, outs, strict=True)):
        prompt_text = tok.decode(job.prompt, skip_special_tokens=True) if echo else ""
        echoed = echo_parts(out, job.prompt, tok, k or 0) if echo and k is not None else None
        for j, seq in enumerate(out.sequences):
            d = Decoded(seq, tok, job.params, k)
            completion_tokens += d.generated
            choices.append(
                {
                    "index": i * n + j,
                    "text": prompt_text + d.text,
                    "logprobs": None if k is None else completion_logprobs(d, tok, 0, echoed),
                    "finish_reason": d.finish_reason,
                    "_decoded": d,
                    "_prefix": prompt_text,
                }
            )
    return choices, completion_tokens


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def completion_chunks(head: dict, choices: list[dict], usage: dict, tok: Any, with_usage: bool):
    """Each choice's text token by token (the echoed prompt first), then its finish_reason, usage, [DONE]."""
    for c in choices:
        d: Decoded = c["_decoded"]
        if c["_prefix"]:
            yield sse(
                {
                    **head,
                    "choices": [
                        {"index": c["index"], "text": c["_prefix"], "logprobs": None, "finish_reason": None}
                    ],
                }
            )
        offset = len(c["_prefix"])
        for t, piece in enumerate(d.pieces):
            lp = None
            if c["logprobs"] is not None:
                lp = completion_logprobs(d.part(t), tok, offset, None)
            offset += len(piece)
            yield sse(
                {
                    **head,
                    "choices": [{"index": c["index"], "text": piece, "logprobs": lp, "finish_reason": None}],
                }
            )
            await asyncio.sleep(0)
        yield sse(
            {
                **head,
                "choices": [
                    {"index": c["index"], "text": "", "logprobs": None, "finish_reason": d.finish_reason}
                ],
            }
        )
    if with_usage:
        yield sse({**head, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


async def chat_chunks(
    head: dict, decoded: list[Decoded], usage: dict, tok: Any, k: int | None, with_usage: bool
):
    for j, d in enumerate(decoded):
        yield sse(
            {
                **head,
                "choices": [
                    {
                        "index": j,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
        )
        for t, piece in enumerate(d.pieces):
            lp = None if k is None else chat_logprobs(d.part(t), tok)
            yield sse(
                {
                    **head,
                    "choices": [
                        {"index": j, "delta": {"content": piece}, "logprobs": lp, "finish_reason": None}
                    ],
                }
            )
            await asyncio.sleep(0)
        yield sse(
            {
                **head,
                "choices": [{"index": j, "delta": {}, "logprobs": None, "finish_reason": d.finish_reason}],
            }
        )
    if with_usage:
        yield sse({**head, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"
