"""Ahead-of-time compiled executables, one per shape bucket, through JAX's persistent compilation cache.

Parameters are an argument of every executable (never captured), so the compiled code does not depend
on the weights and the persistent cache can be reused across starts and baked into an image.
A `jax.stages.Compiled` never recompiles: a shape outside the compiled set raises instead.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

log = logging.getLogger("scorefn.runtime")

_cache_events = {"hits": 0, "misses": 0, "backend_compiles": 0}
_listener_lock = threading.Lock()
_listener_installed = False


def _on_event(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _cache_events["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _cache_events["misses"] += 1


def _on_duration(event: str, duration: float, **_: Any) -> None:
    # Every XLA compilation in the process, ours or not: the proof that requests never compile.
    if event == "/jax/core/compile/backend_compile_duration":
        _cache_events["backend_compiles"] += 1


def install_listeners() -> None:
    global _listener_installed
    with _listener_lock:
        if not _listener_installed:
            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listener_installed = True


def enable_persistent_cache(directory: str | Path) -> None:
    """Point JAX's persistent compilation cache at `directory`, caching every executable."""
    from jax.experimental.compilation_cache import compilation_cache

    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()  # so a new directory takes effect in a process that compiled before
    install_listeners()


def cache_events() -> dict[str, int]:
    """Persistent-cache hits and misses and XLA backend compilations seen by this process."""
    return dict(_cache_events)


def abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


class Executables:
    """Compiled entry points of one model, keyed by (entry point, shape bucket)."""

    def __init__(self, model: nnx.Module, shardings: "Any | None" = None, lazy: bool = False):
        self.graphdef, self.state = nnx.split(model)
        self.lazy = lazy  # compile a missing bucket on first use: for one-shot CLI runs, never for serving
        self.shardings = shardings  # runtime.sharding.Layout or None (single device: no sharding at all)
        if shardings is not None:
            self.state = shardings.put_state(self.state)  # every parameter placed with its sharding, once
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self._lock = threading.Lock()
        self.compiles = 0  # executables compiled (or loaded from the persistent cache) by this object

    def _entry(self, method: str) -> Callable:
        graphdef = self.graphdef

        def run(state, *args):
            model = nnx.merge(graphdef, state)
            return getattr(model, method)(*args)
        return run

    def lower(self, method: str, *example_args: jax.ShapeDtypeStruct) -> jax.stages.Lowered:
        """Trace `method` for the given argument shapes (Python-bound: one thread at a time)."""
        jitted = jax.jit(self._entry(method)) if self.shardings is None else self.shardings.jit(
            self._entry(method), method, self.state, example_args)
        return jitted.lower(abstract(self.state), *example_args)

    def add(self, method: str, key: tuple, lowered: jax.stages.Lowered) -> None:
        """Compile a lowered entry point (or load it from the persistent cache); safe to call from threads."""
        compiled = lowered.compile()
        with self._lock:
            self._compiled[(method, key)] = compiled
            self.compiles += 1

    def compile(self, method: str, key: tuple, *example_args: jax.ShapeDtypeStruct) -> float:
        """Compile `method` for the given argument shapes; return seconds taken."""
        started = time.perf_counter()
        self.add(method, key, self.lower(method, *example_args))
        return time.perf_counter() - started

    def has(self, method: str, key: tuple) -> bool:
        return (method, key) in self._compiled

    def __call__(self, method: str, key: tuple, *args: Any) -> Any:
        if (method, key) not in self._compiled:
            if not self.lazy:
                raise RuntimeError(f"no compiled executable for {method} {key}: every bucket must be warmed up")
            self.compile(method, key, *abstract(args))
        return self._compiled[(method, key)](self.state, *args)


def spec(shape: tuple[int, ...], dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
