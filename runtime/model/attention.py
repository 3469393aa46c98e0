"""Attention through `jax.nn.dot_product_attention` (cuDNN flash attention on GPUs, XLA elsewhere), and an XLA
path of its own for soft-capped scores.

Two shapes of work:
- `causal`: whole right-padded sequences (positions 0..T-1). Padding never reaches a real token: every real
  query attends only to earlier positions.
- `after_context`: continuations of one shared prefix, as a cascade. All queries of the batch (items x tokens,
  folded into one query axis) attend the single copy of the context's keys together; each item's queries
  attend their own keys causally; the two partial softmaxes are merged exactly through their log-sum-exps.
  The context is never copied per item.

- `packed`: rows holding several sequences each (accelerators' buckets), causal within each sequence, with or
  without a shared context before them.

`window` is None (no sliding window), a Python int (every layer slides: Mistral, Phi-3), or a traced int32 scalar
read per layer from the scanned layer data (Gemma 2/3: global layers carry a window longer than any sequence), in
which case the mask is built from positions. A key k is visible from query q when q - window < k <= q.

Soft-capping (Gemma 2: scores -> cap * tanh(scores / cap) before the mask and softmax) and attention sinks (gpt-oss:
a learned logit per head that joins each query's softmax denominator and weighs no value) are things neither cuDNN
nor jax.nn.dot_product_attention can express, so `softcap` or `sinks` runs `_scored` on every path (whole rows, the
cascade's two parts, packed rows): materialized float32 scores, the same masks, and the log-sum-exp the cascade
merges with, the sink counted once, in the context part's (runtime.assembly.platform keeps cuDNN and the Pallas
kernels off such models).

Shapes: B batch, T query tokens, C context tokens, N query heads, K KV heads, E head dim, R rows of W tokens.
Softmax and log-sum-exp run in float32 whatever the input dtype; the merge is float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

F32 = jnp.float32
MASKED = -1e30  # a masked score: finite, so a query that sees no key of one part still merges to a finite value


def _left_window(window: int | None) -> tuple[int, int] | None:
    # A key k is visible from query q when q - window < k <= q (Mistral / Hugging Face semantics).
    return None if window is None else (window - 1, 0)


def visible(q_pos: jax.Array, k_pos: jax.Array, window) -> jax.Array:
    """Causal (and sliding-window) visibility of keys at k_pos from queries at q_pos (broadcast)."""
    seen = k_pos <= q_pos
    return seen if window is None else seen & (q_pos - k_pos < window)


def _scored(q, k, v, mask, scale: float | None, softcap: float | None, sinks=None) -> tuple[jax.Array, jax.Array]:
    """Attention over materialized scores, tanh-capped (`softcap`) and with a sink logit per head in the softmax's
    denominator (`sinks` [N]) where given: q [B, T, N, E], k/v [B, S, K, E], mask [B or 1, T, S] ->
    (out [B, T, N, E] float32, log-sum-exp [B, T, N] float32, the sink's term included)."""
    B, T, N, E = q.shape
    K = k.shape[2]
    scale = 1.0 / np.sqrt(E) if scale is None else scale  # jax.nn.dot_product_attention's default
    qg = q.reshape(B, T, K, N // K, E)
    scores = jnp.einsum("btkge,bske->bkgts", qg, k, preferred_element_type=F32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, None, None], scores, MASKED)  # [B, K, G, T, S]
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B, K, G, T]
    if sinks is not None:
        lse = jnp.logaddexp(lse, sinks.astype(F32).reshape(1, K, N // K, 1))
    probs = jnp.exp(scores - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("bkgts,bske->btkge", probs, v, preferred_element_type=F32).reshape(B, T, N, E)
    return out, jnp.moveaxis(lse, 3, 1).reshape(B, T, N)


def causal(q: jax.Array, k: jax.Array, v: jax.Array, window, implementation: str, scale: float | None = None,
           softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """q [B, T, N, E], k/v [B, T, K, E] -> [B, T, N, E] float32."""
    scored = softcap is not None or sinks is not None
    if not scored and (window is None or isinstance(window, int)):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=_left_window(window),
                                           scale=scale, implementation=implementation)
        return out.astype(F32)
    pos = jnp.arange(q.shape[1])
    mask = visible(pos[:, None], pos[None, :], window)[None]  # [1, T, T]
    if scored:
        return _scored(q, k, v, mask, scale, softcap, sinks)[0]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation=implementation)
    return out.astype(F32)


def after_context(q: jax.Array, k: jax.Array, v: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                  ctx_len: jax.Array, positions: jax.Array, window, implementation: str, scale: float | None = None,
                  softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Items' queries q [B, T, N, E] at `positions` [B, T] (>= ctx_len), their own keys k/v [B, T, K, E], and the
    shared context's keys ctx_k/ctx_v [C, K, E] of which the first ctx_len are real -> [B, T, N, E] float32.
    `sinks` join the context part's softmax only (so the merge counts them once)."""
    B, T, N, E = q.shape
    ctx_out, ctx_lse = context(q, ctx_k, ctx_v, ctx_len, positions, window, implementation, scale, softcap, sinks)
    own_pos = jnp.arange(T)
    own_mask = visible(own_pos[:, None], own_pos[None, :], window)[None]  # [1, T, T]
    if softcap is not None or sinks is not None:
        own_out, own_lse = _scored(q, k, v, own_mask, scale, softcap)
    elif window is None or isinstance(window, int):
        own_out, own_lse = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=_left_window(window), scale=scale,
            implementation=implementation, return_residual=True)
    else:
        own_out, own_lse = jax.nn.dot_product_attention(q, k, v, mask=own_mask[:, None], scale=scale,
                                                        implementation=implementation, return_residual=True)
    return merge(ctx_out.reshape(B, T, N, E), ctx_lse.reshape(B, T, N), own_out, own_lse)


def context(q: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array, ctx_len: jax.Array, positions: jax.Array,
            window, implementation: str, scale: float | None = None, softcap: float | None = None,
            sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Every query q [B, T, N, E] (folded into one query axis) at `positions` [B, T] attends the context's first
    ctx_len keys ctx_k/ctx_v [C, K, E] -> (out [G, B * T / G, N, E], log-sum-exp [G, B * T / G, N]).

    On a device mesh each data shard folds its own rows (G groups, G = the mesh's data axis), so queries, keys and
    values are split alike, as cuDNN's partitioner requires; on one device G = 1."""
    B, T, N, E = q.shape
    C = ctx_k.shape[0]
    G = _data_groups(B)  # G = 1 builds exactly the single-device program of before (no broadcast, same reshape)
    folded = _by_group(q.reshape(G, B * T // G, N, E), G)
    ctx_pos = jnp.arange(C)
    if window is None:
        visible = jnp.broadcast_to(ctx_pos < ctx_len, (G, B * T // G, C))
    else:  # a sliding window shorter than the sequences: which context keys are visible depends on the position
        visible = (ctx_pos < ctx_len) & (ctx_pos[None, :] > positions.reshape(B * T, 1) - window)  # [B*T, C]
        visible = visible[None] if G == 1 else visible.reshape(G, B * T // G, C)
    keys = _by_group(ctx_k[None] if G == 1 else jnp.broadcast_to(ctx_k[None], (G, *ctx_k.shape)), G)
    values = _by_group(ctx_v[None] if G == 1 else jnp.broadcast_to(ctx_v[None], (G, *ctx_v.shape)), G)
    if softcap is not None or sinks is not None:
        return _scored(folded, keys, values, visible, scale, softcap, sinks)
    if window is None:
        lengths = jnp.reshape(ctx_len, (1,)) if G == 1 else jnp.broadcast_to(ctx_len, (G,))
        return jax.nn.dot_product_attention(folded, keys, values, key_value_seq_lengths=lengths.astype(jnp.int32),
                                            scale=scale, implementation=implementation, return_residual=True)
    return jax.nn.dot_product_attention(folded, keys, values, mask=visible[:, None], scale=scale,
                                        implementation=implementation, return_residual=True)


class Packed(NamedTuple):
    """Rows holding several sequences (runtime.shapes.packed): each token's sequence within its row (segment;
    -1 for padding) and position [R, W]; `context`: the shared prefix's (keys, values, length) they continue."""
    segments: jax.Array
    positions: jax.Array
    context: tuple[jax.Array, jax.Array, jax.Array] | None = None


def packed(q: jax.Array, k: jax.Array, v: jax.Array, rows: Packed, window, implementation: str,
           scale: float | None = None, softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """q [R, W, N, E], k/v [R, W, K, E] -> [R, W, N, E] float32: each token attends the earlier tokens of its own
    sequence (padding tokens attend each other, never a real token), then the shared context if there is one
    (which then takes the `sinks`). cuDNN takes the mask as a bias (its flash attention with bias); XLA applies it
    to the scores."""
    seg, pos = rows.segments, rows.positions
    own = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])  # [R, queries, keys]
    if window is not None:
        own = own & (pos[:, None, :] > pos[:, :, None] - window)
    if softcap is not None or sinks is not None:
        own_out, own_lse = _scored(q, k, v, own, scale, softcap, sinks if rows.context is None else None)
    elif rows.context is None:
        out = jax.nn.dot_product_attention(q, k, v, mask=own[:, None], is_causal=True, scale=scale,
                                           implementation=implementation)
        return out.astype(F32)
    else:
        own_out, own_lse = jax.nn.dot_product_attention(q, k, v, mask=own[:, None], is_causal=True, scale=scale,
                                                        implementation=implementation, return_residual=True)
    if rows.context is None:
        return own_out
    ctx_out, ctx_lse = context(q, *rows.context, pos, window, implementation, scale, softcap, sinks)
    R, W, N, E = q.shape
    return merge(ctx_out.reshape(R, W, N, E), ctx_lse.reshape(R, W, N), own_out, own_lse)


def _data_groups(rows: int) -> int:
    """The data axis of the mesh being traced for (1 without one): the rows split into that many groups."""
    mesh = jax.sharding.get_abstract_mesh()
    data = 1 if mesh.empty else dict(mesh.shape).get("data", 1)
    return data if data > 1 and rows % data == 0 else 1


def _by_group(x: jax.Array, groups: int) -> jax.Array:
    if groups == 1:
        return x
    return jax.lax.with_sharding_constraint(x, P("data", *(P.UNCONSTRAINED,) * (x.ndim - 1)))


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Softmax over keys A and B from the softmax over each: outputs [..., E] weighted by exp(lse) [...]."""
    lse_a, lse_b = lse_a.astype(F32), lse_b.astype(F32)
    top = jnp.maximum(lse_a, lse_b)
    weight_a, weight_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = weight_a + weight_b
    return (out_a.astype(F32) * (weight_a / total)[..., None] + out_b.astype(F32) * (weight_b / total)[..., None])
