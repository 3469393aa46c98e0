"""runtime.model.attention against attention written out in float64 NumPy: full causal sequences, the shared-prefix
cascade (one copy of the context for the whole batch, merged through log-sum-exps), sliding windows, GQA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.model import attention

B, T, C, N, K, E = 3, 7, 12, 4, 2, 16


def reference(q, keys, values, allowed):
    """q [B, T, N, E], keys/values [B, S, K, E], allowed [B, T, S] -> [B, T, N, E], in float64."""
    q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
    groups = q.shape[2] // keys.shape[2]
    keys, values = np.repeat(keys, groups, axis=2), np.repeat(values, groups, axis=2)
    scores = np.einsum("btne,bsne->bnts", q, keys) / np.sqrt(q.shape[-1])
    scores = np.where(allowed[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsne->btne", probs, values)


@pytest.fixture
def inputs():
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return normal(B, T, N, E), normal(B, T, K, E), normal(B, T, K, E), normal(C, K, E), normal(C, K, E)


@pytest.mark.parametrize("window", [None, 3])
def test_causal(inputs, window):
    q, k, v, _, _ = inputs
    pos = np.arange(T)
    allowed = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window else True)
    ours = attention.causal(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window, "xla")
    np.testing.assert_allclose(ours, reference(q, k, v, np.broadcast_to(allowed, (B, T, T))), atol=1e-5, rtol=0)


@pytest.mark.parametrize("ctx_len,window", [(12, None), (5, None), (1, None), (9, 6), (12, 14)])
def test_cascade_equals_attention_over_context_and_own_keys(inputs, ctx_len, window):
    """Every item sees the first ctx_len context keys and its own earlier tokens (nothing of the context
    bucket's padding), exactly as if its keys were laid out after the context."""
    q, k, v, ctx_k, ctx_v = inputs
    positions = ctx_len + np.broadcast_to(np.arange(T), (B, T))
    ours = attention.after_context(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(ctx_k),
                                   jnp.asarray(ctx_v), jnp.int32(ctx_len), jnp.asarray(positions), window, "xla")
    keys = np.concatenate([np.broadcast_to(ctx_k, (B, C, K, E)), k], axis=1)
    values = np.concatenate([np.broadcast_to(ctx_v, (B, C, K, E)), v], axis=1)
    key_pos = np.concatenate([np.arange(C), ctx_len + np.arange(T)])
    real = np.concatenate([np.arange(C) < ctx_len, np.ones(T, bool)])
    allowed = real & (key_pos[None, :] <= positions[0][:, None])
    if window:
        allowed &= key_pos[None, :] > positions[0][:, None] - window
    np.testing.assert_allclose(ours, reference(q, keys, values, np.broadcast_to(allowed, (B, T, C + T))),
                               atol=1e-5, rtol=0)


def test_the_context_is_one_copy_for_the_whole_batch(inputs):
    """The cascade's context attention takes the context keys once ([1, C, K, E]), not once per item."""
    q, k, v, ctx_k, ctx_v = inputs
    positions = 12 + np.broadcast_to(np.arange(T), (B, T))
    jaxpr = jax.make_jaxpr(lambda *a: attention.after_context(*a, None, "xla"))(
        q, k, v, ctx_k, ctx_v, jnp.int32(12), positions)
    shapes = {tuple(var.aval.shape) for eqn in jaxpr.eqns for var in eqn.outvars}
    assert (1, C, K, E) in shapes and (B, C, K, E) not in shapes
    assert not any(len(s) >= 4 and s[0] == B and C in s[1:2] for s in shapes)


def test_merge_of_two_halves_is_the_softmax_over_all(inputs):
    q, k, v, _, _ = inputs
    everything = np.ones((B, T, T), bool)
    halves = []
    for part in (slice(0, 3), slice(3, T)):
        out, lse = jax.nn.dot_product_attention(jnp.asarray(q), jnp.asarray(k[:, part]), jnp.asarray(v[:, part]),
                                                return_residual=True)
        halves += [out, lse]
    np.testing.assert_allclose(attention.merge(*halves), reference(q, k, v, everything), atol=1e-5, rtol=0)


def test_bfloat16_inputs_stay_close(inputs):
    """Accelerators run attention on bfloat16 Q/K/V (softmax, log-sum-exp and the merge in float32)."""
    q, k, v, ctx_k, ctx_v = inputs
    positions = 12 + np.broadcast_to(np.arange(T), (B, T))
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, ctx_k, ctx_v)]
    ours = attention.after_context(*bf16, jnp.int32(12), jnp.asarray(positions), None, "xla")
    exact = attention.after_context(*map(jnp.asarray, (q, k, v, ctx_k, ctx_v)), jnp.int32(12),
                                    jnp.asarray(positions), None, "xla")
    assert ours.dtype == jnp.float32
    np.testing.assert_allclose(ours, exact, atol=0.03, rtol=0)  # bfloat16 keeps 8 bits: inputs of magnitude ~1
