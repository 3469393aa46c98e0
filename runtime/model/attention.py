"""Attention through `jax.nn.dot_product_attention`: cuDNN flash attention on GPUs, XLA elsewhere.

Two shapes of work:
- `causal`: whole right-padded sequences (positions 0..T-1). Padding never reaches a real token: every real
  query attends only to earlier positions.
- `after_context`: continuations of one shared prefix, as a cascade. All queries of the batch (items x tokens,
  folded into one query axis) attend the single copy of the context's keys together; each item's queries
  attend their own keys causally; the two partial softmaxes are merged exactly through their log-sum-exps.
  The context is never copied per item.

Shapes: B batch, T query tokens, C context tokens, N query heads, K KV heads, E head dim.
Softmax and log-sum-exp run in float32 whatever the input dtype; the merge is float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def _left_window(window: int | None) -> tuple[int, int] | None:
    # A key k is visible from query q when q - window < k <= q (Mistral / Hugging Face semantics).
    return None if window is None else (window - 1, 0)


def causal(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None, implementation: str) -> jax.Array:
    """q [B, T, N, E], k/v [B, T, K, E] -> [B, T, N, E] float32."""
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=_left_window(window),
                                       implementation=implementation)
    return out.astype(F32)


def after_context(q: jax.Array, k: jax.Array, v: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                  ctx_len: jax.Array, positions: jax.Array, window: int | None, implementation: str) -> jax.Array:
    """Items' queries q [B, T, N, E] at `positions` [B, T] (>= ctx_len), their own keys k/v [B, T, K, E], and the
    shared context's keys ctx_k/ctx_v [C, K, E] of which the first ctx_len are real -> [B, T, N, E] float32."""
    B, T, N, E = q.shape
    C = ctx_k.shape[0]
    folded = q.reshape(1, B * T, N, E)
    if window is None:
        ctx_out, ctx_lse = jax.nn.dot_product_attention(
            folded, ctx_k[None], ctx_v[None], key_value_seq_lengths=jnp.reshape(ctx_len, (1,)).astype(jnp.int32),
            implementation=implementation, return_residual=True)
    else:  # a sliding window shorter than the sequences: which context keys are visible depends on the position
        ctx_pos = jnp.arange(C)
        visible = (ctx_pos < ctx_len) & (ctx_pos[None, :] > positions.reshape(B * T, 1) - window)  # [B*T, C]
        ctx_out, ctx_lse = jax.nn.dot_product_attention(
            folded, ctx_k[None], ctx_v[None], mask=visible[None, None], implementation=implementation,
            return_residual=True)
    own_out, own_lse = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=_left_window(window),
                                                    implementation=implementation, return_residual=True)
    return merge(ctx_out.reshape(B, T, N, E), ctx_lse.reshape(B, T, N), own_out, own_lse)


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Softmax over keys A and B from the softmax over each: outputs [..., E] weighted by exp(lse) [...]."""
    lse_a, lse_b = lse_a.astype(F32), lse_b.astype(F32)
    top = jnp.maximum(lse_a, lse_b)
    weight_a, weight_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = weight_a + weight_b
    return (out_a.astype(F32) * (weight_a / total)[..., None] + out_b.astype(F32) * (weight_b / total)[..., None])
