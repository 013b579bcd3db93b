"""The Tinker conformance script (reference/tinker-protocol.md §11), run with the unmodified SDK.

    TINKER_API_KEY=tml-... python tests/_support/tinker_conformance.py http://127.0.0.1:8000 openrl/tiny

It needs only ``tinker==0.38.0`` on the client: no torch, no model hub. Prints ``PASS`` on success.
"""

import math
import os
import sys
import warnings

import tinker
from tinker import types

BASE_URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
BASE_MODEL = sys.argv[2] if len(sys.argv) > 2 else "openrl/tiny"
os.environ.setdefault("TINKER_API_KEY", "tml-local-dev")  # must start with "tml-"
warnings.simplefilter("ignore", FutureWarning)  # load_state is deprecated


def check(c, msg):
    if not c:
        raise SystemExit(f"FAIL: {msg}")
    print("ok  ", msg)


def datum(prompt, completion):
    seq = prompt + completion
    w = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": w},
    )


sc = tinker.ServiceClient(base_url=BASE_URL)
rest = tinker.RestClient(base_url=BASE_URL)
check(
    any(m.model_name == BASE_MODEL for m in rest.get_server_capabilities().result().supported_models),
    "capabilities",
)
tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
check(
    tc.get_info().model_data.model_name == BASE_MODEL and tc.model_id.endswith(":train:0"),
    "create_model+get_info",
)
data = [datum([11, 12, 13, 14], [21, 22, 23]), datum([31, 32], [41, 42, 43, 44])]
fb = tc.forward_backward(data, "cross_entropy").result()
check(
    len(fb.loss_fn_outputs) == 2
    and all(
        o["logprobs"].shape == [d.model_input.length] for o, d in zip(fb.loss_fn_outputs, data, strict=True)
    ),
    "fwd_bwd per-datum logprobs",
)
check(math.isfinite(fb.metrics.get("loss:sum", math.nan)), f"metrics {fb.metrics}")
check(
    isinstance(tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(), types.OptimStepResponse),
    "optim_step",
)
fwd = tc.forward(data, "cross_entropy").result()
check(fwd.metrics["loss:sum"] < fb.metrics["loss:sum"], "loss decreased after a step")
sampler = tc.save_weights_and_get_sampling_client().result()
prompt = types.ModelInput.from_ints([11, 12, 13, 14])
res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=8, temperature=1.0)).result()
s0 = res.sequences[0]
check(len(res.sequences) == 2 and 0 < len(s0.tokens) <= 8 and len(s0.logprobs) == len(s0.tokens), "sample")
check(s0.sequence_id and s0.sequence_id != res.sequences[1].sequence_id, "sequence ids")
lps = sampler.compute_logprobs(prompt).result()
check(len(lps) == prompt.length and lps[0] is None, "compute_logprobs")
state = tc.save_state("ckpt-0001").result()
check(state.path == f"tinker://{tc.model_id}/weights/ckpt-0001", f"save_state {state.path}")
sw = tc.save_weights_for_sampler("sampler-0001").result()
s2 = sc.create_sampling_client(model_path=sw.path).result()
check(
    s2.get_base_model() == BASE_MODEL
    and s2.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result().sequences,
    "sample from saved sampler weights",
)
tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
tc.load_state(state.path).result()
after = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
check(abs(after - fwd.metrics["loss:sum"]) < 1e-3, "load_state restores weights")
tc2 = sc.create_training_client_from_state_with_optimizer(state.path).result()
check(
    abs(tc2.forward(data, "cross_entropy").result().metrics["loss:sum"] - after) < 1e-3, "from_state weights"
)
check(
    {c.checkpoint_type for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    >= {"training", "sampler"},
    "list",
)
check(
    rest.get_training_run_by_tinker_path(state.path).result().training_run_id == tc.model_id, "training run"
)
sc.close("success").result()
print("PASS")
