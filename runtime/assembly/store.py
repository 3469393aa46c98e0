"""Where compiled programs are kept between starts: JAX's persistent compilation cache (keyed by the lowered
program) and the executable store (serialized executables under a fingerprint of everything that shapes them:
JAX versions, devices, this runtime's source, the model's config, kernels, parameter layout, JAX/XLA environment), so
a warm start loads executables without tracing (measured on the CPU: 0.26-0.43 s to trace and lower a bucket,
0.05-0.08 s to load its executable).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import importlib.metadata
import json
import logging
import os
import pickle
import threading
import zlib
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import flax
import jax
from flax import nnx
from jax._src.custom_partitioning import _ShardingCallbackInfo  # see _without_partitioning_callbacks
from jax.experimental import serialize_executable
from jax._src import compilation_cache as jax_compilation_cache  # see _keep_cache_hits_bytes
from jax.experimental.compilation_cache import compilation_cache

from runtime.assembly.platform import MAX_ISA, backend_of, compile_class
from runtime.assembly.targets import library_versions

log = logging.getLogger("scorefn.runtime")

_cache_events = {"hits": 0, "misses": 0, "backend_compiles": 0}
STORE_LOAD_EVENT = "/scorefn/executable_store/load"  # recorded through jax.monitoring (tests/compile_report.py)
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
            _keep_cache_hits_bytes()
            _listener_installed = True


def _keep_cache_hits_bytes() -> None:
    """Leave with the thread the bytes of each executable it loads from JAX's persistent cache. XLA:CPU cannot
    serialize such an executable again (it loses its generated functions: "NOT_FOUND: Function ... not found" once
    loaded; jaxlib 0.10.2), but the cache's bytes are what serializing it fresh gave: the store keeps those
    (_serialize). Else a program the cache answered (another model's, another source's with the same program) was
    never stored, and every later start traced and lowered it again."""
    read = jax_compilation_cache.get_executable_and_time

    def read_keeping_bytes(cache_key, compile_options, backend, executable_devices):
        executable, compile_time = read(cache_key, compile_options, backend, executable_devices)
        if executable is not None:
            with contextlib.suppress(Exception):  # no bytes kept: the executable is not stored, as before
                raw = jax_compilation_cache._get_cache(backend).get(cache_key)
                serialized, _ = jax_compilation_cache.extract_executable_and_time(
                    jax_compilation_cache.decompress_executable(raw))
                _this_thread.cached = (executable, serialized)
        return executable, compile_time

    jax_compilation_cache.get_executable_and_time = read_keeping_bytes


def enable_persistent_cache(directory: str | Path) -> None:
    """Point JAX's persistent compilation cache at `directory`/cpu-<the class compiled for>, caching every
    executable. Its keys do not say which CPU features the machine code needs: an image's entries from an AMX
    build host could stop an AVX2 host on an illegal instruction, so each class has its own."""
    directory = Path(directory) / f"cpu-{compile_class()}"
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()  # so a new directory takes effect in a process that compiled before
    install_listeners()


def cache_events() -> dict[str, int]:
    """Persistent-cache hits and misses and XLA backend compilations seen by this process."""
    return dict(_cache_events)


def cache_hits_in_this_thread() -> int:
    """Persistent-cache hits of the compilations this thread ran (a compile in between that did not add one was
    fresh)."""
    return getattr(_this_thread, "hits", 0)


def _serialize(compiled: jax.stages.Compiled, from_cache: bool) -> tuple:
    """serialize_executable.serialize; for an executable this thread loaded from the persistent cache (its last),
    with the cache's bytes for it (_keep_cache_hits_bytes). Raises where those were not kept."""
    cached, _this_thread.cached = getattr(_this_thread, "cached", None), None
    if not from_cache:
        return serialize_executable.serialize(compiled)
    unloaded = compiled._executable._unloaded_executable
    if cached is None or cached[0] is not unloaded.xla_executable:
        raise ValueError("loaded from the persistent cache, and its bytes were not kept")
    args_info, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    with io.BytesIO() as file:
        _CachedBytesPickler(file, cached).dump((unloaded, args_info, compiled._no_kwargs))
        return file.getvalue(), in_tree, compiled.out_tree


class _CachedBytesPickler(serialize_executable._JaxPjrtPickler):
    def __init__(self, file, cached: tuple):
        super().__init__(file)
        self.cached = cached

    def persistent_id(self, obj):
        if obj is self.cached[0]:
            return ("exec", self.cached[1])
        return super().persistent_id(obj)


