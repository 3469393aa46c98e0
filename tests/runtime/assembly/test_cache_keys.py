"""The compile caches outlive a clone (user-level, as uv's and pip's), so nothing stale may ever come out of them: a
changed runtime source file, XLA flag or jaxlib version misses both the executable store (its fingerprint) and JAX's
persistent compilation cache (its key)."""

from __future__ import annotations

import importlib.metadata

import jax
import jax.numpy as jnp
import pytest

from runtime.assembly import store
from runtime.model.config import load_config
from runtime.model.kernels import Kernels
from runtime.model.transformer import Transformer
from runtime.model.weights import load_arrays
from tests.conftest import CACHE_DIR, REPO
from tests.runtime.conftest import stored_executables


@pytest.fixture(scope="module")
def executables(tiny_llama_dir):
    cfg = load_config(tiny_llama_dir)
    return stored_executables(Transformer(cfg, load_arrays(tiny_llama_dir, cfg), "float32", Kernels(), 32, 1))


def fingerprint_of(executables) -> str:
    return store.fingerprint(store.fingerprint_parts(executables.model, executables.state, executables.devices,
                                                     (1, 1)))


def test_the_caches_are_user_level_not_the_clones():
    assert REPO not in CACHE_DIR.resolve().parents  # $XDG_CACHE_HOME/scorefn (else ~/.cache/scorefn) by default


def test_a_changed_source_flag_or_jaxlib_is_another_executable_set(executables, tmp_path, monkeypatch):
    same = fingerprint_of(executables)
    assert same == executables.fingerprint == fingerprint_of(executables)
    source = tmp_path / "model" / "extra.py"
    source.parent.mkdir()
    source.write_text("x = 1\n")
    files = store.source_files()
    monkeypatch.setattr(store, "source_files", lambda: [*files, source])
    before = fingerprint_of(executables)
    source.write_text("x = 2\n")  # an edit of one runtime source file
    assert fingerprint_of(executables) not in (before, same)
    monkeypatch.setattr(store, "source_files", lambda: files)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert fingerprint_of(executables) != same
    monkeypatch.delenv("XLA_FLAGS")
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.0.0" if name == "jaxlib" else version(name))
    assert fingerprint_of(executables) != same


def test_a_changed_flag_or_jaxlib_misses_the_persistent_cache(tmp_path, monkeypatch):
    from jax._src import cache_key

    store.enable_persistent_cache(tmp_path / "xla")
    x = jnp.arange(8.0)

    def misses_compiling() -> int:
        jax.clear_caches()  # JAX's in-memory caches: the next call compiles, or loads from the persistent one
        before = store.cache_events()["misses"]
        jax.jit(lambda v: v * 3.0 + 1.0)(x).block_until_ready()
        return store.cache_events()["misses"] - before

    assert misses_compiling() == 1 and misses_compiling() == 0  # compiled, then loaded
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert misses_compiling() == 1
    monkeypatch.delenv("XLA_FLAGS")
    assert misses_compiling() == 0
    monkeypatch.setattr(cache_key, "jaxlib_version_str", "0.0.0")
    assert misses_compiling() == 1
