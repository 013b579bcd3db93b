"""Opt-in (`make image-cuda` runs it after building the image; not collected by `make test` or
`make image-check`): the CUDA service image, built, runs as the GPU overlay's container would, as far as a
machine without a GPU allows: its entrypoint is the service's command, torch is a CUDA build, vLLM and the
service's vLLM sampler import as uid 10001 with a read-only root. On a machine with a GPU,
bench/gpu_check.sh runs inside it (k8s/README.md says how)."""

from __future__ import annotations

import pytest

from tests.images._containers import engine_or_skip, image_or_skip, images, sh

pytestmark = pytest.mark.timeout(900)


def test_the_cuda_image_imports_its_sampler_as_the_gpu_overlay_runs_it():
    eng = engine_or_skip()
    tag = image_or_skip(eng, "service-cuda")
    check = (
        "import torch, vllm, openrl_service.sampling.vllm_sampler as s; "
        "assert torch.version.cuda, torch.__version__; "
        "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)"
    )
    run = [eng, "run", "--rm", *images.limit_args(eng), "--user", "10001:10001", "--read-only"]
    run += ["--read-only-tmpfs=false"] if eng == "podman" else []
    run += ["--cap-drop", "ALL", "--tmpfs", "/tmp:rw,size=2g,mode=1777", "--entrypoint", "python3", tag]
    out = sh(*run, "-c", check, timeout=600).stdout
    assert "cuda 13" in out or "cuda 12" in out, out
    help_ = sh(eng, "run", "--rm", *images.limit_args(eng), tag, "serve", "--help").stdout
    assert "--sampler" in help_, help_
