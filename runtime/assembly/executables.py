"""Ahead-of-time compiled executables of one model, one per (program, bucket), and their warm-up.

Parameters are an argument of every executable (never captured), so the compiled code does not depend on the weights
and the compiled programs can be kept between starts (runtime.assembly.store). A `jax.stages.Compiled` never
recompiles: a shape outside the compiled set raises instead. What each program takes is declared in
runtime.shapes.programs, the model function it runs bound to it in runtime.assembly.entry_points.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import os
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from runtime.assembly.entry_points import entry_point
from runtime.assembly.pending import PendingCompiles
from runtime.assembly.sharding import MeshLayout
from runtime.assembly.store import (ExecutableStore, cache_events, cache_hits_in_this_thread, fingerprint,
                                    fingerprint_parts)
from runtime.shapes.programs import PROGRAMS, ModelShapes, Program

log = logging.getLogger("scorefn.runtime")


def compiler_options(kernels, platform: str) -> dict[str, bool | int]:
    """XLA options of every program: with the batch-invariant kernels on a GPU, XLA's deterministic mode (its
    scatter and atomics-based reductions replaced: the same bits every run) and no autotuning (it times candidate
    kernels at compile time, so two compiles of one program, two instances, could pick two GEMMs: two sets of bits)."""
    gpu = platform in ("gpu", "cuda", "rocm")  # a compile-only device names its platform
    if not (kernels.batch_invariant and gpu):
        return {}
    return {"xla_gpu_exclude_nondeterministic_ops": True, "xla_gpu_autotune_level": 0}


class Executables:
    """The compiled programs of one model, keyed by (program, bucket)."""

    def __init__(self, model: nnx.Module, shardings: "MeshLayout | None" = None, lazy: bool = False,
                 store: ExecutableStore | None = None, device: Any | None = None, cpu_class: str | None = None):
        """`device`: the one device of an unsharded model (default: JAX's default device); a compile-only one
        compiles for a target. `cpu_class`: the CPU feature class the executables are for (runtime.assembly.store).
        A model built with nnx.eval_shape has an abstract state: it compiles, never runs."""
        self.model = model  # its config, kernels and RoPE limit (the state lives in `state`)
        self.graphdef, self.state = nnx.split(model)
        self.shapes = ModelShapes.of(model.cfg, model.attention_dtype, model.label_tokens)
        self.matmul_precision = model.kernels.matmul_precision
        self.lazy = lazy  # compile a missing bucket on first use: for one-shot CLI runs, never for serving
        self.shardings = shardings  # or None: a single device, no sharding at all
        self.device = device or jax.local_devices()[0]
        self.compiler_options = compiler_options(model.kernels, self.device.platform)
        # Abstract parameters (no weights) compile and store, never load or run: a target's executables cannot
        # be loaded into the compiling process (its devices are compile-only stand-ins).
        self.compile_only = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.state))
        if shardings is not None:
            self.state = shardings.put_state(self.state, model.declared)  # each placed with its sharding, once
        elif self.compile_only:
            self.state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._one_device),
                                      self.state)
        # The devices the executables run on, in the mesh's order: a stored one is loaded onto exactly these (not
        # onto every device of the process, JAX's default, which an unsharded program on a many-device host is not).
        self.devices = list(shardings.mesh.devices.flat) if shardings is not None else [self.device]
        self.fingerprint_parts = fingerprint_parts(
            model, self.state, self.devices, (shardings.data, shardings.model) if shardings is not None else (1, 1),
            cpu_class)
        self.store = store
        self.fingerprint = fingerprint(self.fingerprint_parts) if store is not None else ""
        self.stored_bytes: dict[tuple, int] = {}  # (program, bucket) -> serialized size, of those stored here
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self._lock = threading.Lock()
        # Held by the store, not loaded yet: each loads when first run, or when the start loads it after ready.
        self._deferred: set[tuple] = set()
        self._loading = threading.Lock()  # one deferred load (or first-use compile) at a time: a run waits for it
        # Not compiled at warm-up (a start ready after its first buckets): compiled after ready in the background.
        self._pending = PendingCompiles(self._compile_key, lambda key: key in self._compiled)
        self.compiles = 0  # executables compiled (or loaded from a cache or the store) by this object
        self.loaded = 0  # of which loaded from the store, without tracing

    def specs(self, program: Program, bucket: tuple[int, ...]) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The program's argument shapes for this bucket (its declaration), as JAX takes them."""
        return tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in program.args(bucket, self.shapes))

    # ---- warm-up: every bucket compiled, or held by the store, before the first request ---------------------

    def warm_up(self, programs: list[tuple[Program, tuple[int, ...]]],
                progress: Callable[[int, str, float], None] | None = None,
                timings: dict[tuple, float] | None = None, first: set[tuple] | None = None) -> int:
        """Compile every (program, bucket) the store does not hold (through the persistent cache); load the first
        one it holds, and defer the others (`ensure` loads one: when first run, or after ready) when that one loads.
        With `first`, compile only those now and leave the others pending (compile_pending). Returns how many there
        are; `progress(done, name, seconds)` after each one loaded or compiled; `timings`, when given, gets their
        seconds."""
        timings = {} if timings is None else timings
        if self.store is not None and not self.compile_only and (
                miss := self.store.explain_miss(self.fingerprint, self.fingerprint_parts)):
            (log.info if "nothing stored yet" in miss else log.warning)(miss)
        missing = [(program.name, bucket) for program, bucket in programs if not self.has(program.name, bucket)]
        held = [key for key in missing if self.holds_stored(*key)]
        done = len(programs) - len(missing)
        # Deserializing all of them took 7-8 CPU seconds of a 17.5-second start (168 buckets, 2-core Intel Xeon,
        # 2026-11-28), and a request needs a few. One loads now, so that a store that does not load (another
        # build's) is known before ready, and everything is compiled instead.
        if held:
            started = time.perf_counter()
            if self.load_stored(*held[0]):
                timings[held[0]] = time.perf_counter() - started
                with self._lock:
                    self._deferred.update(held[1:])
                done += len(held)
                if progress:
                    progress(done, f"{held[0][0]}{held[0][1]} (and {len(held) - 1} deferred)", timings[held[0]])
        todo = [key for key in missing if not self.has(*key)]
        if first is not None:
            self._pending.add([key for key in todo if key not in first])
            todo = [key for key in todo if key in first]
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            def compile_one(name: str, bucket: tuple, lowered, traced: float) -> tuple[str, float]:
                started = time.perf_counter()
                self.add(name, bucket, lowered)
                timings[(name, bucket)] = traced + time.perf_counter() - started
                return f"{name}{bucket}", timings[(name, bucket)]
            futures = []
            for name, bucket in todo:
                started = time.perf_counter()
                lowered = self.lower(name, *self.specs(PROGRAMS[name], bucket))
                futures.append(pool.submit(compile_one, name, bucket, lowered, time.perf_counter() - started))
            for future in concurrent.futures.as_completed(futures):
                label, seconds = future.result()
                done += 1
                if progress:
                    progress(done, label, seconds)
        return len(programs)

    # ---- one program ------------------------------------------------------------------------------------

    def _entry(self, name: str) -> Callable:
        graphdef, function = self.graphdef, entry_point(PROGRAMS[name])

        def run(state, *args):
            model = nnx.merge(graphdef, state)
            return function(model, *args)
        return run

    @property
    def _one_device(self) -> jax.sharding.Sharding:
        return jax.sharding.SingleDeviceSharding(self.device)

    def lower(self, name: str, *example_args: jax.ShapeDtypeStruct) -> jax.stages.Lowered:
        """Trace a program for the given argument shapes (Python-bound: one thread at a time)."""
        if self.shardings is None:
            jitted = jax.jit(self._entry(name))
            if self.device != jax.local_devices()[0]:  # a compile-only device: the arguments live there
                example_args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._one_device)
                                     for a in example_args)
        else:
            jitted = self.shardings.jit(self._entry(name), name, self.state, example_args)
        # Traced under the mesh (sharded): runtime.model.attention groups rows by its data axis.
        mesh = jax.set_mesh(self.shardings.mesh) if self.shardings is not None else contextlib.nullcontext()
        with mesh, jax.default_matmul_precision(self.matmul_precision):  # None: the backend's default
            return jitted.lower(_abstract(self.state), *example_args)

    def add(self, name: str, bucket: tuple, lowered: jax.stages.Lowered) -> None:
        """Compile a lowered program (or load it from the persistent cache) and store it; safe from threads."""
        hits = cache_hits_in_this_thread()
        compiled = lowered.compile(self.compiler_options)
        if self.store is not None:  # loaded from the persistent cache or fresh (runtime.assembly.store._serialize)
            if not self.stored_bytes:
                self.store.write_manifest(self.fingerprint, self.fingerprint_parts)
            size = self.store.save(self.fingerprint, name, bucket, compiled, cache_hits_in_this_thread() != hits)
            with self._lock:
                self.stored_bytes[(name, bucket)] = size
        with self._lock:
            self._compiled[(name, bucket)] = compiled
            self.compiles += 1

    def holds_stored(self, name: str, bucket: tuple) -> bool:
        return self.store is not None and not self.compile_only and self.store.holds(self.fingerprint, name, bucket)

    @property
    def deferred(self) -> int:
        """Executables held by the store, not loaded yet."""
        return len(self._deferred)

    def deferred_keys(self) -> list[tuple]:
        """The deferred (program, bucket)s, smallest bucket first: the order a start loads them in after ready."""
        with self._lock:
            return sorted(self._deferred, key=lambda k: (math.prod(k[1]), k))

    def ensure(self, name: str, bucket: tuple) -> bool:
        """Whether the bucket is compiled or loaded, loading it first if it was deferred (compiling it, should the
        store fail it after all), or waiting for its compile if it is pending."""
        key = (name, bucket)
        if key in self._compiled:
            return True
        if key in self._pending:
            return self._pending.wait_for(key)
        with self._loading:
            if key in self._compiled or key not in self._deferred:
                return key in self._compiled
            if not self.load_stored(name, bucket):  # unreadable since warm-up (the store logged it): compile, once
                self._compile_key(key)
            with self._lock:
                self._deferred.discard(key)
            return True

    @property
    def pending(self) -> int:
        """Buckets left for the background compiler."""
        return len(self._pending)

    def compile_pending(self, progress: Callable[[int, str, float], None] | None = None,
                        stopped: Callable[[], bool] = lambda: False) -> int:
        """The background compiler of the buckets left pending at warm-up (PendingCompiles.compile_all); each stored
        as a warm-up stores it."""
        return self._pending.compile_all(progress, stopped)

    def _compile_key(self, key: tuple) -> None:
        self.add(*key, self.lower(key[0], *self.specs(PROGRAMS[key[0]], key[1])))

    def load_stored(self, name: str, bucket: tuple) -> bool:
        """Load a bucket's executable from the store without tracing it; False when it is not there."""
        if self.store is None or self.compile_only:
            return False
        compiled = self.store.load(self.fingerprint, name, bucket, self.devices)
        if compiled is None:
            return False
        with self._lock:
            self._compiled[(name, bucket)] = compiled
            self.compiles += 1
            self.loaded += 1
        return True

    def compile(self, name: str, bucket: tuple, *example_args: jax.ShapeDtypeStruct) -> float:
        """Compile a program for the given argument shapes; return seconds taken."""
        started = time.perf_counter()
        self.add(name, bucket, self.lower(name, *example_args))
        return time.perf_counter() - started

    @staticmethod
    def backend_compiles() -> int:
        """XLA compilations in this process, ours or not: constant after warm-up (the proof that requests never
        compile)."""
        return cache_events()["backend_compiles"]

    def get(self, name: str, bucket: tuple) -> jax.stages.Compiled:
        self.ensure(name, bucket)
        return self._compiled[(name, bucket)]

    def has(self, name: str, bucket: tuple) -> bool:
        """Whether the bucket runs without compiling: compiled, or loaded or deferred from the store."""
        return (name, bucket) in self._compiled or (name, bucket) in self._deferred

    def __call__(self, name: str, bucket: tuple, *args: Any) -> Any:
        if not self.ensure(name, bucket):
            if not self.lazy:
                raise RuntimeError(f"no compiled executable for {name} {bucket}: every bucket must be warmed up")
            with self._loading:  # launcher threads (runtime.requests.launch) may first run it at once: one compiles
                if (name, bucket) not in self._compiled and not self.load_stored(name, bucket):
                    self.compile(name, bucket, *_abstract(args))
        return self._compiled[(name, bucket)](self.state, *args)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)
