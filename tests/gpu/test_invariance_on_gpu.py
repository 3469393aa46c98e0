"""Batch invariance on a GPU, for the day one is lent (skipped elsewhere): the embedded model in bfloat16 with the
kernels a GPU runs under SCOREFN_BATCH_INVARIANT=true (XLA attention, the grid, XLA's deterministic mode) scores
the same bits alone, in larger batches, at any row and after a shared prefix, and the same bits run after run.

    .venv-aot/bin/python -m pytest tests/gpu      # on a machine with an NVIDIA GPU (the aot extra has the plugin)

What is shown without the device: tests/aot/test_deviceless.py (one set of attention tile shapes in every bucket)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from runtime.serving.executables import compiler_options
from runtime.serving.platform import resolve
from runtime.settings import load_settings
from tests.runtime.conftest import assert_whole_sequence_bits_after_a_prefix, random_sequences, scorer_for, small_plan

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (see the module docstring)")]
PLAN = small_plan(lengths=(32, 64, 128), batches=(1, 4, 16), prefix_sharing=True, suffix_lengths=(16, 32),
                  suffix_batches=(1, 4, 16), labels=(4,), contexts=(64, 128))


@pytest.fixture(scope="module")
def scorers(embedded_dir):
    settings = load_settings(environ={"SCOREFN_BATCH_INVARIANT": "true"}, dtype="bfloat16", bucket_layout="grid")
    kernels = resolve(settings, backend="gpu").kernels
    assert kernels.batch_invariant and kernels.attention == "xla"
    assert compiler_options(kernels, jax.devices()[0].platform) == {"xla_gpu_exclude_nondeterministic_ops": True}
    unshared = small_plan(lengths=(32, 64, 128), batches=(1, 4, 16), labels=(4,))
    return scorer_for(embedded_dir, "bfloat16", PLAN, kernels=kernels), \
        scorer_for(embedded_dir, "bfloat16", unshared, kernels=kernels)


def test_an_item_scores_the_same_bits_in_any_batch_on_a_gpu(scorers):
    scorer, _ = scorers
    rng = np.random.default_rng(0)
    item, labels = [504, 3575, 282, 4649, 314], [7042, 4528, 11]
    alone = scorer.score([item], labels)[0]
    for others in (3, 15, 40):  # one, several device batches
        batch = random_sequences(rng, others, 1, 100, 49152)
        for row in (0, others // 2, others):
            together = scorer.score(batch[:row] + [item] + batch[row:], labels)
            assert np.array_equal(together[row], alone), (others, row)
    assert np.array_equal(scorer.score([item], labels)[0], alone)  # and run after run


def test_items_after_a_shared_prefix_score_the_bits_of_their_whole_sequence_on_a_gpu(scorers):
    shared, full = scorers
    rng = np.random.default_rng(1)
    prefix = rng.integers(100, 49152, 77).tolist()
    sequences = [prefix + item for item in random_sequences(rng, 12, 1, 30, 49152)]
    assert_whole_sequence_bits_after_a_prefix(shared, full, sequences, [7042, 4528, 11])
