"""Padding never changes a score: alone, at any row of a batch, in any length bucket, to the bit (the CPU's
batch-invariant kernels; tests/runtime/model/test_invariance.py covers every family)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime.conftest import random_sequences, scorer_for, small_plan

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scorer(embedded_shaped_dir):
    return scorer_for(embedded_shaped_dir, "float32", small_plan(lengths=(16, 64), batches=(1, 8)))


def test_same_score_alone_in_any_row_and_any_bucket(scorer):
    rng = np.random.default_rng(0)
    target = [504, 3575, 282, 4649, 314]
    labels = [7042, 4528, 11]
    alone = scorer.score([target], labels)[0]
    others = random_sequences(rng, 7, 1, 16, 49152)
    for row in range(8):
        batch = others[:row] + [target] + others[row:]
        assert np.array_equal(scorer.score(batch, labels)[row], alone), row
    # A longer companion forces the 64-token bucket.
    longer = scorer.score([target, rng.integers(0, 49152, 50).tolist()], labels)[0]
    assert np.array_equal(longer, alone)


def test_batches_larger_than_the_largest_bucket_are_split(scorer):
    sequences = random_sequences(np.random.default_rng(3), 19, 2, 60, 49152)
    together = scorer.score(sequences, [5, 6])
    one_by_one = np.concatenate([scorer.score([seq], [5, 6]) for seq in sequences])
    assert np.array_equal(together, one_by_one)
