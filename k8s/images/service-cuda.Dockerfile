# syntax=docker/dockerfile:1
# openrl-service on an NVIDIA GPU with the vLLM sampler (k8s/overlays/gke-gpu-*). vllm==0.32.0 (the
# `vllm` extra) brings its CUDA build of torch and the CUDA runtime libraries as wheels; the node
# provides the driver (GKE's driver installer, mounted at /usr/local/nvidia). Build from the repo root:
#   docker build -f k8s/images/service-cuda.Dockerfile -t ghcr.io/OWNER/openrl-service-cuda:0.1.0 .
FROM nvidia/cuda:12.9.1-base-ubuntu24.04

# Triton (under vLLM and torch.compile) compiles small C helpers at run time: gcc and Python headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/openrl \
    PATH=/opt/openrl/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp/home

RUN groupadd --gid 10001 openrl && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin openrl \
    && python3 -m venv /opt/openrl

WORKDIR /build
COPY pyproject.toml README.md ./
COPY openrl_service ./openrl_service
COPY openrl_jupyter ./openrl_jupyter
COPY openrl_common ./openrl_common
# the service image has no Jupyter: the wheel is built without the lab extension (no node)
RUN SKIP_JUPYTER_BUILDER=1 pip install ".[service,vllm,k8s]" && rm -rf /build

WORKDIR /data
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["openrl-service"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data", "--sampler", "vllm"]
