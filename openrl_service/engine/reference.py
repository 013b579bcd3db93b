"""The reference policy of the notebook API's KL term (``train_step``'s ``kl_coef``; the term itself is
training/losses.py's ``kl_ref_coef`` over ``ref_logprobs``): a native run's starting weights, that is
the checkpoint it was created from (``load_from``), else its base model.

A train step with ``kl_coef > 0`` gets its datums' reference logprobs here before it is journaled, so
its intent holds them and a replay needs nothing else. They are one forward-only pass on the device
worker, in a lane of their own (the reference never changes, so it needs no place in the run's order):
the trainer's own forward (``Trainer.forward_backward``, on this process's device, whatever trainer
the model has: one device, or rank 0 of a group, as sampling is), so the reference and the policy
are computed by the same code and a run that has not moved from its start reports ``kl_ref`` 0. The
weights are the base model's (no adapter) or the checkpoint's, read through the OpenAI API's adapter
cache (engine/inference.py); the run's own weights, gradients and optimizer are not touched.

The checkpoint's digest is recorded when the run is created from it: if the checkpoint is overwritten
or deleted later, a step with ``kl_coef`` is refused (naming ``kl_coef``) rather than silently
measured against other weights.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np

from openrl_service.engine.futures import FutureRecord
from openrl_service.engine.inference import Target
from openrl_service.engine.ops import Op
from openrl_service.engine.state import RunState
from openrl_service.errors import Conflict, NotFound
from openrl_service.training.trainer import DatumArrays, ForwardResult, Trainer, TrainState

# a reference logprob of -inf (a token the reference rules out) becomes this: k3 clamps ref - lp at
# -20 anyway (losses.KL_REF_LOG_RATIO_CAP), and the engine's checks refuse non-finite inputs
REF_FLOOR = -1e4


class References:
    """Each native run's reference (run id -> the checkpoint it was created from; absent: its base
    model) and the op computing a train step's reference logprobs."""

    def __init__(self, svc: Any):  # the TrainingService
        self.svc = svc
        self.of: dict[str, dict] = {}  # run id -> {"path": load_from, "digest": its weights' SHA-256}

    def remember(self, tenant: str, run_id: str, path: str) -> None:
        """Run ``run_id`` starts from checkpoint ``path`` (read its digest: off the event loop)."""
        self.of[run_id] = {
            "path": path,
            "digest": self.svc.inference.resolve(tenant, path, "load_from").digest,
        }

    def forget(self, run_ids: list[str]) -> None:
        for r in run_ids:
            self.of.pop(r, None)

    def _target(self, tenant: str, run_id: str) -> Target | None:
        """The run's reference checkpoint as it is now, or None for its base model (off the loop)."""
        ref = self.of.get(run_id)
        if ref is None:
            return None
        what = f"kl_coef: the run's reference, the checkpoint it was created from ({ref['path']}),"
        try:
            target = self.svc.inference.resolve(tenant, ref["path"], "kl_coef")
        except NotFound as e:
            raise NotFound(f"{what} is gone ({e.message}); train with kl_coef 0", field="kl_coef") from None
        if target.digest != ref["digest"]:
            raise Conflict(
                f"{what} was overwritten since the run was made from it; train with kl_coef 0 or "
                "create a run from the new checkpoint",
                field="kl_coef",
            )
        return target

    async def with_ref_logprobs(
        self,
        tenant: str,
        run: RunState,
        data: list[DatumArrays],
        wait: Callable[[FutureRecord], Awaitable[Any]],
    ) -> list[DatumArrays]:
        """``data`` with ``ref_logprobs`` (laid out as ``target_tokens``) added to each datum's inputs;
        ``wait`` awaits the op's future (NativeRuns._result)."""
        target = await anyio.to_thread.run_sync(self._target, tenant, run.run_id)
        trainer = self.svc.model_of(run).trainer
        plain = [DatumArrays(d.tokens, {"target_tokens": d.inputs["target_tokens"]}) for d in data]

        def work() -> ForwardResult:
            state = None  # the base model
            if target is not None:
                weights = self.svc.inference.adapter(tenant, target)
                state = TrainState(spec=weights.spec, adapter=weights, optimizer=None)  # type: ignore[arg-type]
            # the base class's call: on this process's device alone (a group's rank 0), never a group pass
            return Trainer.forward_backward(trainer, state, plain, "cross_entropy", {}, forward_only=True)

        op = Op(
            kind="reference",
            lane=f"reference:{run.run_id}",
            fn=work,
            future=self.svc.futures.new(tenant, "json"),
            run_id=run.run_id,
            tokens=lambda result: result.tokens,
        )
        rec = self.svc._queue(op, None, None)
        try:
            result: ForwardResult = await wait(rec)
        finally:  # its caller takes the result here: nobody polls for it, no snapshot keeps it
            self.svc.futures.drop(rec)
        out = []
        for d, ref in zip(data, result.logprobs, strict=True):
            ref = np.nan_to_num(np.asarray(ref, dtype=np.float32), nan=0.0, posinf=0.0, neginf=REF_FLOOR)
            out.append(DatumArrays(d.tokens, {**d.inputs, "ref_logprobs": np.maximum(ref, REF_FLOOR)}))
        return out
