"""How a multi-turn episode becomes training sequences, written once for the service (which builds the
datums of a train step) and the notebook side (which shows what an episode trained on).

An episode is its turns in order: each turn's observation (the tokens the model saw) and action (the
tokens it sampled, with the sampler's logprobs). Where a turn's observation extends the sequence so far
(the previous observation, the model's action, then the environment's tokens: a tool result, the next
user message), the turns share one sequence; otherwise a new sequence starts, as tinker-cookbook's
``trajectory_to_data`` does. Observation and environment tokens carry advantage 0 (they are not the
model's doing); every action token carries the episode's advantage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class EpisodeSequence:
    """One training sequence: ``tokens`` with, per position, the sampler's logprob and the advantage
    (0 for observation and environment tokens)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)

    def add(self, tokens: Sequence[int], logprobs: Sequence[float] | None, advantage: float) -> None:
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))
        self.advantages.extend([advantage if logprobs is not None else 0.0] * len(tokens))


@dataclass
class EpisodeLayout:
    sequences: list[EpisodeSequence]
    action_tokens: int  # the model's tokens (trained with the advantage)
    env_tokens: int  # the environment's tokens after the first observation (trained at weight 0)


def episode_layout(
    turns: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float]]], advantage: float
) -> EpisodeLayout:
    """The sequences of an episode's turns, each turn (observation, action tokens, action logprobs)."""
    seqs: list[EpisodeSequence] = []
    action = env = 0
    for i, (ob, ac, lp) in enumerate(turns):
        if len(lp) != len(ac):
            raise ValueError(f"turn {i}: {len(ac)} action tokens but {len(lp)} logprobs")
        cur = seqs[-1] if seqs else None
        if cur is not None and len(ob) >= len(cur.tokens) and list(ob[: len(cur.tokens)]) == cur.tokens:
            new = ob[len(cur.tokens) :]
        else:
            cur = EpisodeSequence()
            seqs.append(cur)
            new = ob
        cur.add(new, None, 0.0)
        if i > 0:
            env += len(new)
        cur.add(ac, lp, advantage)
        action += len(ac)
    return EpisodeLayout(
        sequences=[s for s in seqs if len(s.tokens) > 1], action_tokens=action, env_tokens=env
    )
