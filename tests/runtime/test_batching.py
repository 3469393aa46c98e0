"""Cross-request batching: concurrent requests share device batches and never mix their scores."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.serving.engine import Engine
from tests.runtime.conftest import random_sequences
from tests.runtime.test_warmup import small_settings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(cache_dir, tmp_path_factory):
    engine = Engine(small_settings(cache_dir, tmp_path_factory.mktemp("xla"), batch_buckets=(1, 4, 16),
                                   batch_wait_ms=50.0, max_labels=16))
    engine.start()
    yield engine
    engine.stop(5)


def requests(seed: int, count: int):
    rng = np.random.default_rng(seed)
    return [(random_sequences(rng, int(rng.integers(1, 4)), 1, 32, 49152),
             rng.integers(0, 49152, int(rng.integers(1, 9))).tolist()) for _ in range(count)]


def test_concurrent_requests_are_coalesced_and_get_their_own_scores(engine):
    work = requests(0, 24)
    alone = [engine.score(sequences, labels) for sequences, labels in work]
    rounds_before = engine.stats()["device_rounds"]
    futures = [engine.submit(sequences, labels) for sequences, labels in work]  # all queued at once
    together = [future.result().logprobs for future in futures]
    rounds = engine.stats()["device_rounds"] - rounds_before
    assert rounds < len(work) / 2, f"{len(work)} concurrent requests took {rounds} device rounds"
    for a, b in zip(alone, together):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)  # float32 rounding differs by bucket; a mix-up is >> 1e-2


def test_scores_do_not_depend_on_arrival_order(engine):
    work = requests(1, 12)
    forward = [f.result().logprobs for f in [engine.submit(s, l) for s, l in work]]
    backward = [f.result().logprobs for f in [engine.submit(s, l) for s, l in reversed(work)]][::-1]
    for a, b in zip(forward, backward):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)  # float32 rounding differs by bucket; a mix-up is >> 1e-2
