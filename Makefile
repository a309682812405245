# Two entry points for a fresh machine: `make run` (main job) and `make test`.
# Both create/update the local virtualenv .venv and install what they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# An editable install in setuptools' strict mode: a link tree (build/__editable__.*) lays the
# top-level folders out as the one package `edgecore`, so Python, mypy and editors all resolve
# `edgecore.shared...` to the files here. A new or removed module changes the stamp (re-link).
SOURCES := $(shell find __main__.py py.typed core edge deploy models protocol shared -not -path '*__pycache__*' 2>/dev/null | sort | cksum | cut -d' ' -f1)
STAMP  := $(VENV)/.installed-$(SOURCES)
# torch's CPU build unless a CUDA driver is present (a bare `torch` pulls a multi-GB CUDA build).
TORCH  ?= $(shell if command -v nvidia-smi >/dev/null 2>&1; then echo "torch>=2.4"; else echo "torch==2.13.0"; fi)

.PHONY: run test typecheck lint bench venv clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]" --config-settings editable_mode=strict
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/edgecore up

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# The type checker over every production package, untyped definitions disallowed (see pyproject.toml).
TYPED := -p edgecore.protocol -p edgecore.shared -p edgecore.core -p edgecore.edge -p edgecore.deploy
typecheck: $(STAMP)
	$(PY) -m mypy $(TYPED)

# ruff's rule set is in pyproject.toml (pyflakes, pycodestyle errors, bugbear, pyupgrade).
lint: $(STAMP)
	$(VENV)/bin/ruff check core edge protocol shared deploy bench tests __main__.py

bench: $(STAMP)
	for b in decode kv_codec transport kv_quality ttft serve batch pack parallel; do $(PY) bench/$$b.py || exit 1; done

# Container images (deploy/docker/): CPU and CUDA, tagged latest and the package version.
IMAGE   ?= edgecore
# WITH_CXX=1: the CPU image gets a C++ compiler (edges with `compile = true` in the topology)
WITH_CXX ?= 0
CONTAINER_TOOL ?= $(shell command -v docker || command -v podman)
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: image
image:
	@test -n "$(CONTAINER_TOOL)" || { echo "make image: no container tool (docker or podman) on PATH"; exit 1; }
	$(CONTAINER_TOOL) build -f deploy/docker/Dockerfile --build-arg WITH_CXX=$(WITH_CXX) -t $(IMAGE):latest -t $(IMAGE):$(VERSION) .
	$(CONTAINER_TOOL) build -f deploy/docker/Dockerfile.cuda -t $(IMAGE):latest-cuda -t $(IMAGE):$(VERSION)-cuda .

clean:
	rm -rf $(VENV) *.egg-info
