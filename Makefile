# Two commands for a newcomer: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The test environment pins the CPU build of torch that ships on these machines.
# On a GPU machine: `make demo TORCH_SPEC=torch` picks up a CUDA build instead.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(PY) -m strata demo

lint: install
	$(PY) -m ruff check .

test: lint
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(PY) -m pytest

bench: install
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(PY) -m bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache strata-data
