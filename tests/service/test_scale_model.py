"""The built-in scale models (`make bench-scale`): the tiny model's recipe at 28 M and 181 M parameters,
named like the tiny variants, with as many parameters as their shapes say."""

import json

import pytest

from openrl_service.models.loading import parameter_count
from openrl_service.models.tiny import (
    SCALE_30M_MODEL_NAME,
    SCALE_180M_MODEL_NAME,
    TINY_MODEL_NAME,
    TINY_WIDE_MODEL_NAME,
    build_tiny_model,
    tiny_folder_name,
    tiny_variant,
    tree_digest,
    variant_parameters,
)


def stored_parameters(folder) -> int:
    """Weights in the folder's safetensors file, from its header (what the service counts)."""
    return parameter_count(str(folder), data_dir=folder)


@pytest.mark.parametrize("spec", ["scale-30m", "scale-180m", "openrl/scale-30m"])
def test_specs_name_the_scale_models(spec):
    name = tiny_variant(spec)
    assert name in (SCALE_30M_MODEL_NAME, SCALE_180M_MODEL_NAME)
    assert tiny_folder_name(name) == name.replace("/", "-")


def test_sizes():
    assert 25e6 <= variant_parameters(SCALE_30M_MODEL_NAME) <= 35e6
    assert 175e6 <= variant_parameters(SCALE_180M_MODEL_NAME) <= 185e6


def test_the_shape_formula_counts_what_is_built(tmp_path, tiny_model_dir):
    assert stored_parameters(tiny_model_dir) == variant_parameters(TINY_MODEL_NAME)
    wide = build_tiny_model(tmp_path / "wide", TINY_WIDE_MODEL_NAME)
    assert stored_parameters(wide) == variant_parameters(TINY_WIDE_MODEL_NAME)
    scale = build_tiny_model(tmp_path / "scale", SCALE_30M_MODEL_NAME)
    assert stored_parameters(scale) == variant_parameters(SCALE_30M_MODEL_NAME)
    cfg = json.loads((scale / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (10, 8, 2)
    assert cfg["tie_word_embeddings"] and cfg["_name_or_path"] == SCALE_30M_MODEL_NAME
    assert tree_digest(build_tiny_model(tmp_path / "again", SCALE_30M_MODEL_NAME)) == tree_digest(scale)
