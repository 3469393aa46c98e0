"""The accelerators' batch-invariant attention kernels, the GPU's (runtime.model.pallas_attention) and the TPU's
(runtime.model.pallas_tpu_attention), run on a CPU in Pallas' interpret mode (the kernels' semantics as JAX
operations): against attention written out in float64 NumPy, the TPU's with the GPU's bits (the same arithmetic, laid
out for Mosaic), and their bits across batches, rows and the shared-prefix cascade (on the GPU a prefix's blocks
walked by the flattened queries of every row, then each row from the block that straddles the prefix's end; on the
TPU each row's keys laid out at absolute positions). Whether the bits hold on the device: tests/gpu (no TPU is
lent)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from runtime.model import pallas_attention, pallas_tpu_attention
from runtime.model.kernels import Kernels
from tests.conftest import torch_label_logprobs
from tests.runtime.conftest import (CASES, FreshRope, assert_whole_sequence_bits_after_a_prefix, random_sequences,
                                    scorer_for, small_plan, tiny_checkpoint)
from tests.runtime.model.test_attention import reference

N, K, E = 4, 2, 64


def bfloat16(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(jnp.bfloat16)


KERNELS = {"gpu": pallas_attention, "tpu": pallas_tpu_attention}


def causal(q, k, v, window=None, context=None, kernel="gpu"):
    return np.asarray(KERNELS[kernel].causal(q, k, v, window, context=context, interpret=True))


def allowed(T, length, window):
    """[T, length + T]: the keys a row's queries at positions length + t see."""
    q_pos, k_pos = length + np.arange(T)[:, None], np.arange(length + T)[None, :]
    return (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)


@pytest.mark.parametrize("window", [None, 23])
@pytest.mark.parametrize("length", [0, 30, 77, 128])
def test_the_kernels_compute_attention(length, window):
    """Rows of 70 queries (two tiles) after prefixes of 0, 30 (no whole block), 77 and 128 keys: within bfloat16's
    rounding of the weights of float64 attention; the TPU's kernel with the bits of the GPU's."""
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
    assert np.array_equal(causal(q, k, v, window, context, kernel="tpu"), got)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("length", [30, 77, 128])
def test_the_cascade_and_the_batch_keep_each_sequences_bits(length, kernel):
    """Rows of 5-40 tokens after a shared prefix, together, against each whole sequence (prefix and row) alone: the
    same bits, whatever the row's padding, its place in the batch and where the prefix's keys come from."""
    rng = np.random.default_rng(length)
    prefix_q, prefix_k, prefix_v = bfloat16(rng, 1, length, N, E), bfloat16(rng, length, K, E), \
        bfloat16(rng, length, K, E)
    lengths = [5, 40, 17, 1]
    B, T = len(lengths), max(lengths)
    q, k, v = bfloat16(rng, B, T, N, E), bfloat16(rng, B, T, K, E), bfloat16(rng, B, T, K, E)
    together = causal(q, k, v, context=(prefix_k, prefix_v, jnp.int32(length)), kernel=kernel)
    for row, n in enumerate(lengths):
        whole = causal(jnp.concatenate([prefix_q, q[row:row + 1, :n]], axis=1),
                       jnp.concatenate([prefix_k[None], k[row:row + 1, :n]], axis=1),
                       jnp.concatenate([prefix_v[None], v[row:row + 1, :n]], axis=1), kernel=kernel)
        assert np.array_equal(together[row, :n], whole[0, length:]), (row, n)
        alone = causal(q[row:row + 1, :n], k[row:row + 1, :n], v[row:row + 1, :n],
                       context=(prefix_k, prefix_v, jnp.int32(length)), kernel=kernel)
        assert np.array_equal(together[row, :n], alone[0]), (row, n)


@pytest.mark.parametrize("case", ["gemma2", "qwen3_moe_linear_rope"])
def test_a_model_on_the_tpu_kernel_scores_like_transformers_and_keeps_each_sequences_bits(case, tmp_path,
                                                                                          monkeypatch):
    """The TPU's kernel where its layers call it (Kernels.attention "pallas_tpu", as the TPU platform picks it when
    batch-invariant), interpreted: a tiny model's scores within 1e-4 of transformers float32 with soft-capped and
    sliding attention (Gemma 2) or q/k norms and experts (Qwen3-MoE), and items after a prefix longer than a key
    block with the bits of their whole sequences."""
    monkeypatch.setattr(pallas_tpu_attention, "INTERPRET", True)
    family, overrides = CASES[case]
    torch_model = tiny_checkpoint(family, tmp_path, **overrides)
    kernels = Kernels(attention="pallas_tpu", batch_invariant=True)
    plan = dict(lengths=(96,), batches=(1, 4), labels=(4,))
    full = scorer_for(tmp_path, "float32", small_plan(**plan), kernels=kernels)
    shared = scorer_for(tmp_path, "float32", small_plan(**plan, prefix_sharing=True, suffix_lengths=(32,),
                                                        suffix_batches=(4,), contexts=(96,)), kernels=kernels)
    rng = np.random.default_rng(2)
    labels = [0, 5, 127, 64]
    sequences = random_sequences(rng, 3, 1, 90, 128)
    reference = torch_label_logprobs(FreshRope(torch_model), sequences, labels)
    np.testing.assert_allclose(full.score(sequences, labels), reference, atol=1e-4, rtol=0)
    assert np.ptp(reference) > 0.5
    prefix = rng.integers(0, 128, 70).tolist()
    assert_whole_sequence_bits_after_a_prefix(shared, full, [prefix + item for item in
                                                             random_sequences(rng, 4, 1, 20, 128)], labels)
