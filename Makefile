# The two commands: `make demo` and `make test`. Everything else is a step they take.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(shell find proto -name '*.proto')
GEN_STAMP := api/python/abada/.generated
# Set-up steps print one line each; what they say in full goes to this file (its tail on failure).
SETUP_LOG := .abada/setup.log
STEP := scripts/step.sh $(SETUP_LOG)

.PHONY: all venv proto lint test demo bench images dist clean

all: test

$(STAMP): requirements-dev.txt services/common/pyproject.toml sdk/python/pyproject.toml services/engine/pyproject.toml services/agent-worker/pyproject.toml services/credential-broker/pyproject.toml api/python/pyproject.toml examples/pyproject.toml
	@$(STEP) "python virtualenv (.venv)" bash -c 'test -x $(PY) || $(PYTHON) -m venv $(VENV)'
	@$(STEP) "pip" $(PY) -m pip install --quiet --upgrade pip
	@$(STEP) "build and test tools (requirements-dev.txt)" $(PY) -m pip install --quiet -r requirements-dev.txt
	@$(MAKE) --no-print-directory $(GEN_STAMP)
	@$(STEP) "generated stubs package (api/python)" $(PY) -m pip install --quiet --no-deps -e api/python
	@$(STEP) "services, shared library, SDK and demo parts" $(PY) -m pip install --quiet -e api/python -e services/common -e sdk/python -e services/engine -e services/credential-broker -e services/agent-worker -e examples
	@touch $(STAMP)

venv: $(STAMP)

$(GEN_STAMP): $(PROTOS) api/python/stub_builder.py
	@rm -rf api/python/abada
	@$(STEP) "gRPC stubs from proto/ (api/python/abada)" $(PY) scripts/gen_protos.py
	@touch $(GEN_STAMP)

# The OpenAPI documents of the HTTP side (api/openapi/) follow the protos' HTTP rules.
proto: $(STAMP) $(GEN_STAMP)
	@$(STEP) "OpenAPI documents from the HTTP rules (api/openapi)" $(PY) scripts/gen_openapi.py

# mypy reads mypy.ini: the services, the SDK and abada-common, strict on abada-common and the
# engine's store; its cache (.mypy_cache) makes a second run take seconds.
lint: venv proto
	$(VENV)/bin/buf lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Test files run in this many processes (pytest-xdist), each file's tests in one of them.
TEST_PROCESSES ?= 2

test: venv proto
	@$(STEP) "buf lint" $(VENV)/bin/buf lint
	@$(STEP) "ruff check" $(VENV)/bin/ruff check .
	@$(STEP) "ruff format --check" $(VENV)/bin/ruff format --check .
	@$(STEP) "mypy (types)" $(VENV)/bin/mypy
	$(VENV)/bin/pytest -n $(TEST_PROCESSES) --dist loadfile

# The stubs and the SDK as wheels (dist/), for `pip install` where there is no clone: abada-api's
# build runs protoc itself (api/python/setup.py).
dist: venv
	rm -rf dist
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir dist ./api/python ./sdk/python

# make demo PROVIDER=openai | anthropic | gemini (the default)
PROVIDER ?= gemini
demo: venv proto
	@$(PY) examples/demo.py --provider $(PROVIDER)

# Benchmarks, with their bench-only dependencies (the pgqueuer peer, py-spy); not part of `make test`.
BENCH_RUNS ?= 3
bench: venv proto
	$(PY) -m pip install --quiet -r bench/requirements.txt
	cd bench && ../$(PY) summary.py --runs $(BENCH_RUNS)

# make images REGISTRY=registry.example.com/team TAG=0.1.0: builds the three images the chart runs
# (REGISTRY/abada/engine:TAG, …/credential-broker, …/agent-worker) and pushes them; without REGISTRY
# it only builds abada/…:TAG locally. TAG defaults to the chart's appVersion (what it deploys).
# Needs a Docker engine with BuildKit; the chart then takes `image.registry=REGISTRY`.
REGISTRY ?=
TAG ?= $(shell sed -n 's/^appVersion: *"\(.*\)"/\1/p' charts/abada/Chart.yaml)
IMAGE_PREFIX ?= $(if $(REGISTRY),$(REGISTRY)/abada,abada)
# Each is the root Dockerfile with SERVICE, its directory under services/ (and its image's name).
SERVICES := engine credential-broker agent-worker

images:
	@set -e; for name in $(SERVICES); do \
	  echo "docker build --build-arg SERVICE=$$name -t $(IMAGE_PREFIX)/$$name:$(TAG) ."; \
	  docker build --build-arg SERVICE=$$name -t $(IMAGE_PREFIX)/$$name:$(TAG) .; \
	  if [ -n "$(REGISTRY)" ]; then echo "docker push $(IMAGE_PREFIX)/$$name:$(TAG)"; docker push $(IMAGE_PREFIX)/$$name:$(TAG); fi; \
	done

clean:
	rm -rf $(VENV) api/python/abada api/python/build .abada dist
