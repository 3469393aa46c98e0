"""Cross-request batching: concurrent requests share device batches and never mix their scores."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from runtime.engine import Engine
from tests.runtime.conftest import random_sequences
from tests.conftest import TEST_COMPILE_CACHE
from tests.runtime.assembly.test_warmup import small_settings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, cache_dir, tmp_path_factory):
    # A wait budget this machine's device meets for all of a test's requests at once: these tests are about
    # coalescing, not admission (tests/runtime/requests/test_admission.py).
    # Its programs in the tests' user-level cache (nothing here counts compiles): a second run loads them.
    engine = Engine(small_settings(tiny_llama_dir, cache_dir, TEST_COMPILE_CACHE,
                                   length_buckets=(32, 64), batch_buckets=(1, 4, 16), batch_wait_ms=50.0,
                                   max_labels=16, max_wait_s=600.0))
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
        assert np.array_equal(a, b)  # batch-invariant kernels (the CPU's default): the same bits in any batch


def test_scores_do_not_depend_on_arrival_order(engine):
    work = requests(1, 12)
    forward = [f.result().logprobs for f in [engine.submit(s, l) for s, l in work]]
    backward = [f.result().logprobs for f in [engine.submit(s, l) for s, l in reversed(work)]][::-1]
    for a, b in zip(forward, backward):
        assert np.array_equal(a, b)


def test_the_cost_of_a_request_is_the_device_work_the_scorer_plans_for_it(engine, monkeypatch):
    from runtime.interface import Sampling
    from runtime.requests.jobs import Job, TokenJob

    # The price of a device batch is calibrated on the host at start; the splits below assume 32 padded tokens.
    monkeypatch.setattr(engine.scorer, "plan", dataclasses.replace(engine.scorer.plan, batch_overhead_tokens=32))

    rng = np.random.default_rng(2)
    query = rng.integers(0, 49152, 30).tolist()
    jobs = {"full": Job([rng.integers(0, 49152, n).tolist() for n in (30, 20, 10, 5, 3)], [1]),
            "shared prefix": Job([query + [i] for i in range(9)], [1]),
            "completion": TokenJob(random_sequences(rng, 3, 2, 20, 49152), [Sampling()] * 3)}
    costs = {name: engine.scorer.cost([job]) for name, job in jobs.items()}
    # 4 rows of up to 32 tokens in a batch of 4 x 32 and the 3-token one in 1 x 32 (one batch of 16 would pad 11 rows)
    assert costs["full"].full == 4 * 32 + 32 and costs["full"].batches == 2
    # the 31-token sequences' 30 shared tokens in a 32-token context, then 9 items of 1 token in batches of 4 x 8
    assert costs["shared prefix"].context == 32 and costs["shared prefix"].continuation == 3 * 4 * 8
    assert costs["completion"].completion > 0 and costs["completion"].full == 0
    for name, job in jobs.items():
        before = engine.scorer.device_batches
        engine.scorer.score_jobs([job])
        prefill = 1 if costs[name].context else 0  # the shared prefix's own batch is not counted as a device batch
        assert engine.scorer.device_batches - before == costs[name].batches - prefill, name
