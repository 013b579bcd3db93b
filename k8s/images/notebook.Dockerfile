# The JupyterHub user image (singleuser.image in k8s/jupyterhub/values.yaml): Debian's Python 3.11, JupyterLab
# with this project's panel and server extension, openrl-jupyter (the magics; no torch), the Tinker SDK
# for `%openrl token`, pandas and matplotlib for the project's notebooks, and JupyterHub at the chart's
# version (4.4.0 runs JupyterHub 5.5.0) for `jupyterhub-singleuser`, the command the chart starts.
# What zero-to-jupyterhub expects of it: user jovyan, uid 1000, group users (gid 100, the chart's
# fsGid), home /home/jovyan (the user's volume mounts there), port 8888.
# Every Python package comes from the wheelhouse k8s/images/images.py fills on the host
# (build/images/notebook: this project's wheel with the built lab extension, the rest from PyPI),
# bind-mounted, so the build reaches only Debian's apt and needs no node. `make images` does it all; by
# hand, from the repo root:
#   python k8s/images/images.py wheels notebook
#   docker build -f k8s/images/notebook.Dockerfile -t ghcr.io/OWNER/openrl-notebook:0.1.0 .
ARG BASE=debian:bookworm-slim
FROM ${BASE}

ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    SHELL=/bin/bash \
    NB_USER=jovyan \
    NB_UID=1000 \
    NB_GID=100 \
    HOME=/home/jovyan

# tini reaps the kernels' children; the venv belongs to jovyan so `%pip install` works in a notebook,
# as it does in the Jupyter docker-stacks images.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv tini \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log \
    && useradd --uid 1000 --gid 100 --create-home --home-dir /home/jovyan --shell /bin/bash jovyan \
    && python3 -m venv /opt/venv \
    && chown -R 1000:100 /opt/venv

# The lab extension and the server extension's enable file come inside this project's wheel
# (share/jupyter/labextensions, etc/jupyter/jupyter_server_config.d of the venv).
# WHEELHOUSE: the wheelhouse's digest (images.py passes it), so a changed project rebuilds this step
ARG WHEELHOUSE=unset
RUN --mount=type=bind,source=build/images/notebook,target=/build \
    pip install --no-index --find-links /build/wheels -r /build/requirements.txt \
    && chown -R 1000:100 /opt/venv \
    && jupyter labextension list 2>&1 | grep -q "openrl-jupyter-labextension.*enabled" \
    && jupyter server extension list 2>&1 | grep -q "openrl_jupyter.*enabled" \
    && command -v jupyterhub-singleuser >/dev/null

USER 1000
WORKDIR /home/jovyan
EXPOSE 8888
ENTRYPOINT ["tini", "-g", "--"]
CMD ["jupyterhub-singleuser"]
