"""A supervised warm start before RL: a few steps of cross-entropy on prompt/completion examples.

RL needs a policy whose samples sometimes score: with a sparse reward (an exact answer) a model that
never answers right gets no signal. A short warm start on examples fixes that, and RL then sharpens
what it half knows. ``sft`` trains a fresh run on the service (``POST /openrl/v1/runs/{id}/sft_step``),
saves it, frees the run, and returns a :class:`WarmStart` whose ``checkpoint`` an RL run loads::

    warm = session.sft(EXAMPLES, steps=150, batch=32)      # a loss curve, then the checkpoint
    run = %openrl train --reward exact --prompts PROMPTS --load-from $warm.checkpoint
"""

from __future__ import annotations

import base64
import html
import random
import time
from dataclasses import dataclass, field
from typing import Any

from openrl_common.checks import integer, number
from openrl_jupyter._exceptions import OpenRLError, UsageError
from openrl_jupyter.config import load_prompts
from openrl_jupyter.series import svg_panels

MAX_STEPS = 100_000


@dataclass
class WarmStart:
    """What ``sft`` trained: one row per step (``step``, ``loss`` per completion token, ``tokens``,
    ``seconds``) and the checkpoint an RL run continues from (``--load-from``)."""

    name: str
    checkpoint: str
    history: list[dict] = field(default_factory=list)

    @property
    def loss(self) -> float | None:
        """The last step's loss per completion token."""
        return self.history[-1]["loss"] if self.history else None

    def __repr__(self) -> str:
        first = self.history[0]["loss"] if self.history else float("nan")
        return (
            f"WarmStart({self.name!r}: {len(self.history)} SFT steps, loss {first:.3f} -> "
            f"{self.loss:.3f} per token; checkpoint {self.checkpoint})"
        )

    def _repr_html_(self) -> str:
        steps = [float(r["step"]) for r in self.history]
        svg = svg_panels(
            [("SFT loss per token", [("loss", steps, [r["loss"] for r in self.history], "#ef553b")], [])]
        )
        data = base64.b64encode(svg.encode()).decode()
        return (
            f"<div><pre>{html.escape(repr(self))}</pre>"
            f"<img alt='SFT loss per step' src='data:image/svg+xml;base64,{data}'></div>"
        )


def examples_of(src: Any) -> list[dict]:
    """``{"prompt", "completion"}`` dicts from a list of them, of ``(prompt, completion)`` pairs, a
    DataFrame, a ``datasets.Dataset`` or a .jsonl file with those two columns."""
    if isinstance(src, (list, tuple)) and src and all(isinstance(x, tuple) and len(x) == 2 for x in src):
        src = [{"prompt": p, "completion": c} for p, c in src]
    rows = load_prompts(src, where="examples")
    out = []
    for i, row in enumerate(rows):
        completion = row["info"].get("completion")
        if not isinstance(completion, str):
            raise UsageError(
                f'examples[{i}] needs a "completion" string (what the model should answer); '
                f"got {type(completion).__name__}"
            )
        out.append({"prompt": row["prompt"], "completion": completion})
    return out


def sft(
    session: Any,
    examples: Any,
    *,
    steps: int = 100,
    batch: int = 16,
    learning_rate: float | None = None,
    rank: int | None = None,
    seed: int = 0,
    name: str = "sft",
    progress: bool = True,
) -> WarmStart:
    """Train ``steps`` supervised steps of ``batch`` examples (seeded shuffles, epoch after epoch) on
    a fresh run of ``session``'s model, save it as ``name`` (replacing a checkpoint of that name) and
    return a :class:`WarmStart`. ``learning_rate``/``rank``: the model's defaults when None."""
    rows = examples_of(examples)
    steps = integer(steps, "steps", 1, MAX_STEPS, error=UsageError)
    limit = session.checked_by(session.model).get("max_datums")
    batch = integer(batch, "batch", 1, limit or None, setting="OPENRL_MAX_DATUMS", error=UsageError)
    optimizer = {}
    if learning_rate is not None:
        optimizer["learning_rate"] = number(
            learning_rate, "learning_rate", 0, None, lo_open=True, error=UsageError
        )
    fields: dict[str, Any] = {"name": name, "seed": seed, "steps": steps}
    if rank is not None:
        fields["rank"] = rank
    if session.model is not None:
        fields["base_model"] = session.model
    client = session.client
    run_id = client.create_run(**fields)["run_id"]
    order: list[int] = []
    shuffle = random.Random(seed)
    warm = WarmStart(name=name, checkpoint="")
    t0 = time.monotonic()
    try:
        for step in range(1, steps + 1):
            chosen = []
            while len(chosen) < batch:
                if not order:
                    order = list(range(len(rows)))
                    shuffle.shuffle(order)
                chosen.append(rows[order.pop()])
            reply = client.sft_step(
                run_id, chosen, optimizer=optimizer, idempotency_key=f"{run_id}-sft-{step}"
            )
            warm.history.append(
                {
                    "step": step,
                    "loss": reply["loss"],
                    "tokens": reply["tokens"],
                    "seconds": round(time.monotonic() - t0, 2),
                }
            )
            if progress and (step % max(1, steps // 5) == 0 or step == steps):
                print(
                    f"sft step {step}/{steps}: loss {reply['loss']:.3f} per token ({time.monotonic() - t0:.0f} s)"
                )
        warm.checkpoint = client.save(run_id, name, overwrite=True)
    finally:
        try:
            client.delete_run(run_id)
        except OpenRLError:  # the run is freed by the service's reaper anyway
            pass
    return warm
