# Two entry points for a fresh machine: `make run` (main job) and `make test`.
# Both create/update the local virtualenv .venv and install what they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch's CPU build unless a CUDA driver is present (a bare `torch` pulls a multi-GB CUDA build).
TORCH  ?= $(shell if command -v nvidia-smi >/dev/null 2>&1; then echo "torch>=2.4"; else echo "torch==2.13.0"; fi)

.PHONY: run test bench venv clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/edgecore up

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(STAMP)
	for b in decode kv_codec transport kv_quality ttft serve batch pack parallel; do $(PY) bench/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) *.egg-info
