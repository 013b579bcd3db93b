# syntax=docker/dockerfile:1
# openrl-service on CPU: the tiny model on any node (k8s/overlays/cpu). Build from the repo root:
#   docker build -f k8s/images/service-cpu.Dockerfile -t ghcr.io/OWNER/openrl-service:0.1.0 .
# No key is baked in: the Deployment mounts the admin's Secret (--api-keys-file).
FROM python:3.11.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp/home \
    SKIP_JUPYTER_BUILDER=1

RUN groupadd --gid 10001 openrl && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin openrl

WORKDIR /build
COPY pyproject.toml README.md constraints-cpu.txt ./
COPY openrl_service ./openrl_service
COPY openrl_jupyter ./openrl_jupyter
COPY openrl_common ./openrl_common
# (SKIP_JUPYTER_BUILDER: no Jupyter in this image, so the wheel is built without the lab extension and node.)
# torch's CPU wheel first (the version constraints-cpu.txt pins), then the package with its service extra.
RUN pip install --index-url https://download.pytorch.org/whl/cpu -c constraints-cpu.txt torch \
    && pip install -c constraints-cpu.txt ".[service,k8s]" \
    && rm -rf /build

WORKDIR /data
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["openrl-service"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data"]
