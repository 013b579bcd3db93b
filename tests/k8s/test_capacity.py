"""k8s/README.md's capacity section shows what k8s/capacity.py computes from this repo's code."""

from __future__ import annotations

import functools
import importlib.util
import sys

from tests.k8s._k8s import K8S


@functools.cache
def load_capacity():
    spec = importlib.util.spec_from_file_location("k8s_capacity", K8S / "capacity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_readme_shows_what_the_capacity_script_computes():
    capacity = load_capacity()
    readme = (K8S / "README.md").read_text()
    section = readme.split("## Capacity: how many users per L4 / H100 for LoRA RL", 1)[1].split("\n## ", 1)[0]
    for line in capacity.report().splitlines():
        assert line in section, f"k8s/README.md's capacity section lacks (rerun k8s/capacity.py):\n{line}"
    # the assumptions the numbers rest on are stated beside them
    for words in ("f = 0.25", "a quarter of the users", "8 prompts × group 8", "not\nmeasured here"):
        assert words in section, words


def test_the_measured_bytes_per_adapter_parameter_are_float32_weights_gradients_and_adamw():
    """Weights, gradients and AdamW's two moments, float32: 16 bytes a parameter, measured on a real
    adapter after a real step (the figure every per-run number of the section rests on)."""
    assert load_capacity().bytes_per_adapter_parameter() == 16.0


def test_adapter_size_follows_the_rank_and_the_lora_targets():
    capacity = load_capacity()
    r8, r32 = (capacity.adapter_parameters("Qwen2.5-1.5B", r) for r in (8, 32))
    assert r32 == 4 * r8
    # 28 layers of q, k, v, o, gate, up, down plus lm_head (1536 + 151936), rank 8
    per_layer = (1536 + 1536) * 2 + (1536 + 256) * 2 + (1536 + 8960) * 2 + (8960 + 1536)
    assert r8 == 8 * (28 * per_layer + 1536 + 151936)
