"""What the service (``openrl_service``) and the notebook side (``openrl_jupyter``) share, so that
neither imports the other: standard library only, no torch, no FastAPI, no Jupyter."""
