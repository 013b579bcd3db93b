"""StableReinforce's stability records: what a ``record_stability_info=True`` sampling client sampled,
kept so training requests can name it by ``sequence_id`` (Tinker's datum provenance).

Tinker documents (alpha): every sample from such a client is recorded; each sequence carries a
``sequence_id`` (here the sample request's id and the sample's index, as the asample reply lists
them); recorded sequences belong to the session that sampled them and can be trained on for one day
after sampling, each training request that uses one restarting its day; a training request can name
only sequences of its own session. A datum's provenance tiles its ``model_input`` and its
``target_tokens`` with spans of a sequence's prompt or sampled tokens.

What is recorded per sequence: the prompt, the sampled tokens and the sampler's logprob of each
sampled token. :meth:`StabilityRecords.resolve` checks a ``stable_reinforce`` request against them
(every token a span names must be the token recorded there; an advantage only on sampled tokens)
and puts the recorded logprobs in place of the datum's ``logprobs``, so the loss's behaviour policy
is the one that really sampled each token (the sampler's numerics, not the client's copy of them).
Records live in memory (a restart forgets them: a request naming one then gets a 400 saying so), at
most OPENRL_MAX_STABILITY_RECORDS per tenant, the least recently used dropped first, and at most
OPENRL_MAX_STABILITY_BYTES in all: over it the tenant holding the most bytes loses its least recently
used record, so one tenant's flood never drops a neighbour's. The samples of one request share one
copy of their prompt.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from openrl_service.errors import UserError
from openrl_service.training.trainer import DatumArrays

WINDOW_S = 24 * 3600.0  # "can be trained on for one day after sampling"; each use restarts the day


@dataclass
class Record:
    prompt: np.ndarray  # int32, shared by the samples of one request
    tokens: np.ndarray  # int32, the sampled tokens
    logprobs: np.ndarray  # float32, the sampler's logprob of each sampled token
    expires_at: float
    users: list[int]  # live records sharing ``prompt`` (one cell per request): its bytes go with the last
    nbytes: int = 0  # its own tokens and logprobs (and bookkeeping), as the budget counts them


@dataclass(frozen=True)
class Span:
    """Positions [offset, offset + length) of a sequence's prompt ("prompt") or sampled tokens ("sampled")."""

    kind: str
    sequence_id: str
    offset: int
    length: int


@dataclass
class Provenance:
    model_input: list[Span]
    targets: list[Span]


