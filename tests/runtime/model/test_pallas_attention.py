"""The GPU's batch-invariant attention kernels (runtime.model.pallas_attention), run on a CPU in Pallas' interpret mode
(the kernels' semantics as JAX operations): against attention written out in float64 NumPy, and their bits across
batches, rows and the shared-prefix cascade (a prefix's blocks walked by the flattened queries of every row, then each
row from the block that straddles the prefix's end). Whether the bits hold on the device: tests/gpu."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from runtime.model import pallas_attention
from tests.runtime.model.test_attention import reference

N, K, E = 4, 2, 64


def bfloat16(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(jnp.bfloat16)


def causal(q, k, v, window=None, context=None):
    return np.asarray(pallas_attention.causal(q, k, v, window, context=context, interpret=True))


def allowed(T, length, window):
    """[T, length + T]: the keys a row's queries at positions length + t see."""
    q_pos, k_pos = length + np.arange(T)[:, None], np.arange(length + T)[None, :]
    return (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)


@pytest.mark.parametrize("window", [None, 23])
@pytest.mark.parametrize("length", [0, 30, 77, 128])
def test_the_kernels_compute_attention(length, window):
    """Rows of 70 queries (two tiles) after prefixes of 0, 30 (no whole block), 77 and 128 keys: within bfloat16's
    rounding of the weights of float64 attention."""
    rng = np.random.default_rng(length)
    B, T = 3, 70
    q, k, v = bfloat16(rng, B, T, N, E), bfloat16(rng, B, T, K, E), bfloat16(rng, B, T, K, E)
    context = (bfloat16(rng, length, K, E), bfloat16(rng, length, K, E), jnp.int32(length)) if length else None
    got = causal(q, k, v, window, context)

    def whole(prefix, rows):  # each row's keys or values after the prefix's, [B, length + T, K, E] in float32
        parts = ([np.broadcast_to(np.asarray(prefix, np.float32), (B, length, K, E))] if length else [])
        return np.concatenate(parts + [np.asarray(rows, np.float32)], axis=1)
    keys, values = (whole(context[0] if length else None, k), whole(context[1] if length else None, v))
    expected = reference(np.asarray(q, np.float32), keys, values,
                         np.broadcast_to(allowed(T, length, window), (B, T, length + T)))
    assert np.abs(got - expected).max() < 0.01


@pytest.mark.parametrize("length", [30, 77, 128])
def test_the_cascade_and_the_batch_keep_each_sequences_bits(length):
    """Rows of 5-40 tokens after a shared prefix, together, against each whole sequence (prefix and row) alone: the
    same bits, whatever the row's padding, its place in the batch and where the prefix's keys come from."""
    rng = np.random.default_rng(length)
    prefix_q, prefix_k, prefix_v = bfloat16(rng, 1, length, N, E), bfloat16(rng, length, K, E), \
        bfloat16(rng, length, K, E)
    lengths = [5, 40, 17, 1]
    B, T = len(lengths), max(lengths)
    q, k, v = bfloat16(rng, B, T, N, E), bfloat16(rng, B, T, K, E), bfloat16(rng, B, T, K, E)
    together = causal(q, k, v, context=(prefix_k, prefix_v, jnp.int32(length)))
    for row, n in enumerate(lengths):
        whole = causal(jnp.concatenate([prefix_q, q[row:row + 1, :n]], axis=1),
                       jnp.concatenate([prefix_k[None], k[row:row + 1, :n]], axis=1),
                       jnp.concatenate([prefix_v[None], v[row:row + 1, :n]], axis=1))
        assert np.array_equal(together[row, :n], whole[0, length:]), (row, n)
        alone = causal(q[row:row + 1, :n], k[row:row + 1, :n], v[row:row + 1, :n],
                       context=(prefix_k, prefix_v, jnp.int32(length)))
        assert np.array_equal(together[row, :n], alone[0]), (row, n)
