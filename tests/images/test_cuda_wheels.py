"""The CUDA service image's wheels (vLLM 0.32.0, torch's CUDA build and the CUDA runtime) resolve for the
base image's Python (Debian bookworm's 3.11.2) and glibc (2.36), read from the package index without
downloading them (~5 GB: building the image is the opt-in `make image-cuda`, which then runs
tests/images/cuda_check.py on it)."""

from __future__ import annotations

import pytest

from tests.images._containers import images
from tests.k8s._k8s import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.timeout(600)


def test_the_cuda_images_wheels_resolve_for_the_bases_python_and_glibc():
    pins = images.resolve(images.SPECS["service-cuda"])
    (vllm_req,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "vllm"
    ]
    assert f"vllm=={pins['vllm']}" == vllm_req, (pins.get("vllm"), vllm_req)
    # PyPI's torch for Linux is the CUDA build: no local "+cpu" wheel of this machine slipped in
    assert "torch" in pins and "+" not in pins["torch"], pins.get("torch")
    assert any(name.startswith("nvidia-cuda-runtime") for name in pins), sorted(pins)
    assert any(name.startswith("nvidia-cudnn") for name in pins) and any("nccl" in n for n in pins), sorted(
        pins
    )
    assert "openrl-jupyter" in pins and "peft" in pins and "fastapi" in pins