class StabilityRecords:
    def __init__(self, max_per_tenant: int, max_bytes: int = 1 << 30, window_s: float = WINDOW_S):
        self.max_per_tenant = max_per_tenant
        self.max_bytes = max_bytes
        self.window_s = window_s
        self._lock = threading.Lock()
        # (tenant, session_id) -> sequence_id -> record, least recently used first per tenant
        self._by_tenant: dict[str, OrderedDict[tuple[str, str], Record]] = {}
        self._bytes: dict[str, int] = {}  # per tenant

    def record(self, tenant: str, session_id: str, ids: list[str], prompt: list[int], sequences) -> None:
        now = time.time()
        shared = np.asarray(prompt, dtype=np.int32)  # one copy for the request's samples
        users = [0]
        with self._lock:
            for sid, seq in zip(ids, sequences, strict=True):
                rec = Record(
                    shared,
                    np.asarray(seq.tokens, dtype=np.int32),
                    np.asarray(seq.logprobs, dtype=np.float32),
                    now + self.window_s,
                    users,
                )
                rec.nbytes = rec.tokens.nbytes + rec.logprobs.nbytes + 200
                self._drop(tenant, (session_id, sid))  # (may forget the tenant's emptied dict)
                self._by_tenant.setdefault(tenant, OrderedDict())[(session_id, sid)] = rec
                users[0] += 1
                charge = rec.nbytes + (shared.nbytes if users[0] == 1 else 0)  # the prompt with the first
                self._bytes[tenant] = self._bytes.get(tenant, 0) + charge
            mine = self._by_tenant.get(tenant, {})
            while len(mine) > self.max_per_tenant:
                self._drop(tenant, next(iter(mine)))
            while sum(self._bytes.values()) > self.max_bytes:
                heaviest = max(self._bytes, key=self._bytes.__getitem__)
                self._drop(heaviest, next(iter(self._by_tenant[heaviest])))

    def _drop(self, tenant: str, key: tuple[str, str]) -> None:
        mine = self._by_tenant.get(tenant, {})
        rec = mine.pop(key, None)
        if rec is None:
            return
        rec.users[0] -= 1
        self._bytes[tenant] -= rec.nbytes + (rec.prompt.nbytes if rec.users[0] == 0 else 0)
        if not mine:
            self._by_tenant.pop(tenant, None)
            self._bytes.pop(tenant, None)

    def count(self, tenant: str) -> int:
        with self._lock:
            return len(self._by_tenant.get(tenant, {}))

    def held_bytes(self, tenant: str) -> int:
        with self._lock:
            return self._bytes.get(tenant, 0)

    def forget(self, tenant: str, session_id: str | None = None) -> None:
        with self._lock:
            for key in [
                k for k in self._by_tenant.get(tenant, {}) if session_id is None or k[0] == session_id
            ]:
                self._drop(tenant, key)

    def _get(self, tenant: str, session_id: str, sid: str, where: str) -> Record:
        mine = self._by_tenant.get(tenant, {})
        rec = mine.get((session_id, sid))
        now = time.time()
        if rec is None or rec.expires_at < now:
            if rec is not None:
                self._drop(tenant, (session_id, sid))
            raise UserError(
                f"{where}.sequence_id: {sid!r} names no recorded sequence of this session (sample it with "
                "record_stability_info=True in the training run's own session; records are kept one day "
                "after their last use, in memory, and a restart of the service forgets them)",
                field=f"{where}.sequence_id",
            )
        rec.expires_at = now + self.window_s
        mine.move_to_end((session_id, sid))
        return rec

    def resolve(
        self, tenant: str, session_id: str, data: list[DatumArrays], provenance: list[Provenance | None]
    ) -> list[DatumArrays]:
        """``stable_reinforce`` data with the recorded sampler logprobs in place (UserError naming the
        datum and span when a span does not match what was recorded)."""
        out = []
        with self._lock:
            for i, (d, prov) in enumerate(zip(data, provenance, strict=True)):
                if prov is None or not prov.targets:
                    raise UserError(
                        f"data[{i}].loss_fn_input_spans: stable_reinforce needs the datum's provenance "
                        "(Datum.with_provenance: which sampled sequence each target token came from)",
                        field=f"data[{i}].loss_fn_input_spans",
                    )
                for name in ("logprobs", "advantages"):
                    if name not in d.inputs:
                        raise UserError(
                            f"data[{i}].loss_fn_inputs.{name} is required by stable_reinforce",
                            field=f"data[{i}].loss_fn_inputs.{name}",
                        )
                self._check(tenant, session_id, d.tokens, prov.model_input, f"data[{i}].model_input_spans")
                targets = d.inputs["target_tokens"]
                q = d.inputs["logprobs"].astype(np.float32, copy=True)
                adv = d.inputs["advantages"]
                pos = 0
                for j, span in enumerate(prov.targets):
                    where = f"data[{i}].loss_fn_input_spans[{j}]"
                    rec = self._get(tenant, session_id, span.sequence_id, where)
                    src = rec.tokens if span.kind == "sampled" else rec.prompt
                    self._match(targets, pos, span, src, where, "target_tokens")
                    sl = slice(pos, pos + span.length)
                    if span.kind == "sampled":
                        q[sl] = rec.logprobs[span.offset : span.offset + span.length]
                    elif np.any(adv[sl] != 0):
                        raise UserError(
                            f"{where}: stable_reinforce takes advantages on sampled tokens only; positions "
                            f"{pos}..{pos + span.length - 1} are prompt tokens with a nonzero advantage",
                            field=f"data[{i}].loss_fn_inputs.advantages",
                        )
                    pos += span.length
                if pos != len(targets):
                    raise UserError(
                        f"data[{i}].loss_fn_input_spans cover {pos} positions; target_tokens has {len(targets)}",
                        field=f"data[{i}].loss_fn_input_spans",
                    )
                out.append(replace(d, inputs={**d.inputs, "logprobs": q}))
        return out

    def _check(self, tenant: str, session_id: str, tokens: np.ndarray, spans: list[Span], field: str) -> None:
        if not spans:
            return
        pos = 0
        for j, span in enumerate(spans):
            where = f"{field}[{j}]"
            rec = self._get(tenant, session_id, span.sequence_id, where)
            self._match(
                tokens, pos, span, rec.tokens if span.kind == "sampled" else rec.prompt, where, "model_input"
            )
            pos += span.length
        if pos != len(tokens):
            raise UserError(
                f"{field} cover {pos} positions; model_input has {len(tokens)} tokens", field=field
            )

    @staticmethod
    def _match(arr: np.ndarray, pos: int, span: Span, src: np.ndarray, where: str, what: str) -> None:
        if span.offset + span.length > len(src):
            raise UserError(
                f"{where}: offset {span.offset} + length {span.length} is past the {len(src)} "
                f"{span.kind} tokens of sequence {span.sequence_id!r}",
                field=where,
            )
        if pos + span.length > len(arr) or not np.array_equal(
            arr[pos : pos + span.length], src[span.offset : span.offset + span.length]
        ):
            raise UserError(
                f"{where}: {what}[{pos}:{pos + span.length}] are not the {span.kind} tokens "
                f"[{span.offset}:{span.offset + span.length}] recorded for sequence {span.sequence_id!r}",
                field=where,
            )


def spans_of(msg_datum) -> Provenance | None:
    """A protobuf Datum's provenance (None when it has none)."""

    def one(spans) -> list[Span]:
        out = []
        for s in spans:
            which = s.WhichOneof("span")
            if which is None:
                continue
            inner = getattr(s, which)
            kind = "prompt" if which == "prompt_tokens" else "sampled"
            if not inner.sequence_id or inner.offset < 0 or inner.length < 0:
                raise UserError(
                    "provenance spans need a sequence_id, offset >= 0 and length >= 0",
                    field="loss_fn_input_spans",
                )
            if inner.length == 0:
                continue  # covers nothing: left out, so a request's spans are at most its tokens
            out.append(Span(kind, inner.sequence_id, int(inner.offset), int(inner.length)))
        return out

    model_input, targets = one(msg_datum.model_input_spans), one(msg_datum.loss_fn_input_spans)
    if not model_input and not targets:
        return None
    return Provenance(model_input, targets)
