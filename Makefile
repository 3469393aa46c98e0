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
# The prepared embedded model, the XLA compilation caches and the executable store: user-level, as uv's and pip's
# (runtime.settings' default), so a second run and a second clone reuse what the first compiled. Keyed by what shapes
# a program (jaxlib, XLA flags, the runtime's source, the model, the CPU class): nothing stale is ever taken.
XDG_CACHE_HOME ?= $(HOME)/.cache
SCOREFN_CACHE_DIR ?= $(XDG_CACHE_HOME)/scorefn
export SCOREFN_CACHE_DIR
# Every environment installs from lock/ (hashes, `make lock` regenerates it) with uv, which pip bootstraps here.
UV_VENV ?= .venv-uv
UV := $(UV_VENV)/bin/uv
# uv does not read pip's configuration: where the CPU build of PyTorch (torch==2.13.0+cpu) lies. This machine
# has it in /opt/wheels; elsewhere the PyTorch CPU index's page lists the same file (the lock checks its hash).
TORCH_FIND_LINKS ?= $(if $(wildcard /opt/wheels/torch-*),/opt/wheels,https://download.pytorch.org/whl/cpu/torch/)
export TORCH_FIND_LINKS
SYNC = $(UV) pip sync --quiet --require-hashes --python $(PY)
# Packages are installed compiled to bytecode: a process then reads it instead of compiling the sources of JAX,
# transformers and PyTorch again, ~5 s of every Python process's start on 2 cores where PYTHONDONTWRITEBYTECODE is
# set (and the servers, batch jobs and workers the tests start are dozens of processes).
export UV_COMPILE_BYTECODE = 1

.PHONY: serve serve-check serve-only-setup test bench loadtest warmup setup setup-test setup-aot lock docs image-check clean

$(UV): lock/uv.txt
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install --quiet --require-hashes --no-deps -r lock/uv.txt
	touch $@

$(PY): | $(UV)
	$(UV) venv --quiet --python $(PYTHON) $(VENV)

# Stamps make a second run skip what is already done (redone when the lock or pyproject.toml changes).
# `uv pip sync` makes the venv exactly the lock (removing anything else), then scorefn itself goes in editable.
$(VENV)/.serve-installed: lock/serve.txt lock/embedded.txt pyproject.toml | $(PY)
	$(SYNC) lock/serve.txt lock/embedded.txt
	$(UV) pip install --quiet --no-deps --python $(PY) -e .
	touch $@

$(VENV)/.test-installed: lock/test.txt lock/checkov.txt $(VENV)/.serve-installed
	$(SYNC) --find-links $(TORCH_FIND_LINKS) lock/test.txt lock/embedded.txt
	$(UV) pip install --quiet --no-deps --python $(PY) -e .
	UV=$(UV) bash infra/tools/install-checkov.sh  # its own venv: its pins clash with pytest's
	touch $@

# The accelerator plugins for deviceless compiles (tests/aot): serve + the aot extra, from its own lock.
$(AOT_VENV)/bin/python: | $(UV)
	$(UV) venv --quiet --python $(PYTHON) $(AOT_VENV)

$(AOT_VENV)/.aot-installed: lock/aot.txt pyproject.toml | $(AOT_VENV)/bin/python
	$(UV) pip sync --quiet --require-hashes --python $(AOT_VENV)/bin/python lock/aot.txt
	$(UV) pip install --quiet --no-deps --python $(AOT_VENV)/bin/python -e .
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
serve-check: serve-only-setup
	$(SERVE_VENV)/bin/python scripts/serve_check.py

serve-only-setup: | $(UV)
	$(MAKE) --no-print-directory setup VENV=$(SERVE_VENV)

# Two pytest-xdist workers (CI's cores), each given whole modules (--dist loadfile: a module's fixtures start once);
# each holds PyTorch and JAX models (~5 GB at most), so more workers need more memory as well as cores. Then the
# tests that judge wall-clock behaviour (marker `timing`), alone on an idle host as their verdicts were measured
# (exit 5: PYTEST_ARGS selected none of them).
# The serve-only check (CPU) runs while the test and accelerator venvs install (downloads and disk, ~1 min from an
# empty uv cache), once the serve-only venv and the prepared model it reads are in place; --output-sync keeps each
# target's lines together.
TEST_WORKERS ?= 2
test: serve-only-setup
	$(MAKE) --no-print-directory -j3 --output-sync=target serve-check setup-test setup-aot
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not timing" $(PYTEST_ARGS)
	$(PY) -m pytest -m timing $(PYTEST_ARGS) || [ $$? -eq 5 ]

bench: setup-test
	$(VENV)/bin/scorefn bench $(BENCH_ARGS)

loadtest: setup-test
	$(PY) -m loadtests.run $(LOADTEST_ARGS)

# Regenerate lock/ after a change to pyproject.toml's dependencies or extras (scripts/lock.sh says what each file is).
lock: $(UV)
	UV=$(UV) bash scripts/lock.sh

# The documentation site (mkdocs.yml, docs/) into .cache/site; --strict: a broken link, anchor or generated table fails.
# NO_MKDOCS_2_WARNING silences Material for MkDocs' end-of-life notice (docs/development.md, "These docs").
DOCS_DIR ?= .cache/site
docs: $(VENV)/.test-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $(DOCS_DIR)

# Build the cpu image with podman and check it as Cloud Run / Kubernetes run it (scripts/image_check.py).
image-check:
	$(PYTHON) scripts/image_check.py

# The clone's own files; the user-level caches (SCOREFN_CACHE_DIR) stay, as uv's do: `rm -rf ~/.cache/scorefn`.
clean:
	rm -rf $(VENV) $(SERVE_VENV) $(AOT_VENV) $(UV_VENV) .venv-checkov .cache .pytest_cache
