"""Every bucket is compiled at warm-up, through the persistent cache; requests never compile."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine import Engine
from runtime.settings import load_settings
from tests.runtime.conftest import random_sequences

pytestmark = pytest.mark.slow


def small_settings(cache_dir, xla_dir, **overrides):
    values = dict(cache_dir=str(cache_dir), compile_cache_dir=str(xla_dir), dtype="float32",
                  length_buckets=(16, 32), batch_buckets=(1, 4), suffix_length_buckets=(8,),
                  suffix_batch_buckets=(4,), max_labels=8, batch_wait_ms=0.0)
    return load_settings(**{**values, **overrides})


def test_warmup_compiles_each_bucket_once_and_requests_compile_nothing(cache_dir, tmp_path):
    engine = Engine(small_settings(cache_dir, tmp_path / "xla"))
    engine.start()
    try:
        plan = engine.plan
        assert engine.stats()["compiles"] == plan.count() == engine.timings["buckets"]
        assert engine.timings["cache_misses"] == plan.count()
        before = engine.stats()
        rng = np.random.default_rng(0)
        for n_items, n_labels in [(1, 1), (3, 5), (9, 8), (2, 2)]:  # full and shared-prefix paths, splits
            sequences = random_sequences(rng, n_items, 1, 32, 49152)
            assert engine.score(sequences, list(range(n_labels))).shape == (n_items, n_labels)
        query = random_sequences(rng, 1, 20, 20, 49152)[0]
        engine.score([query + [5, 6], query + [7], query + [8, 9, 10]], [1, 2])  # shares a 20-token prefix
        after = engine.stats()
        assert after["compiles"] == before["compiles"]
        assert after["backend_compiles"] == before["backend_compiles"]  # not one XLA compilation in the process
    finally:
        engine.stop(5)


def test_second_warmup_loads_every_bucket_from_the_cache(cache_dir, tmp_path):
    xla_dir = tmp_path / "xla"
    first = Engine(small_settings(cache_dir, xla_dir, batch_buckets=(2,)))
    first.start()
    first.stop(5)
    assert any(xla_dir.iterdir()), "the persistent compilation cache wrote no files"
    second = Engine(small_settings(cache_dir, xla_dir, batch_buckets=(2,)))
    second.start()
    second.stop(5)
    assert second.timings["cache_hits"] == second.plan.count()
    assert second.timings["cache_misses"] == 0
