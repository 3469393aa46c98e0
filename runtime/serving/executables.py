"""Ahead-of-time compiled executables, one per shape bucket, through JAX's persistent compilation cache.

Parameters are an argument of every executable (never captured), so the compiled code does not depend
on the weights and the persistent cache can be reused across starts and baked into an image.
A `jax.stages.Compiled` never recompiles: a shape outside the compiled set raises instead.

JAX's persistent cache is keyed by the lowered program, so even a warm start traces and lowers every
bucket first, and that is most of its time (measured on the CPU: 0.26-0.43 s to trace and lower a bucket,
0.05-0.08 s to load its executable). ExecutableStore keeps each compiled executable serialized under a
fingerprint of everything that shapes it (JAX versions, devices, this runtime's source, the model's
config, kernels, parameter layout, JAX/XLA environment), so a warm start loads executables without tracing.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
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
_this_thread = threading.local()  # persistent-cache hits of the compilation running in this thread


def _on_event(event: str, **_: Any) -> None:
    # JAX records the event in the thread that compiles, so a thread can tell whether its compile was a hit.
    if event == "/jax/compilation_cache/cache_hits":
        _cache_events["hits"] += 1
        _this_thread.hits = getattr(_this_thread, "hits", 0) + 1
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


class ExecutableStore:
    """Serialized executables in `directory`/<fingerprint>/, one file per (entry point, bucket), and beside them
    manifest.json: the fingerprint's parts, so a start that finds nothing under its own can say what differs."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._unloadable: set[str] = set()  # fingerprints whose executables did not load: compile instead
        self._lock = threading.Lock()  # Scorer.compile_all loads from several threads

    def _path(self, fingerprint: str, method: str, key: tuple) -> Path:
        return self.directory / fingerprint / f"{method}-{'x'.join(map(str, key)) or 'scalar'}.jaxexe"

    def load(self, fingerprint: str, method: str, key: tuple) -> jax.stages.Compiled | None:
        from jax.experimental import serialize_executable

        path = self._path(fingerprint, method, key)
        if fingerprint in self._unloadable or not path.is_file():
            return None
        try:
            return serialize_executable.deserialize_and_load(*pickle.loads(path.read_bytes()))
        except Exception as exc:  # unreadable, from another build, or compiled deviceless for a device it does not fit
            with self._lock:  # one line for the set, not one per bucket (nor per loading thread)
                first = fingerprint not in self._unloadable
                self._unloadable.add(fingerprint)
            if first:
                log.warning("executable store: %s did not load (%s: %s); compiling every bucket not yet loaded "
                            "instead", path, type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
            return None

    def save(self, fingerprint: str, method: str, key: tuple, compiled: jax.stages.Compiled) -> int:
        """Serialize and store; returns the bytes written (0 when it could not be stored)."""
        from jax.experimental import serialize_executable

        path = self._path(fingerprint, method, key)
        try:
            with _without_partitioning_callbacks(compiled):
                blob = pickle.dumps(serialize_executable.serialize(compiled))
            _write_atomic(path, blob)
            return len(blob)
        except Exception as exc:  # a read-only image, or an executable that cannot be serialized: fine
            log.debug("executable %s%s not stored: %s", method, key, exc)
            return 0

    def write_manifest(self, fingerprint: str, parts: dict) -> None:
        try:
            _write_atomic(self.directory / fingerprint / "manifest.json", json.dumps(parts, default=str).encode())
        except OSError as exc:
            log.debug("executable store manifest not written: %s", exc)

    def explain_miss(self, fingerprint: str, parts: dict) -> str | None:
        """None when executables are stored under `fingerprint`; else one line: what the stored sets differ in."""
        if any((self.directory / fingerprint).glob("*.jaxexe")):
            return None
        manifests = sorted(self.directory.glob("*/manifest.json"), key=lambda m: m.stat().st_mtime, reverse=True)
        if not manifests:
            return f"executable store {self.directory}: nothing stored yet; compiling every bucket"
        ours = json.loads(json.dumps(parts, default=str))
        try:
            theirs = json.loads(manifests[0].read_text())
        except (OSError, json.JSONDecodeError):
            theirs = {}
        differences = [_difference(key, theirs.get(key), ours.get(key))
                       for key in ours if theirs.get(key) != ours.get(key)]
        return (f"executable store: no executables for this start's fingerprint {fingerprint}; the newest stored set "
                f"({manifests[0].parent.name}, of {len(manifests)}) differs in {'; '.join(differences) or 'nothing'}; "
                f"compiling every bucket")


@contextlib.contextmanager
def _without_partitioning_callbacks(compiled: jax.stages.Compiled):
    """Serialize a sharded program that holds custom-partitioned ops (cuDNN attention on a mesh) without their
    callbacks. jax 0.10.2's custom_partitioning lowering keeps a _ShardingCallbackInfo alive on the executable
    (`module_context.add_keepalive`) so that XLA's SPMD partitioner can call back into Python while compiling;
    it holds a local function (`to_mesh_pspec_sharding`), which pickle refuses. Once compiled, nothing calls it:
    the partitioned program is in the executable, so the serialized copy leaves these keepalives out."""
    from jax._src.custom_partitioning import _ShardingCallbackInfo

    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    kept = getattr(unloaded, "keepalive", None)
    if not kept or not any(isinstance(k, _ShardingCallbackInfo) for k in kept):
        yield
        return
    unloaded.keepalive = [k for k in kept if not isinstance(k, _ShardingCallbackInfo)]
    try:
        yield
    finally:
        unloaded.keepalive = kept


def _difference(key: str, stored: Any, ours: Any) -> str:
    if key == "state":
        return "parameter shapes, dtypes or shardings"
    if key == "source":
        return "the runtime's source (model/, serving/)"
    return f"{key} {json.dumps(stored)} stored, {json.dumps(ours)} here"


def _write_atomic(path: Path, blob: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    partial.write_bytes(blob)
    partial.replace(path)  # atomic: a concurrent reader sees the whole file or none


# runtime/serving modules that decide when work runs, never what a program computes: a change to admission or
# scheduling keeps the stored executables (an image's baked set, a warm cache).
_NOT_IN_PROGRAMS = frozenset({"engine.py", "cost.py", "jobs.py", "scheduler.py", "slices.py"})


def source_files() -> list[Path]:
    """The sources that shape a compiled program: the model (runtime/model) and how it is compiled and placed
    (runtime/serving). Tasks, tools, the handler and admission do not change an executable."""
    runtime = Path(__file__).resolve().parent.parent
    return sorted([*(runtime / "model").glob("*.py"),
                   *(p for p in (runtime / "serving").glob("*.py") if p.name not in _NOT_IN_PROGRAMS)])


def _source_digest() -> str:
    runtime = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(str(path.relative_to(runtime)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# Environment variables that do not shape a compiled program: the compile for a target runs with
# JAX_PLATFORMS=cpu, the service without; allocator and cache settings only matter at run time.
_RUNTIME_ONLY_ENV = ("JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR", "XLA_PYTHON_CLIENT_")


def fingerprint_parts(model: nnx.Module, state: Any, devices: list, mesh_shape: tuple[int, ...]) -> dict:
    """What shapes a compiled executable besides its entry point and bucket, as a compile-only device and the real
    one both report it: the backend, device kind and count, the mesh, library versions, this runtime's source,
    the model (config, dtype, kernels), every parameter's shape, dtype and partition spec, JAX/XLA settings.
    Not the PJRT client's platform version nor a sharding's device ids: a compile-only client reports its own."""
    import flax

    from runtime.serving.platform import backend_of
    from runtime.serving.targets import library_versions

    backend = backend_of(devices[0])
    return {
        "versions": {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
                     "flax": flax.__version__, **library_versions(backend)},
        "devices": [backend, devices[0].device_kind, len(devices), list(mesh_shape)],
        "source": _source_digest(),
        "model": [repr(model.cfg), str(model.dtype), repr(model.kernels), model.window],
        "state": [(jax.tree_util.keystr(path), list(x.shape), str(x.dtype), _spec(x))
                  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]],
        "env": sorted((k, v) for k, v in os.environ.items()
                      if k.startswith(("JAX_", "XLA_")) and not k.startswith(_RUNTIME_ONLY_ENV)),
        "config": [str(jax.config.jax_default_matmul_precision), bool(jax.config.jax_enable_x64)],
    }


def _spec(x: Any) -> str:
    sharding = getattr(x, "sharding", None)
    return str(sharding.spec) if hasattr(sharding, "spec") else "one device"


def fingerprint(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


class Executables:
    """Compiled entry points of one model, keyed by (entry point, shape bucket)."""

    def __init__(self, model: nnx.Module, shardings: "Any | None" = None, lazy: bool = False,
                 store: ExecutableStore | None = None, device: Any | None = None):
        """`device`: the one device of an unsharded model (default: JAX's default device); a compile-only one
        compiles for a target. A model built with nnx.eval_shape has an abstract state: it compiles, never runs."""
        self.graphdef, self.state = nnx.split(model)
        self.matmul_precision = model.kernels.matmul_precision
        self.lazy = lazy  # compile a missing bucket on first use: for one-shot CLI runs, never for serving
        self.shardings = shardings  # runtime.serving.sharding.Layout or None (single device: no sharding at all)
        self.device = device or jax.local_devices()[0]
        # Abstract parameters (no weights) compile and store, never load or run: a target's executables cannot
        # be loaded into the compiling process (its devices are compile-only stand-ins).
        self.compile_only = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.state))
        if shardings is not None:
            self.state = shardings.put_state(self.state)  # every parameter placed with its sharding, once
        elif self.compile_only:
            self.state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._one_device),
                                      self.state)
        devices = list(shardings.mesh.devices.flat) if shardings is not None else [self.device]
        self.fingerprint_parts = fingerprint_parts(
            model, self.state, devices, (shardings.data, shardings.model) if shardings is not None else (1, 1))
        self.store = store
        self.fingerprint = fingerprint(self.fingerprint_parts) if store is not None else ""
        self.stored_bytes: dict[tuple, int] = {}  # (entry point, bucket) -> serialized size, of those stored here
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self._lock = threading.Lock()
        self.compiles = 0  # executables compiled (or loaded from a cache or the store) by this object
        self.loaded = 0  # of which loaded from the store, without tracing

    def _entry(self, method: str) -> Callable:
        graphdef = self.graphdef

        def run(state, *args):
            model = nnx.merge(graphdef, state)
            return getattr(model, method)(*args)
        return run

    @property
    def _one_device(self) -> jax.sharding.Sharding:
        return jax.sharding.SingleDeviceSharding(self.device)

    def lower(self, method: str, *example_args: jax.ShapeDtypeStruct) -> jax.stages.Lowered:
        """Trace `method` for the given argument shapes (Python-bound: one thread at a time)."""
        if self.shardings is None:
            jitted = jax.jit(self._entry(method))
            if self.device != jax.local_devices()[0]:  # a compile-only device: the arguments live there
                example_args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._one_device)
                                     for a in example_args)
        else:
            jitted = self.shardings.jit(self._entry(method), method, self.state, example_args)
        # Traced under the mesh (sharded): runtime.model.attention groups rows by its data axis.
        mesh = jax.set_mesh(self.shardings.mesh) if self.shardings is not None else contextlib.nullcontext()
        with mesh, jax.default_matmul_precision(self.matmul_precision):  # None: the backend's default
            return jitted.lower(abstract(self.state), *example_args)

    def add(self, method: str, key: tuple, lowered: jax.stages.Lowered) -> None:
        """Compile a lowered entry point (or load it from the persistent cache) and store it; safe from threads."""
        hits = getattr(_this_thread, "hits", 0)
        compiled = lowered.compile()
        # Only a fresh compilation is stored: on XLA:CPU an executable loaded from the persistent cache serializes
        # without its generated functions ("NOT_FOUND: Function ... not found" once loaded again; jaxlib 0.10.2).
        if self.store is not None and getattr(_this_thread, "hits", 0) == hits:
            if not self.stored_bytes:
                self.store.write_manifest(self.fingerprint, self.fingerprint_parts)
            size = self.store.save(self.fingerprint, method, key, compiled)
            with self._lock:
                self.stored_bytes[(method, key)] = size
        with self._lock:
            self._compiled[(method, key)] = compiled
            self.compiles += 1

    def load_stored(self, method: str, key: tuple) -> bool:
        """Load a bucket's executable from the store without tracing it; False when it is not there."""
        if self.store is None or self.compile_only:
            return False
        compiled = self.store.load(self.fingerprint, method, key)
        if compiled is None:
            return False
        with self._lock:
            self._compiled[(method, key)] = compiled
            self.compiles += 1
            self.loaded += 1
        return True

    def adopt(self, fingerprint: str, compiled: dict[tuple, jax.stages.Compiled]) -> int:
        """Take executables loaded from the store before this object existed (runtime.serving.compose.load_stored),
        when they were loaded under this object's fingerprint; returns how many were taken."""
        if self.compile_only or not fingerprint or fingerprint != self.fingerprint:
            return 0
        with self._lock:
            new = {k: c for k, c in compiled.items() if k not in self._compiled}
            self._compiled.update(new)
            self.compiles += len(new)
            self.loaded += len(new)
        return len(new)

    def compile(self, method: str, key: tuple, *example_args: jax.ShapeDtypeStruct) -> float:
        """Compile `method` for the given argument shapes; return seconds taken."""
        started = time.perf_counter()
        self.add(method, key, self.lower(method, *example_args))
        return time.perf_counter() - started

    def get(self, method: str, key: tuple) -> jax.stages.Compiled:
        return self._compiled[(method, key)]

    def has(self, method: str, key: tuple) -> bool:
        return (method, key) in self._compiled

    def __call__(self, method: str, key: tuple, *args: Any) -> Any:
        if (method, key) not in self._compiled:
            if not self.lazy:
                raise RuntimeError(f"no compiled executable for {method} {key}: every bucket must be warmed up")
            if not self.load_stored(method, key):
                self.compile(method, key, *abstract(args))
        return self._compiled[(method, key)](self.state, *args)


def spec(shape: tuple[int, ...], dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
