"""One composition path from settings, a model config (with its weights, or only their shapes) and a set of
devices (real, or compile-only stand-ins for a target) to a Scorer: what serving starts and what
`scorefn compile --target` compiles are the same programs under the same executable-store fingerprint.

The devices' backend decides the platform choices (runtime.assembly.platform), never the backend of the process
that compiles. Without weights the parameter state is abstract (shapes, dtypes and shardings from the config):
such a scorer compiles and stores every bucket, and a later start with the weights finds them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from runtime.model import invariant, lora, params
from runtime.model.config import ModelConfig
from runtime.model.transformer import Transformer
from runtime.assembly import attention_fit, platform as platforms
from runtime.shapes.buckets import BucketPlan
from runtime.assembly.executables import Executables
from runtime.requests.prefix_cache import MIN_TOKENS, PrefixCache
from runtime.requests.scorer import Scorer
from runtime.assembly.sharding import build_mesh_layout, parse_mesh
from runtime.assembly.store import ExecutableStore
from runtime.settings import Settings

log = logging.getLogger("scorefn.runtime")


def bucket_plan(settings: Settings, platform) -> BucketPlan:
    return BucketPlan(lengths=settings.length_buckets, max_tokens=platform.max_bucket_tokens,
                      labels=platform.label_buckets, context_lengths=settings.context_buckets,
                      prefix_sharing=settings.prefix_sharing, layout=platform.layout,
                      completion_batches=platform.completion_batch_buckets,
                      lora=bool(lora.slots(settings.lora_adapters, settings.max_loras)),
                      label_tokens=settings.max_label_tokens,
                      kept_prompts=MIN_TOKENS if settings.prefix_cache_bytes != 0 else 0)


def executable_store(settings: Settings) -> ExecutableStore:
    """The executable store of these settings (under the compile cache): what a start loads and a compile fills."""
    return ExecutableStore(Path(settings.xla_cache_dir) / "executables")


def compose(settings: Settings, cfg: ModelConfig, arrays: dict[str, np.ndarray] | None = None, *,
            devices: Sequence[Any] | None = None, lazy: bool = False, probe: bool = True, quiet: bool = False,
            store: ExecutableStore | None = None, cpu: platforms.CpuFormat | None = None, portable: bool = False,
            adapters: Sequence[lora.Adapter] = ()) -> tuple[Scorer, platforms.Platform]:
    """(Scorer, Platform) for this model on these devices (default: this host's). `arrays` None: abstract
    parameters, for compiling only. `probe`: run the cuDNN start-up probe (a real GPU only). `quiet`: no platform
    log line (the start's second composition says it). `store`: default, the settings' executable store. `cpu`: the
    CPU feature class and format to build for (default: this process's, runtime.assembly.platform.host_cpu_format).
    `portable`: the batch-invariant kernels sized as for another CPU (runtime.assembly.platform.fit_to_matmuls).
    `adapters`: the LoRA adapters loaded for the slots the settings compile (runtime.model.lora; the shapes, and so
    the programs, depend on the slots and the rank only)."""
    devices = list(devices if devices is not None else jax.local_devices())
    data_axis, _ = parse_mesh(settings.mesh, len(devices))
    platform = platforms.resolve(settings, platforms.backend_of(devices[0]), data_axis, cpu)
    plan = bucket_plan(settings, platform)
    slots, rank = lora.slots(settings.lora_adapters, settings.max_loras), settings.max_lora_rank
    if cfg.task != "causal_lm":  # no language-model head: no per-position log-probabilities
        plan = dataclasses.replace(plan, completion_batches=())
    # SCOREFN_MESH; a bad layout (MeshError) stops the start here, before any compilation.
    mesh = build_mesh_layout(settings.mesh, cfg, plan, devices, platform.kernels.batch_invariant)
    explicit = settings.attention in ("cudnn", "pallas")  # SCOREFN_ATTENTION named the kernel resolve picked
    platform = attention_fit.fit_to_model(platform, cfg, plan.max_length, explicit,
                                          probe=probe and arrays is not None)
    platform = attention_fit.fit_to_layout(platform, mesh, explicit)
    # Every array's declaration, from the config (the loader checked the weights against them) and the LoRA slots
    declared = params.declare(cfg) | lora.declare(cfg, slots, rank)
    shapes = {name: info.shape for name, info in declared.items()}
    store = store or executable_store(settings)
    # The bit classes belong to the host's kernels, not to one store: recorded in the cache directory, every store
    # of this host shares them (a test's fresh store, a second model) instead of compiling the probe again.
    platform = platforms.fit_to_matmuls(platform, shapes, cfg.head_dim, portable,
                                        Path(settings.cache_dir) / "bitclasses.json")
    if not quiet:
        host = f"; host {platforms.host_cpu().describe()}" if platform.backend == "cpu" else ""
        log.info("platform %s%s", platform.describe(), host)

    def model() -> Transformer:
        if arrays is not None:
            adapted = arrays if not slots else arrays | lora.stacked(list(adapters), cfg, slots, rank)
            return Transformer(cfg, adapted, platform.dtype, platform.kernels, plan.max_length, plan.label_tokens)
        abstract = {name: jax.ShapeDtypeStruct(info.shape, info.host_dtype) for name, info in declared.items()}
        return nnx.eval_shape(lambda a: Transformer(cfg, a, platform.dtype, platform.kernels, plan.max_length,
                                                    plan.label_tokens), abstract)

    if mesh is None or arrays is None:  # one device (the unsharded runtime), or nothing to place
        built = model()
    else:
        with mesh.staging():  # weights too large for one device are placed shard by shard
            built = model()
    exe = Executables(built, shardings=mesh, lazy=lazy, store=store, device=devices[0],
                      cpu_class=platform.cpu.feature_class if platform.cpu else None)
    cache = prefix_cache(settings.prefix_cache_bytes, devices[0]) if plan.prefix_sharing and arrays is not None \
        else None
    return Scorer(plan, exe, platform.concurrent_batches, cache), platform


CPU_CACHE_SHARE, CPU_CACHE_MAX, DEVICE_CACHE_SHARE = 1 / 8, 4 << 30, 1 / 4


def prefix_cache(setting: int | None, device: Any) -> PrefixCache | None:
    """SCOREFN_PREFIX_CACHE_BYTES' cache (None when 0); auto: a share of the memory the model runs in that is free
    now (the weights are placed: the executables' working memory is what the share leaves)."""
    if setting is None:
        try:
            stats = device.memory_stats() if device.platform != "cpu" else None
        except jax.errors.JaxRuntimeError:  # a compile-only device (a deviceless build): nothing is served on it
            return None
        if stats and "bytes_limit" in stats:
            setting = int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * DEVICE_CACHE_SHARE)
        else:
            setting = int(min(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * CPU_CACHE_SHARE,
                              CPU_CACHE_MAX))
    return PrefixCache(setting) if setting > 0 else None


@dataclasses.dataclass(frozen=True)
class Stored:
    """The stored set a start takes, found from the model's config alone (runtime.assembly.startup)."""
    cpu: platforms.CpuFormat | None  # a CPU backend: the feature class and format of that set, which the start takes
    portable: bool = False  # its batch-invariant kernels sized as for any CPU, not this host's own matmuls


def stored_set(settings: Settings, cfg: ModelConfig, store: ExecutableStore) -> Stored:
    """Which of the store's sets this model's start takes on this host, found from its config alone while the
    weights load (the fingerprint needs parameter shapes, not values); warm-up loads from it. On a CPU: the
    set of this process's own feature class, whole or in part, else a whole set this host runs: its class's compiled
    on another host (with runtime.model.invariant's MIN_ROWS, when this host's matmuls keep their bits from as few),
    or the first of a lower class's. An image built on another CPU starts without compiling. Nothing (and no error)
    when the start would fail anyway; it fails in the real composition, saying why. `store`: the one the start's
    scorer uses."""
    try:
        own = platforms.host_cpu_format(settings.dtype) if platforms.current_backend() == "cpu" else None
        scorer, _ = compose(settings, cfg, probe=False, quiet=True, store=store, cpu=own)
        floor = scorer.exe.model.kernels.min_rows
        others = () if own is None or floor > invariant.MIN_ROWS else \
            [own, *(platforms.cpu_format(c, dtype=settings.dtype) for c in platforms.classes_below(own.feature_class))]
        candidates = itertools.chain([(own, False, scorer)], ((cpu, True, None) for cpu in others))
        for i, (cpu, portable, scorer) in enumerate(candidates):
            if scorer is None:
                scorer, _ = compose(settings, cfg, probe=False, quiet=True, store=store, cpu=cpu, portable=True)
            keys = [(program.name, bucket) for program, bucket in scorer.plan.programs(cfg.task)]
            held = sum(store.holds(scorer.exe.fingerprint, *key) for key in keys)
            if (i == 0 and held) or held == len(keys):
                break
        else:
            return Stored(own)
    except Exception as exc:  # e.g. a mesh that cannot be built: the start with the weights reports it
        log.debug("stored executables not looked up: %s", exc)
        return Stored(None)
    if cpu is not own:
        log.warning("executable store: no executables for this host's CPU class %s; taking the whole set compiled "
                    "for class %s (which this host runs) instead of compiling", own.feature_class, cpu.feature_class)
    elif portable:
        log.warning("executable store: no executables for this host's CPU class %s sized by its matmuls' bit classes "
                    "(from %d rows); taking the whole set compiled for the class elsewhere (from %d)",
                    own.feature_class, floor, invariant.MIN_ROWS)
    return Stored(cpu, portable)
