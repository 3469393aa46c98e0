"""One composition path from settings, a model config (with its weights, or only their shapes) and a set of
devices (real, or compile-only stand-ins for a target) to a Scorer: what serving starts and what
`scorefn compile --target` compiles are the same programs under the same executable-store fingerprint.

The devices' backend decides the platform choices (runtime.serving.platform), never the backend of the process
that compiles. Without weights the parameter state is abstract (shapes, dtypes and shardings from the config):
such a scorer compiles and stores every bucket, and a later start with the weights finds them.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from runtime.model.config import ModelConfig
from runtime.serving.buckets import BucketPlan
from runtime.settings import Settings

if TYPE_CHECKING:
    from runtime.serving.executables import ExecutableStore

log = logging.getLogger("scorefn.runtime")


def bucket_plan(settings: Settings, platform) -> BucketPlan:
    return BucketPlan(
        lengths=settings.length_buckets, batches=platform.batch_buckets, max_tokens=platform.max_bucket_tokens,
        labels=platform.label_buckets, context_lengths=settings.context_buckets,
        suffix_lengths=settings.suffix_length_buckets,
        suffix_batches=platform.suffix_batch_buckets, prefix_sharing=settings.prefix_sharing,
        completion_batches=platform.completion_batch_buckets, packing=platform.packing)


def executable_store(settings: Settings) -> "ExecutableStore":
    """The executable store of these settings (under the compile cache): what a start loads and a compile fills."""
    from runtime.serving.executables import ExecutableStore

    return ExecutableStore(Path(settings.xla_cache_dir) / "executables")


def compose(settings: Settings, cfg: ModelConfig, arrays: dict[str, np.ndarray] | None = None, *,
            devices: Sequence[Any] | None = None, lazy: bool = False, probe: bool = True, quiet: bool = False,
            store: "ExecutableStore | None" = None):
    """(Scorer, Platform) for this model on these devices (default: this host's). `arrays` None: abstract
    parameters, for compiling only. `probe`: run the cuDNN start-up probe (a real GPU only). `quiet`: no platform
    log line (the start's second composition says it). `store`: default, the settings' executable store."""
    import jax

    from runtime.model.transformer import Llama
    from runtime.serving import platform as platforms
    from runtime.serving.executables import Executables
    from runtime.serving.scorer import Scorer
    from runtime.serving.sharding import build_layout, parse_mesh

    devices = list(devices if devices is not None else jax.local_devices())
    backend = platforms.backend_of(devices[0])
    platform = platforms.resolve(settings, backend)
    data_axis, _ = parse_mesh(settings.mesh, len(devices))
    platform = platforms.fit_to_data_axis(platform, settings, data_axis)
    plan = bucket_plan(settings, platform)
    if cfg.task != "causal_lm":  # no language-model head: no per-position log-probabilities
        plan = dataclasses.replace(plan, completion_batches=())
    # SCOREFN_MESH; a bad layout (MeshError) stops the start here, before any compilation.
    layout = build_layout(settings.mesh, cfg, plan, devices)
    explicit = settings.attention == "cudnn"
    platform = platforms.fit_to_model(platform, cfg, plan.max_length, explicit, probe=probe and arrays is not None)
    platform = platforms.fit_to_layout(platform, layout, explicit)
    if not quiet:
        log.info("platform %s", platform.describe())

    def model() -> Llama:
        if arrays is not None:
            return Llama(cfg, arrays, platform.dtype, platform.kernels, plan.max_length)
        from flax import nnx

        from runtime.model.weights import array_shapes

        shapes = {name: jax.ShapeDtypeStruct(shape, np.float32) for name, shape in array_shapes(cfg).items()}
        return nnx.eval_shape(lambda a: Llama(cfg, a, platform.dtype, platform.kernels, plan.max_length), shapes)

    store = store or executable_store(settings)
    if layout is None or arrays is None:  # one device (the unsharded runtime), or nothing to place
        built = model()
    else:
        with layout.staging():  # weights too large for one device are placed shard by shard
            built = model()
    exe = Executables(built, shardings=layout, lazy=lazy, store=store, device=devices[0])
    return Scorer(built, plan, executables=exe), platform


def load_stored(settings: Settings, cfg: ModelConfig, store: "ExecutableStore") -> tuple[str, dict[tuple, Any]]:
    """(fingerprint, {(entry point, bucket): executable}) of what the executable store holds for this model's
    start on this host, loaded from its config alone: a start deserializes them while its weights load (the
    fingerprint needs parameter shapes, not values). Nothing (and no error) when the start would fail anyway;
    it fails in the real composition, saying why. `store`: the one the start's scorer uses (a set that does not
    load is then logged once)."""
    import concurrent.futures
    import os

    try:
        scorer, _ = compose(settings, cfg, probe=False, quiet=True, store=store)
    except Exception as exc:  # e.g. a mesh that cannot be built: the start with the weights reports it
        log.debug("stored executables not preloaded: %s", exc)
        return "", {}
    exe = scorer.exe
    keys = [(method, key) for method, key, _ in scorer.work()]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # deserializing releases the GIL
        loaded = list(pool.map(lambda mk: exe.store.load(exe.fingerprint, *mk), keys))
    return exe.fingerprint, {mk: compiled for mk, compiled in zip(keys, loaded) if compiled is not None}

