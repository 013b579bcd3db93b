# openrl-service on CPU: the tiny model on any node (k8s/overlays/cpu). Debian's own Python 3.11 in a
# venv; every Python package comes from the wheelhouse k8s/images/images.py fills on the host
# (build/images/service-cpu: this project's wheel, torch's CPU wheel, the rest from PyPI, and the
# requirements.txt it resolved), bind-mounted, so no layer keeps a wheel and the build reaches only
# Debian's apt. `make images` does it all; by hand, from the repo root:
#   python k8s/images/images.py wheels service-cpu
#   docker build -f k8s/images/service-cpu.Dockerfile -t ghcr.io/OWNER/openrl-service:0.1.0 .
# No key is baked in: the Deployment mounts the admin's Secret (--api-keys-file).
ARG BASE=debian:bookworm-slim
FROM ${BASE}

ENV PATH=/opt/openrl/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp/home

# python3-venv brings ensurepip; no compiler: every wheel is prebuilt for CPython 3.11 / glibc 2.36.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log \
    && groupadd --gid 10001 openrl \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin openrl \
    && python3 -m venv /opt/openrl

# The service and Kubernetes extras (the Jobs launcher), offline from the wheelhouse; pip itself is
# removed afterwards (nothing installs at run time). pip compiles the bytecode here: the root filesystem
# is read-only at run time (PYTHONDONTWRITEBYTECODE).
# WHEELHOUSE: the wheelhouse's digest (images.py passes it), so a changed project rebuilds this step
ARG WHEELHOUSE=unset
RUN --mount=type=bind,source=build/images/service-cpu,target=/build \
    pip install --no-index --find-links /build/wheels -r /build/requirements.txt \
    && pip uninstall -y -q pip \
    && openrl-service --help >/dev/null

WORKDIR /data
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["openrl-service"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data"]
