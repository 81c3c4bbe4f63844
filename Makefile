# The two commands: `make demo` and `make test`. Everything else is a step they take.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(shell find proto -name '*.proto')
GEN_STAMP := api/python/abada/.generated

.PHONY: all venv proto lint test demo bench images clean

all: test

$(STAMP): requirements-dev.txt sdk/python/pyproject.toml services/engine/pyproject.toml services/agent-worker/pyproject.toml services/credential-broker/pyproject.toml api/python/pyproject.toml examples/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(MAKE) --no-print-directory $(GEN_STAMP)
	$(PY) -m pip install --quiet --no-deps -e api/python
	$(PY) -m pip install --quiet -e api/python -e sdk/python -e services/engine -e services/credential-broker -e services/agent-worker -e examples
	touch $(STAMP)

venv: $(STAMP)

$(GEN_STAMP): $(PROTOS)
	rm -rf api/python/abada
	$(PY) scripts/gen_protos.py
	touch $(GEN_STAMP)

proto: $(STAMP) $(GEN_STAMP)

lint: venv
	$(VENV)/bin/buf lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: venv proto
	$(VENV)/bin/buf lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest

demo: venv proto
	$(PY) examples/demo.py

# Benchmarks, with their bench-only dependencies (the pgqueuer peer, py-spy); not part of `make test`.
BENCH_RUNS ?= 3
bench: venv proto
	$(PY) -m pip install --quiet -r bench/requirements.txt
	cd bench && ../$(PY) summary.py --runs $(BENCH_RUNS)

IMAGE_PREFIX ?= abada
IMAGE_TAG ?= $(shell sed -n 's/^appVersion: *"\(.*\)"/\1/p' charts/abada/Chart.yaml)

# Builds where a Docker engine (with BuildKit) is available; CI machines here have none.
images:
	docker build -f services/engine/Dockerfile -t $(IMAGE_PREFIX)/engine:$(IMAGE_TAG) .
	docker build -f services/credential-broker/Dockerfile -t $(IMAGE_PREFIX)/credential-broker:$(IMAGE_TAG) .
	docker build -f services/agent-worker/Dockerfile -t $(IMAGE_PREFIX)/agent-worker:$(IMAGE_TAG) .

clean:
	rm -rf $(VENV) api/python/abada .abada
