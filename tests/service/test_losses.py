"""Each built-in loss returns per-datum logprobs and a `loss:sum` equal to its published formula.

The formulas are re-computed here in numpy from the logprobs the service returns, so a wrong sign,
a mean instead of a sum or a missing clip shows up as a mismatch. Gradients are checked against
`forward_backward_custom` (the SDK's client-side loss) for the same objective.
"""

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from openrl_service.training.optim_params import AdamParams
from tests._support.numerics import GRADS_ATOL_OF_MAX, adamw_in_float64, assert_weights_match
from tests.conftest import TINY

PROMPT = [72, 105, 58, 32]


def rl_datum(completion, q, adv, extra=None):
    full = PROMPT + completion
    n_prompt = len(PROMPT) - 1
    inputs = {
        "target_tokens": full[1:],
        "logprobs": [0.0] * n_prompt + q,
        "advantages": [0.0] * n_prompt + adv,
    }
    inputs.update(extra or {})
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)


@pytest.fixture
def tc(service_client):
    return service_client.create_lora_training_client(base_model=TINY, rank=8, seed=11).result()


def current_logprobs(tc, data):
    out = tc.forward(
        [
            types.Datum(
                model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]}
            )
            for d in data
        ],
        "cross_entropy",
    ).result()
    return [o["logprobs"].to_numpy().astype(np.float64) for o in out.loss_fn_outputs]


def make_data(rng):
    data = []
    for n, a in ((5, 1.5), (3, -0.7), (6, 0.4)):
        completion = rng.integers(97, 123, size=n).tolist()
        q = (rng.normal(-3.0, 1.0, size=n)).tolist()
        data.append(rl_datum(completion, q, [a] * n))
    return data


def expected(loss_fn, lps, data, config):
    total = 0.0
    for lp, d in zip(lps, data, strict=True):
        q = d.loss_fn_inputs["logprobs"].to_numpy().astype(np.float64)
        adv = d.loss_fn_inputs["advantages"].to_numpy().astype(np.float64)
        act = adv != 0
        r = np.exp(np.where(act, lp - q, 0.0))
        lo, hi = config.get("clip_low_threshold"), config.get("clip_high_threshold")
        if loss_fn == "importance_sampling":
            tok = r * adv
        elif loss_fn == "ppo":
            tok = np.minimum(r * adv, np.clip(r, lo, hi) * adv)
        elif loss_fn == "cispo":
            tok = np.clip(r, lo, hi) * lp * adv
        elif loss_fn == "dro":
            tok = lp * adv - 0.5 * config["beta"] * (lp - q) ** 2
        elif loss_fn == "gspo":
            s = np.mean((lp - q)[act])
            rs = np.exp(np.full_like(lp, s))
            tok = np.minimum(rs * adv, np.clip(rs, lo, hi) * adv)
        total += -(tok * act).sum()
    return total


@pytest.mark.parametrize(
    ("loss_fn", "config"),
    [
        ("importance_sampling", {}),
        ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("dro", {"beta": 0.1}),
        ("gspo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}),
    ],
)
def test_rl_loss_matches_formula(tc, loss_fn, config):
    data = make_data(np.random.default_rng(0))
    lps = current_logprobs(tc, data)
    out = tc.forward(data, loss_fn, config).result()
    for o, lp in zip(out.loss_fn_outputs, lps, strict=True):
        np.testing.assert_allclose(o["logprobs"].to_numpy(), lp, rtol=1e-5, atol=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(expected(loss_fn, lps, data, config), rel=1e-4, abs=1e-4)


def test_cross_entropy_signed_weights_and_nk_targets(tc):
    seq = [72, 101, 108, 108, 111]
    weights = [1.0, -0.5, 2.0, 0.0]
    d1 = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": weights},
    )
    out = tc.forward([d1], "cross_entropy").result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert out.metrics["loss:sum"] == pytest.approx(-(lp * np.array(weights)).sum(), rel=1e-5)
    # [N, K] targets: K candidate tokens per position, each with its own weight.
    targets = torch.tensor([[101, 102], [108, 109], [108, 110], [111, 112]])
    w2 = torch.tensor([[1.0, 0.5], [1.0, 0.0], [0.25, 1.0], [1.0, -1.0]])
    d2 = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(targets),
            "weights": types.TensorData.from_torch(w2),
        },
    )
    out2 = tc.forward([d2], "cross_entropy").result()
    lp2 = out2.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert lp2.shape == (4, 2)
    np.testing.assert_allclose(lp2[:, 0], lp, rtol=1e-5)
    assert out2.metrics["loss:sum"] == pytest.approx(-(lp2 * w2.numpy()).sum(), rel=1e-5)


def test_losses_are_sums_not_means(tc):
    data = make_data(np.random.default_rng(1))
    one = tc.forward(data[:1], "importance_sampling").result().metrics["loss:sum"]
    two = tc.forward(data[:1] * 2, "importance_sampling").result().metrics["loss:sum"]
    assert two == pytest.approx(2 * one, rel=1e-6)


def test_an_unsupported_loss_is_a_user_error_listing_the_supported_ones(tc):
    with pytest.raises(tinker.RequestFailedError) as e:
        tc.forward_backward(make_data(np.random.default_rng(2)), "custom").result()
    msg = str(e.value)
    for name in ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"):
        assert name in msg


def test_forward_backward_custom_matches_builtin_gradients(server, service_client):
    """A custom loss equal to importance_sampling gives the same update as the built-in one."""
    data = make_data(np.random.default_rng(3))
    builtin = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=12).result()
    custom = service_client.create_lora_training_client(base_model=TINY, rank=8, seed=12).result()
    builtin.forward_backward(data, "importance_sampling").result()

    def is_loss(data, logprobs_list):
        total = 0
        for d, lp in zip(data, logprobs_list, strict=True):
            q = torch.tensor(d.loss_fn_inputs["logprobs"].to_numpy())
            adv = torch.tensor(d.loss_fn_inputs["advantages"].to_numpy())
            active = adv != 0
            total = (
                total - (torch.exp(torch.where(active, lp - q, torch.zeros_like(lp))) * adv * active).sum()
            )
        return total, {}

    custom.forward_backward_custom(data, is_loss).result()
    states = [server.service.runs[c.model_id].state for c in (builtin, custom)]
    g_builtin, g_custom = ([p.grad.clone() for p in st.adapter.parameters()] for st in states)
    for a, b in zip(g_custom, g_builtin, strict=True):  # measured on CPU: bit-identical
        torch.testing.assert_close(a, b, rtol=0, atol=GRADS_ATOL_OF_MAX * float(b.abs().max()))
    # The update itself: AdamW in float64 from the compared gradient (weights after Adam are not
    # compared element-wise across runs: a near-zero gradient still moves its weight by ~lr).
    expected = adamw_in_float64(states[1], AdamParams(learning_rate=1e-2))
    adam = types.AdamParams(learning_rate=1e-2)
    g1 = builtin.optim_step(adam).result().metrics["grad_norm:mean"]
    g2 = custom.optim_step(adam).result().metrics["grad_norm:mean"]
    assert g2 == pytest.approx(g1, rel=1e-4)
    assert_weights_match(states[1].adapter.parameters(), expected, 1e-2)
