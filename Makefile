# Two commands for a newcomer: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The test environment pins the CPU build of torch that ships on these machines.
# On a GPU machine: `make demo TORCH_SPEC=torch` picks up a CUDA build instead.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# setuptools' notice on every editable install (folders named like the packages may shadow them) is silenced:
# the layout test checks no module shadows another, and the notice read to a newcomer like a failure.

.PHONY: install bytecode demo docs test test-quick test-bench test-cluster hosts lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	PYTHONWARNINGS="ignore:::setuptools.command.editable_wheel" $(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(PY) -m strata demo

lint: install
	$(PY) -m ruff check .

# The reference pages (docs/) as a site in site/; a broken link or a page left out of the nav fails it
# (not with --quiet: mkdocs then drops the warnings that --strict counts).
docs: install
	$(PY) -m mkdocs build --strict

# Two pytest processes (pytest-xdist), one per core; each test file runs whole in one of them, so a module's
# cluster or server starts once. TEST_WORKERS=0 runs the suite in this process alone.
TEST_WORKERS ?= 2
# Bytecode for the repo's own modules, written once: every Ray worker imports them, and where
# PYTHONDONTWRITEBYTECODE is set (as on CI) each process would compile them again (0.7 CPU s for all).
SOURCES := strata pipelines train tune infer bench tests
bytecode: install
	$(PY) -m compileall -q $(SOURCES)

test: lint bytecode
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(TEST_ARGS)

# The inner loop: the tests that start no Ray, no server and no S3 API server (docs/tests.md).
QUICK := not ray and not s3 and not serve and not hosts and not slow and not bench and not cluster
test-quick: bytecode
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(PY) -m pytest -m '$(QUICK)' $(TEST_ARGS)

# strata on a cluster of hosts (network namespaces on a bridge; needs root): every case, the partition ones
# `make test` runs and those it leaves out. `make hosts` starts that cluster for a person, until Ctrl-C.
test-cluster: install
	$(PY) -m pytest tests/test_hosts.py -m 'not bench'

hosts: install
	$(PY) tests/hosts.py

# The benchmark smoke runs `make test` leaves out (about 2 minutes on 2 cores); `make bench` runs the benchmarks.
test-bench: install
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(PY) -m pytest -m bench

# The peer that bench.peer runs against: datatrove, pinned, in an environment of its own (not a dependency).
PEER_VENV := .venv-peer
PEER_STAMP := $(PEER_VENV)/.installed

$(PEER_STAMP): bench/peer-requirements.txt
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install --quiet -r bench/peer-requirements.txt
	touch $(PEER_STAMP)

bench: install $(PEER_STAMP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(PY) -m bench

clean:
	rm -rf $(VENV) $(PEER_VENV) .pytest_cache .ruff_cache strata-data
