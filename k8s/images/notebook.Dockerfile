# syntax=docker/dockerfile:1
# The JupyterHub user image: the Jupyter docker-stacks minimal notebook + openrl-jupyter (the magics,
# no torch) + the Tinker SDK for `%openrl token`. singleuser.image in k8s/jupyterhub/values.yaml.
#   docker build -f k8s/images/notebook.Dockerfile -t ghcr.io/OWNER/openrl-notebook:0.1.0 .
FROM quay.io/jupyter/minimal-notebook:2025-10-06

COPY --chown=1000:100 pyproject.toml README.md /tmp/openrl-jupyter/
COPY --chown=1000:100 openrl_jupyter /tmp/openrl-jupyter/openrl_jupyter
COPY --chown=1000:100 openrl_service /tmp/openrl-jupyter/openrl_service
RUN pip install --no-cache-dir "/tmp/openrl-jupyter[tinker]" \
    && rm -rf /tmp/openrl-jupyter

# jovyan, docker-stacks' NB_UID (the chart's singleuser.uid is 1000 too)
USER 1000
