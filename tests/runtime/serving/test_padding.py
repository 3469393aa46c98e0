"""Padding never changes a score: alone, at any row of a batch, in any length bucket."""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime.conftest import random_sequences, scorer_for, small_plan

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scorer(embedded_dir):
    return scorer_for(embedded_dir, "float32", small_plan(lengths=(16, 64), batches=(1, 8)))


def test_same_score_alone_in_any_row_and_any_bucket(scorer):
    rng = np.random.default_rng(0)
    target = [504, 3575, 282, 4649, 314]
    labels = [7042, 4528, 11]
    alone = scorer.score([target], labels)[0]
    others = random_sequences(rng, 7, 1, 16, 49152)
    for row in range(8):
        batch = others[:row] + [target] + others[row:]
        np.testing.assert_allclose(scorer.score(batch, labels)[row], alone, atol=1e-5, rtol=0)
    # A longer companion forces the 64-token bucket.
    longer = scorer.score([target, rng.integers(0, 49152, 50).tolist()], labels)[0]
    np.testing.assert_allclose(longer, alone, atol=1e-5, rtol=0)


def test_batches_larger_than_the_largest_bucket_are_split(scorer):
    sequences = random_sequences(np.random.default_rng(3), 19, 2, 60, 49152)
    together = scorer.score(sequences, [5, 6])
    one_by_one = np.concatenate([scorer.score([seq], [5, 6]) for seq in sequences])
    # Random tokens give log-probs near -20, where float32 rounding of XLA's batch-size-dependent matmul
    # kernels reaches 5.9e-5 absolute (3e-6 relative; jax 0.10.2 on this CPU, before and after the attention
    # moved to jax.nn.dot_product_attention); 1e-4 still exposes any leak between rows (>= 1e-3).
    np.testing.assert_allclose(together, one_by_one, atol=1e-4, rtol=0)
