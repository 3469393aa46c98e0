"""Batch-invariant arithmetic: the bits of a token's result depend on its own sequence, never on what else is computed
beside it (issue 26's first layer: whole rows).

Why it is needed. XLA:CPU picks its kernels by shape: a row of `x @ w` comes out differently from a 1-row, a 2-32-row
and a 33-or-more-row matmul, and a row's RMSNorm differs between fewer and more than 8 rows (vectorized across rows;
measured on an AMD EPYC with AVX-512, 2026-11-25). Attention over a longer padded row reduces over more keys. So an
item's score moved with its batch, its bucket and the other requests (1e-5 in float32, ~1e-2 in bfloat16).

How it is avoided:
- The matmuls (the attention's projections, the MLP or experts) and the norms before them run over every token of
  the device batch at once, in matmuls of at least MIN_TOKENS rows (a batch with fewer tokens gets copies of its
  last row, dropped after the layers): XLA:CPU computes a row of such a matmul with the same bits whatever the
  number of rows from 33 up and wherever the row is (measured on model shapes, float32 and bfloat16, on an Intel
  Xeon with AMX, 2026-11-25; the AMD EPYC's rows fell into the same classes: 1, 2-32, 33 or more rows). This one
  is a measured property of the host's kernels, not a construction: tests/runtime/model/test_invariance.py checks
  it end to end for every family and the embedded model; a host where it failed would need a start-up probe.
- The RoPE tables and the q/k norms run over fixed-shape tiles of HEADS_TILE tokens in a loop: every tile is
  computed by the one compiled kernel of that shape, whatever the batch or bucket (over all rows at once the q/k
  norms' bits moved with the batch on tiny Gemma 3, OLMo 2 and Qwen3-MoE configs; the rotation's did not). A row is a whole number of tiles
  (its bucket's length is a multiple of HEADS_TILE), so a token's place in its tile is its position modulo
  HEADS_TILE in every program. The final norm and the vocabulary head run over tiles of TILE rows.
- Attention runs per tile of TILE queries over key blocks of TILE keys at absolute positions, in order, with an
  online softmax: blocks past the queries are never visited, keys masked inside a block add exact zeros, so the
  arithmetic of a query depends only on its position and the keys of its own sequence, not on the row's padding.
- Items after a shared prefix (the cascade) are rows that start at a multiple of PREFIX_ALIGN: their queries visit
  the prefix's key blocks, then their own, as they would in a row holding the whole sequence (`causal`'s context).
- Per-position log-probabilities (/v1/completions) read the vocabulary head over fixed tiles of POSITION_TILE
  positions; the token drawn at a temperature, over tiles of TILE rows.
Not covered yet: packed rows (their programs still use the default kernels) and meshes.

Shapes: B rows, T tokens per row (a multiple of HEADS_TILE and TILE), D hidden, N heads, K KV heads, G = N // K,
E head dim.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# MASKED is finite: a block that no query sees yet keeps the running softmax finite; the first visible block weighs
# it 0 (exp(MASKED - max) underflows to 0).
from runtime.model.attention import MASKED, visible

F32 = jnp.float32
MIN_TOKENS = 64  # the fewest token rows a forward pass's matmuls get (33 or more: see above)
HEADS_TILE = 32  # tokens of a tile of RoPE tables and q/k norms
TILE = 16  # queries of an attention tile and keys of a block; rows of the vocabulary head's tiles
POSITION_TILE = 64  # positions of a tile of per-position log-probabilities (each tile reads the vocabulary head)
PREFIX_ALIGN = 32  # a shared prefix is cut at a multiple of this: whole tiles of HEADS_TILE and TILE before the items


def by_tiles(fn: Callable, xs, tile: int):
    """fn over fixed-shape tiles: every array of `xs` has a leading axis of M (a multiple of `tile`) items; fn gets
    `tile` of them at a time and returns arrays led by `tile`; the results are put back to M."""
    m = jax.tree.leaves(xs)[0].shape[0]
    if m % tile:
        raise ValueError(f"{m} items do not split into tiles of {tile}")
    tiles = jax.tree.map(lambda a: a.reshape(m // tile, tile, *a.shape[1:]), xs)
    out = loop(fn, tiles)
    return jax.tree.map(lambda a: a.reshape(m, *a.shape[2:]), out)


def spare_rows(rows: int, length: int) -> int:
    """Rows of padding to add to `rows` rows of `length` tokens so that they hold at least MIN_TOKENS tokens."""
    return max(-(-MIN_TOKENS // length) - rows, 0)


def loop(fn: Callable, xs):
    """lax.map(fn, xs) as a loop that XLA keeps a loop whatever its length. A one-trip loop would otherwise be
    inlined (its dynamic slices of a one-tile axis become static, so the whole body is loop-invariant) and fused
    with what surrounds it, and its bits differ from the same tile's in a longer loop (measured: Qwen3's q/k norms).
    So the trip count is hidden from XLA and a lone tile gets a second, unused slot."""
    n = jax.tree.leaves(xs)[0].shape[0]
    slots = max(n, 2)
    xs = _padded(xs, slots - n)
    shapes = jax.eval_shape(fn, jax.tree.map(lambda a: a[0], xs))
    start = jax.tree.map(lambda s: jnp.zeros((slots, *s.shape), s.dtype), shapes)

    def body(i, out):
        result = fn(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs))
        return jax.tree.map(lambda o, r: jax.lax.dynamic_update_index_in_dim(o, r, i, 0), out, result)
    out = jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(n)), body, start)
    return jax.tree.map(lambda a: a[:n], out)


def rowwise(fn: Callable, xs, tile: int = TILE):
    """fn over the rows of `xs` (arrays led by M rows, any M) in fixed tiles: zero rows are appended up to a
    multiple of `tile` and their results dropped."""
    m = jax.tree.leaves(xs)[0].shape[0]
    return jax.tree.map(lambda a: a[:m], by_tiles(fn, _padded(xs, -m % tile), tile))


def _padded(xs, extra: int):
    """Every array of `xs` with `extra` zero rows appended (none: xs as it is)."""
    if not extra:
        return xs
    return jax.tree.map(lambda a: jnp.concatenate([a, jnp.zeros((extra, *a.shape[1:]), a.dtype)]), xs)


def causal(q: jax.Array, k: jax.Array, v: jax.Array, window, scale: float | None = None,
           softcap: float | None = None, context=None, tile: int = TILE) -> jax.Array:
    """Causal attention over whole rows, per tile of queries and block of keys: q [B, T, N, E], k/v [B, T, K, E]
    -> [B, T, N, E] float32. `window` None, an int or a traced int32 scalar (a key k is visible from query q when
    q - window < k <= q).

    `context`: (keys, values [C, K, E], length) of a shared prefix the rows continue: the rows' tokens are at
    positions length + t, and each query visits the prefix's blocks first, then its own row's; where the length is
    a multiple of `tile` (PREFIX_ALIGN is), in the order and with the arithmetic of the same query in a row holding
    the whole sequence."""
    B, T, N, E = q.shape
    K = k.shape[2]
    G = N // K
    n = T // tile
    if T % tile:
        raise ValueError(f"rows of {T} tokens do not split into tiles of {tile}")
    scale = 1.0 / np.sqrt(E) if scale is None else scale  # jax.nn.dot_product_attention's default
    q_tiles = q.reshape(B * n, tile, K, G, E)
    k_blocks, v_blocks = k.reshape(B, n, tile, K, E), v.reshape(B, n, tile, K, E)
    offsets = jnp.arange(tile)
    start = 0 if context is None else context[2]

    def block(qt, q_pos, kj, vj, k_pos, state, end=None):
        """One block of keys kj, vj [tile, K, E] at positions k_pos (those from `end` on masked) into the online
        softmax of the queries qt."""
        m, total, acc = state  # [K, G, tile], [K, G, tile], [K, G, tile, E]
        s = jnp.einsum("tkge,ske->kgts", qt, kj, preferred_element_type=F32) * scale
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        seen = visible(q_pos[:, None], k_pos[None, :], window)
        s = jnp.where(seen if end is None else seen & (k_pos < end), s, MASKED)  # [K, G, tile, tile]
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        keep = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        acc = acc * keep[..., None] + jnp.einsum("kgts,ske->kgte", p.astype(vj.dtype), vj, preferred_element_type=F32)
        return m_new, total * keep + jnp.sum(p, axis=-1), acc

    def one_tile(i):
        row, first = i // n, (i % n) * tile
        qt = q_tiles[i]  # [tile, K, G, E]
        q_pos = start + first + offsets
        state = (jnp.full((K, G, tile), MASKED, F32), jnp.zeros((K, G, tile), F32), jnp.zeros((K, G, tile, E), F32))
        if context is not None:
            ctx_k, ctx_v, length = context
            ctx_kb, ctx_vb = (a.reshape(a.shape[0] // tile, tile, K, E) for a in (ctx_k, ctx_v))
            state = jax.lax.fori_loop(0, -(-length // tile), lambda j, st: block(
                qt, q_pos, ctx_kb[j], ctx_vb[j], j * tile + offsets, st, length), state)
        _, total, acc = jax.lax.fori_loop(0, i % n + 1, lambda j, st: block(
            qt, q_pos, k_blocks[row, j], v_blocks[row, j], start + j * tile + offsets, st), state)
        out = acc / total[..., None]  # [K, G, tile, E]
        return jnp.moveaxis(out, 2, 0).reshape(tile, N, E)

    return loop(one_tile, jnp.arange(B * n)).reshape(B, T, N, E)
