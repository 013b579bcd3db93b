"""Browser tests: a headless JupyterLab driven by Debian chromium through Playwright."""
