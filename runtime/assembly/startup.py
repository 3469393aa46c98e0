"""The steps of a start that need JAX, Flax and transformers (runtime.engine imports this module when a start
begins, after the HTTP server already answers /health): load a model's weights and its tokenizer and find its stored
executables at once, compose its scorer, and warm up every bucket."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from typing import Any, Callable

from runtime.model import lora
from runtime.model.config import ModelConfig, load_config
from runtime.model.loader import LoadedModel, load_model, load_tokenizer, resolve_model_dir
from runtime.assembly.compose import Stored, compose, executable_store, stored_set
from runtime.assembly.platform import Platform
from runtime.requests.scorer import Scorer
from runtime.assembly.store import ExecutableStore, cache_events, enable_persistent_cache
from runtime.settings import Settings


@dataclasses.dataclass
class Loaded:
    """A model loaded for serving: its weights and config, its tokenizer, and which stored set of executables it takes
    (found from the config alone, beside the weights: the store's fingerprint needs no weights)."""
    model: LoadedModel
    tokenizer: Any
    store: ExecutableStore  # the start's: a stored set that does not load is logged once
    stored: Stored  # the CPU feature class and format of the stored set the start takes
    adapters: list[lora.Adapter]  # SCOREFN_LORA_ADAPTERS, checked against the weights, in slots 1..n

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg


def load(settings: Settings) -> Loaded:
    """Weights (mostly NumPy dequantizing or copying them, which releases the GIL) beside the tokenizer (mostly
    importing transformers) and the lookup of the stored executables (tracing nothing: composing abstract models)."""
    enable_persistent_cache(settings.xla_cache_dir)
    model_dir, _ = resolve_model_dir(settings.model, settings.cache_dir)
    store = executable_store(settings)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        tokenizer = pool.submit(load_tokenizer, model_dir)
        stored = pool.submit(stored_set, settings, load_config(model_dir), store)
        model = load_model(settings.model, settings.cache_dir, settings.model_id)
        return Loaded(model, tokenizer.result(), store, stored.result(), adapters(settings, model))


def adapters(settings: Settings, model: LoadedModel) -> list[lora.Adapter]:
    """The LoRA adapters the settings name, checked against the model (a bad one fails the start, naming it)."""
    return lora.load_adapters(settings.lora_adapters, settings.max_loras, settings.max_lora_rank, model.cfg,
                              model.model_id)


def scorer(settings: Settings, loaded: LoadedModel, *, lazy: bool = False) -> tuple[Scorer, Platform]:
    """The scorer of a loaded model on this host's devices (runtime.assembly.compose, the path `scorefn compile`
    shares). `lazy`: compile buckets on first use (one-shot CLI runs and the benchmark, never serving)."""
    return compose(settings, loaded.cfg, loaded.arrays, lazy=lazy, adapters=adapters(settings, loaded))


def serving_scorer(settings: Settings, loaded: Loaded) -> tuple[Scorer, Platform]:
    """The scorer a start serves with, for the stored set found beside the weights."""
    return compose(settings, loaded.cfg, loaded.model.arrays, store=loaded.store, cpu=loaded.stored.cpu,
                   portable=loaded.stored.portable, adapters=loaded.adapters)


def warm_up(built: Scorer, progress: Callable[[int, str, float], None] | None = None,
            ready: str = "all") -> dict[str, float]:
    """Compile every bucket of the plan the store does not hold (Executables.warm_up), or with `ready` first (or auto,
    on a start that finds none stored) only the smallest bucket of each program, the others left pending (compiled on
    first use until the start is ready, then in the background: Executables.compile_pending); what it took (counts:
    "stored" those from the store, loaded or deferred, "pending" those left, and persistent-cache events)."""
    programs = built.plan.programs(built.task)
    keys = [(program.name, bucket) for program, bucket in programs]
    if ready == "auto":
        ready = "all" if any(built.exe.holds_stored(*key) for key in keys) else "first"
    first = None
    if ready == "first":
        smallest: dict[str, tuple] = {}
        for name, bucket in keys:
            if name not in smallest or math.prod(bucket) < math.prod(smallest[name]):
                smallest[name] = bucket
        first = set(smallest.items())
    before = cache_events()
    total = built.exe.warm_up(programs, progress, first=first)
    after = cache_events()
    return {"buckets": total, "stored": built.exe.loaded + built.exe.deferred, "pending": built.exe.pending,
            "cache_hits": after["hits"] - before["hits"],
            "cache_misses": after["misses"] - before["misses"]}
