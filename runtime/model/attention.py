"""Attention through `jax.nn.dot_product_attention` (cuDNN flash attention on GPUs, XLA elsewhere), and an XLA
path of its own for soft-capped scores.

Two shapes of work:
- `causal`: whole right-padded sequences (positions 0..T-1). Padding never reaches a real token: every real
  query attends only to earlier positions.
- `after_context`: continuations of one shared prefix, as a cascade. All queries of the batch (items x tokens,
  folded into one query axis) attend the single copy of the context's keys together; each item's queries
  attend their own keys causally; the two partial softmaxes are merged exactly through their log-sum-exps.
  The context is never copied per item.

`window` is None (no sliding window), a Python int (every layer slides: Mistral, Phi-3), or a traced int32 scalar
read per layer from the scanned layer data (Gemma 2/3: global layers carry a window longer than any sequence), in
which case the mask is built from positions. A key k is visible from query q when q - window < k <= q.

Soft-capping (Gemma 2: scores -> cap * tanh(scores / cap) before the mask and softmax) is something neither cuDNN
nor jax.nn.dot_product_attention can express, so `softcap` runs `_softcapped`: materialized float32 scores, the
same masks, and the log-sum-exp the cascade merges with (runtime.serving.platform keeps cuDNN off such models).

Shapes: B batch, T query tokens, C context tokens, N query heads, K KV heads, E head dim.
Softmax and log-sum-exp run in float32 whatever the input dtype; the merge is float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
MASKED = -1e30  # a masked score: finite, so a query that sees no key of one part still merges to a finite value


def _left_window(window: int | None) -> tuple[int, int] | None:
    # A key k is visible from query q when q - window < k <= q (Mistral / Hugging Face semantics).
    return None if window is None else (window - 1, 0)


def _visible(q_pos: jax.Array, k_pos: jax.Array, window) -> jax.Array:
    """Causal (and sliding-window) visibility of keys at k_pos from queries at q_pos (broadcast)."""
    seen = k_pos <= q_pos
    return seen if window is None else seen & (q_pos - k_pos < window)


def _softcapped(q, k, v, mask, scale: float | None, softcap: float) -> tuple[jax.Array, jax.Array]:
    """Attention with tanh-capped scores: q [B, T, N, E], k/v [B, S, K, E], mask [B or 1, T, S] ->
    (out [B, T, N, E] float32, log-sum-exp [B, T, N] float32)."""
    B, T, N, E = q.shape
    K = k.shape[2]
    scale = 1.0 / np.sqrt(E) if scale is None else scale  # jax.nn.dot_product_attention's default
    qg = q.reshape(B, T, K, N // K, E)
    scores = jnp.einsum("btkge,bske->bkgts", qg, k, preferred_element_type=F32) * scale
    scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, None, None], scores, MASKED)  # [B, K, G, T, S]
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, K, G, T]
    probs = jnp.exp(scores - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("bkgts,bske->btkge", probs, v, preferred_element_type=F32).reshape(B, T, N, E)
    return out, jnp.moveaxis(lse, 3, 1).reshape(B, T, N)


def causal(q: jax.Array, k: jax.Array, v: jax.Array, window, implementation: str, scale: float | None = None,
           softcap: float | None = None) -> jax.Array:
    """q [B, T, N, E], k/v [B, T, K, E] -> [B, T, N, E] float32."""
    if softcap is None and (window is None or isinstance(window, int)):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=_left_window(window),
                                           scale=scale, implementation=implementation)
        return out.astype(F32)
    pos = jnp.arange(q.shape[1])
    mask = _visible(pos[:, None], pos[None, :], window)[None]  # [1, T, T]
    if softcap is not None:
        return _softcapped(q, k, v, mask, scale, softcap)[0]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation=implementation)
    return out.astype(F32)


def after_context(q: jax.Array, k: jax.Array, v: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                  ctx_len: jax.Array, positions: jax.Array, window, implementation: str, scale: float | None = None,
                  softcap: float | None = None) -> jax.Array:
    """Items' queries q [B, T, N, E] at `positions` [B, T] (>= ctx_len), their own keys k/v [B, T, K, E], and the
    shared context's keys ctx_k/ctx_v [C, K, E] of which the first ctx_len are real -> [B, T, N, E] float32."""
    B, T, N, E = q.shape
    C = ctx_k.shape[0]
    folded = q.reshape(1, B * T, N, E)
    ctx_pos = jnp.arange(C)
    own_pos = jnp.arange(T)
    own_mask = _visible(own_pos[:, None], own_pos[None, :], window)[None]  # [1, T, T]
    if window is None:
        ctx_visible = jnp.broadcast_to(ctx_pos < ctx_len, (1, B * T, C))
    else:  # a sliding window shorter than the sequences: which context keys are visible depends on the position
        ctx_visible = ((ctx_pos < ctx_len) & (ctx_pos[None, :] > positions.reshape(B * T, 1) - window))[None]
    if softcap is not None:
        ctx_out, ctx_lse = _softcapped(folded, ctx_k[None], ctx_v[None], ctx_visible, scale, softcap)
        own_out, own_lse = _softcapped(q, k, v, own_mask, scale, softcap)
        return merge(ctx_out.reshape(B, T, N, E), ctx_lse.reshape(B, T, N), own_out, own_lse)
    if window is None:
        ctx_out, ctx_lse = jax.nn.dot_product_attention(
            folded, ctx_k[None], ctx_v[None], key_value_seq_lengths=jnp.reshape(ctx_len, (1,)).astype(jnp.int32),
            scale=scale, implementation=implementation, return_residual=True)
    else:
        ctx_out, ctx_lse = jax.nn.dot_product_attention(
            folded, ctx_k[None], ctx_v[None], mask=ctx_visible[:, None], scale=scale, implementation=implementation,
            return_residual=True)
    if window is None or isinstance(window, int):
        own_out, own_lse = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=_left_window(window), scale=scale,
            implementation=implementation, return_residual=True)
    else:
        own_out, own_lse = jax.nn.dot_product_attention(q, k, v, mask=own_mask[:, None], scale=scale,
                                                        implementation=implementation, return_residual=True)
    return merge(ctx_out.reshape(B, T, N, E), ctx_lse.reshape(B, T, N), own_out, own_lse)


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Softmax over keys A and B from the softmax over each: outputs [..., E] weighted by exp(lse) [...]."""
    lse_a, lse_b = lse_a.astype(F32), lse_b.astype(F32)
    top = jnp.maximum(lse_a, lse_b)
    weight_a, weight_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = weight_a + weight_b
    return (out_a.astype(F32) * (weight_a / total)[..., None] + out_b.astype(F32) * (weight_b / total)[..., None])
