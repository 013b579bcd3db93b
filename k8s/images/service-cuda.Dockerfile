# openrl-service on an NVIDIA GPU with the vLLM sampler (k8s/overlays/gke-gpu-*). No CUDA base image:
# vllm==0.32.0 (the `vllm` extra) pins torch 2.13.0, whose PyPI build brings the CUDA 13 runtime, cuDNN
# and NCCL as wheels; the node provides the driver (GKE's driver installer mounts it at
# /usr/local/nvidia; CUDA 13 needs driver >= 580). Every Python package comes from the wheelhouse
# k8s/images/images.py fills on the host (build/images/service-cuda, ~5 GB of wheels), bind-mounted.
# `make image-cuda` does it all (opt-in: the wheels are too large for CI, which checks instead that they
# resolve for this base's Python and glibc: `images.py resolve service-cuda`); by hand, from the repo root:
#   python k8s/images/images.py wheels service-cuda
#   docker build -f k8s/images/service-cuda.Dockerfile -t ghcr.io/OWNER/openrl-service-cuda:0.1.0 .
ARG BASE=debian:bookworm-slim
FROM ${BASE}

ENV PATH=/opt/openrl/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp/home

# Triton (under vLLM and torch.compile) compiles small C helpers at run time: gcc and Python's headers.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log \
    && groupadd --gid 10001 openrl \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin openrl \
    && python3 -m venv /opt/openrl

# WHEELHOUSE: the wheelhouse's digest (images.py passes it), so a changed project rebuilds this step.
# The import check needs no GPU: torch, vLLM and the service's vLLM sampler import, and torch is a
# CUDA build (torch.version.cuda is set; torch.cuda.is_available() is the node's business).
ARG WHEELHOUSE=unset
RUN --mount=type=bind,source=build/images/service-cuda,target=/build \
    pip install --no-index --find-links /build/wheels -r /build/requirements.txt \
    && pip uninstall -y -q pip \
    && python3 -c "import torch, vllm, openrl_service.sampling.vllm_sampler; assert torch.version.cuda, torch.__version__; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)"

WORKDIR /data
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["openrl-service"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data", "--sampler", "vllm"]