class ExecutableStore:
    """Serialized executables in `directory`/<fingerprint>/, one file per (program, bucket), and beside them
    manifest.json: the fingerprint's parts, so a start that finds nothing under its own can say what differs."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._unloadable: set[str] = set()  # fingerprints whose executables did not load: compile instead
        self._lock = threading.Lock()  # Executables.warm_up loads from several threads

    def _path(self, fingerprint: str, method: str, key: tuple) -> Path:
        return self.directory / fingerprint / f"{method}-{'x'.join(map(str, key)) or 'scalar'}.jaxexe"

    def holds(self, fingerprint: str, method: str, key: tuple) -> bool:
        """Whether an executable is stored for (program, bucket) under `fingerprint` (not loading it)."""
        return self._path(fingerprint, method, key).is_file()

    def load(self, fingerprint: str, method: str, key: tuple, devices: list) -> jax.stages.Compiled | None:
        """The stored executable, loaded onto `devices` (those it was compiled for, in the mesh's order); None when
        it is not stored or does not load."""
        path = self._path(fingerprint, method, key)
        if fingerprint in self._unloadable or not path.is_file():
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(zlib.decompress(path.read_bytes()))
            loaded = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                               backend=devices[0].client, execution_devices=devices)
            jax.monitoring.record_event(STORE_LOAD_EVENT)
            return loaded
        except Exception as exc:  # unreadable, from another build, or compiled deviceless for a device it does not fit
            with self._lock:  # one line for the set, not one per bucket (nor per loading thread)
                first = fingerprint not in self._unloadable
                self._unloadable.add(fingerprint)
            if first:
                log.warning("executable store: %s did not load (%s: %s); compiling every bucket not yet loaded "
                            "instead", path, type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "")
            return None

    def save(self, fingerprint: str, method: str, key: tuple, compiled: jax.stages.Compiled,
             from_cache: bool = False) -> int:
        """Serialize and store (`from_cache`: loaded from the persistent cache by this thread, last); returns the
        bytes written (0 when it could not be stored)."""
        path = self._path(fingerprint, method, key)
        try:
            with _without_partitioning_callbacks(compiled):
                # Compressed: machine code and HLO shrink 7-8x (68 to 9 MB for the embedded model's CPU set, 0.14 s
                # to decompress on one core), so an image carries several sets in the space of one.
                blob = zlib.compress(pickle.dumps(_serialize(compiled, from_cache)), 6)
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


def source_files() -> list[Path]:
    """The sources that shape a compiled program: the model (runtime/model), the shapes it is compiled for
    (runtime/shapes) and how it is compiled and placed (runtime/assembly, but for the service model's start-up timing).
    Tasks, tools, the handler, the engine and what happens per request (runtime/requests) do not change an
    executable: a change to admission or scheduling keeps the stored executables (an image's baked set, a warm cache).
    """
    runtime = Path(__file__).resolve().parent.parent
    return sorted([*(runtime / "model").glob("*.py"), *(runtime / "shapes").glob("*.py"),
                   *(p for p in (runtime / "assembly").glob("*.py") if p.name != "calibration.py")])


def source_digest() -> str:
    """A digest of source_files(): what a stored executable was made by."""
    digest = hashlib.sha256()
    for path in source_files():  # each named by its package and file (model/layers.py): where the clone is matters not
        digest.update(f"{path.parent.name}/{path.name}".encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# Environment variables that do not shape a compiled program: the compile for a target runs with
# JAX_PLATFORMS=cpu, the service without; allocator and cache settings only matter at run time.
_RUNTIME_ONLY_ENV = ("JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR", "XLA_PYTHON_CLIENT_")


def fingerprint_parts(model: nnx.Module, state: Any, devices: list, mesh_shape: tuple[int, ...],
                      cpu_class: str | None = None) -> dict:
    """What shapes a compiled executable besides its entry point and bucket, as a compile-only device and the real
    one both report it: the backend, device kind and count, the mesh, the CPU feature class compiled for (a CPU
    backend; default: this process's, runtime.assembly.platform.compile_class),
    library versions, this runtime's source, the model (config, dtype, kernels), every parameter's shape, dtype and
    partition spec, JAX/XLA settings.
    Not the PJRT client's platform version nor a sharding's device ids: a compile-only client reports its own."""
    backend = backend_of(devices[0])
    return {
        "versions": {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
                     "flax": flax.__version__, **library_versions(backend)},
        "devices": [backend, devices[0].device_kind, len(devices), list(mesh_shape)],
        "cpu": (cpu_class or compile_class()) if backend == "cpu" else None,
        "source": source_digest(),
        "model": [repr(model.cfg), str(model.dtype), repr(model.kernels), model.window],
        "state": [(jax.tree_util.keystr(path), list(x.shape), str(x.dtype), _spec(x))
                  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]],
        "env": compile_env(),
        "config": [str(jax.config.jax_default_matmul_precision), bool(jax.config.jax_enable_x64)],
    }


def compile_env(environ: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """The JAX_/XLA_ variables that shape a compile; XLA_FLAGS without the ISA cap, which "cpu" already says."""
    env = ((k, MAX_ISA.sub("", v).strip()) for k, v in environ.items()
           if k.startswith(("JAX_", "XLA_")) and not k.startswith(_RUNTIME_ONLY_ENV))
    return sorted((k, v) for k, v in env if v)


def _spec(x: Any) -> str:
    sharding = getattr(x, "sharding", None)
    return str(sharding.spec) if hasattr(sharding, "spec") else "one device"


def fingerprint(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]
