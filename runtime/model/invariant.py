"""Batch-invariant arithmetic: the bits of a token's result depend on its own sequence, never on what else is computed
beside it (issue 26's first layer: whole rows).

Why it is needed. XLA:CPU picks its kernels by shape: a row of `x @ w` comes out differently from a 1-row, a 2-32-row
and a 33-or-more-row matmul, and a row's RMSNorm differs between fewer and more than 8 rows (vectorized across rows;
measured on an AMD EPYC with AVX-512, 2026-11-25). Attention over a longer padded row reduces over more keys. So an
item's score moved with its batch, its bucket and the other requests (1e-5 in float32, ~1e-2 in bfloat16).

How it is avoided:
- The layers run on one stream of tokens [1, M, D] (`flatten`): every token of the device batch, then zero tokens up
  to at least MIN_TOKENS, a whole number of tiles of STREAM_TILE; only attention sees the rows (`unflatten`). The
  matmuls (the attention's projections, the MLP or experts) run over the whole stream at once: XLA:CPU computes a
  row of such a matmul with the same bits whatever the number of rows from a threshold up and wherever the row is
  (33 on the embedded model's shapes, 63 on the tiny test configs' 64x96; measured up to 8,192 rows, float32 and
  bfloat16, on an Intel Xeon with AMX, 2026-11-26; the AMD EPYC's fell into the same classes). This one is a
  measured property of the host's kernels, not a construction: tests/runtime/model/test_invariance.py checks it end
  to end for every family and the embedded model; a host where it failed would need a start-up probe.
- Everything else on the stream runs over fixed tiles of STREAM_TILE tokens in a loop (`tokenwise`): the norms
  (RMSNorm before and after attention and MLP, q/k norms), the MoE router's softmax, the RoPE tables. Over all
  tokens at once a row's bits moved with their number, differently per width (RMSNorm 576 wide at 4,096 tokens,
  64 wide from 64, 960 wide from 5; q/k norms on tiny Gemma 3, OLMo 2 and Qwen3-MoE configs). Every tile is
  computed by the one compiled kernel of that shape, whatever the batch or bucket, and a token's bits do not depend
  on its place in a tile (the cascade's items start anywhere). The rotation applies to the whole stream: applied to
  the rows cut from it, the cut fused with it and moved bits (tiny Llama, items of 8 tokens, 2026-11-26). The final
  norm and the vocabulary head run over tiles of TILE rows.
- Attention runs per tile of QUERY_TILE queries over blocks of KEY_BLOCK keys at absolute positions (block j holds
  the keys at positions j * KEY_BLOCK and on), in order, with an online softmax: blocks past the queries are never
  visited, keys masked inside a block add exact zeros, so the arithmetic of a query depends only on its position
  and the keys of its own sequence, not on its row, the row's padding or where the row starts.
- Items after a shared prefix (the cascade) are rows that start at the prefix's length, any length: a block that
  straddles the prefix's end takes its first keys from the prefix and the rest from the row (`causal`'s context),
  so each query visits the blocks of a row holding the whole sequence.
- XLA:CPU contracts multiply-adds into FMAs per fusion (measured 2026-11-25): values that reach the loops above are
  gathered inside them, never padded or cut beforehand, so that what computes them (the rotation) is not fused
  with a pad of a different shape in each program.
- Per-position log-probabilities (/v1/completions) read the vocabulary head over fixed tiles of POSITION_TILE
  positions; the token drawn at a temperature, over tiles of TILE rows.
A mesh with only a data axis runs this program on each device's rows (runtime.serving.sharding), so its bits are one
device's. Not covered: packed rows (their programs still use the default kernels) and a model axis (it splits sums).

Shapes: B rows, T tokens per row (any), D hidden, N heads, K KV heads, G = N // K, E head dim.
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
MIN_TOKENS = 64  # the fewest tokens of the layers' stream: its matmuls' rows (above the thresholds: see above)
STREAM_TILE = 32  # tokens of a tile of the stream's norms, q/k norms and RoPE tables
TILE = 16  # rows of the vocabulary head's tiles
QUERY_TILE = 16  # queries of an attention tile
# Keys of an attention block, at absolute positions (a multiple of them): 32 against 128 cost 2% instead of 25% on
# items of 8 tokens after a 15-token query, 4% instead of 9% on rows of 256 (embedded model, Intel Xeon, 2026-11-26).
KEY_BLOCK = 32
POSITION_TILE = 64  # positions of a tile of per-position log-probabilities (each tile reads the vocabulary head)


def flatten(x: jax.Array, tokens: int | None = None) -> jax.Array:
    """Rows x [B, T, ...] as one stream of tokens [1, M, ...]: the rows' B * T tokens, then zero tokens up to
    M = `tokens` (default: at least MIN_TOKENS, a whole number of tiles of STREAM_TILE tokens)."""
    B, T = x.shape[:2]
    m = -(-max(B * T, MIN_TOKENS) // STREAM_TILE) * STREAM_TILE if tokens is None else tokens
    return _padded(x.reshape(B * T, *x.shape[2:]), m - B * T)[None]


def tokenwise(fn: Callable, stream):
    """fn over the tokens of streams [1, M, ...] (flatten's: M a whole number of tiles) in tiles of STREAM_TILE."""
    out = rowwise(fn, jax.tree.map(lambda a: a[0], stream), STREAM_TILE)
    return jax.tree.map(lambda a: a[None], out)


def unflatten(x: jax.Array, rows: tuple[int, int]) -> jax.Array:
    """The rows (B, T) of a stream of tokens x [1, M, ...] (flatten's inverse): [B, T, ...]."""
    B, T = rows
    return x[0, :B * T].reshape(B, T, *x.shape[2:])


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
    """fn over the rows of `xs` (arrays led by M rows, any M) in fixed-shape tiles: fn gets `tile` rows at a time
    and returns arrays led by `tile`; zero rows are appended up to a whole tile and their results dropped."""
    m = jax.tree.leaves(xs)[0].shape[0]
    padded = _padded(xs, -m % tile)
    tiles = jax.tree.map(lambda a: a.reshape(-1, tile, *a.shape[1:]), padded)
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[:m], loop(fn, tiles))


def _padded(xs, extra: int):
    """Every array of `xs` with `extra` zero rows appended (none: xs as it is)."""
    if not extra:
        return xs
    return jax.tree.map(lambda a: jnp.concatenate([a, jnp.zeros((extra, *a.shape[1:]), a.dtype)]), xs)


def causal(q: jax.Array, k: jax.Array, v: jax.Array, window, scale: float | None = None,
           softcap: float | None = None, context=None) -> jax.Array:
    """Causal attention over whole rows, per tile of QUERY_TILE queries and block of KEY_BLOCK keys at absolute
    positions: q [B, T, N, E], k/v [B, T, K, E] (any T) -> [B, T, N, E] float32. `window` None, an int or a traced
    int32 scalar (a key k is visible from query q when q - window < k <= q).

    `context`: (keys, values [C, K, E], length) of a shared prefix the rows continue (any length): the rows' tokens
    are at positions length + t. The blocks wholly inside the prefix are sliced from it; the block that straddles its
    end takes its first keys from the prefix and the rest from the row; so every query visits the blocks, and the
    keys in them, of the same query in a row holding the whole sequence.

    A row's tiles and blocks are gathered inside the loop (clipped indices; what lies past a row is never seen)
    rather than cut from padded copies: XLA:CPU contracts multiply-adds into FMAs per fusion, and a pad would fuse
    with the rotation that computes q and k, in a different fusion in each program, so their bits would move."""
    B, T, N, E = q.shape
    K = k.shape[2]
    G = N // K
    scale = 1.0 / np.sqrt(E) if scale is None else scale  # jax.nn.dot_product_attention's default
    n = -(-T // QUERY_TILE)
    ctx_k, ctx_v, length = (None, None, 0) if context is None else context
    q_offsets, k_offsets = jnp.arange(QUERY_TILE), jnp.arange(KEY_BLOCK)

    def one_tile(i):
        row, first = i // n, (i % n) * QUERY_TILE
        qt = jnp.take(q[row], jnp.minimum(first + q_offsets, T - 1), axis=0).reshape(QUERY_TILE, K, G, E)
        q_pos = length + first + q_offsets

        def attend(state, k_pos, kj, vj):
            """Keys kj, vj [block, K, E] at positions k_pos into the online softmax of the queries qt."""
            m, total, acc = state  # [K, G, tile], [K, G, tile], [K, G, tile, E]
            s = jnp.einsum("tkge,ske->kgts", qt, kj, preferred_element_type=F32) * scale
            if softcap is not None:
                s = jnp.tanh(s / softcap) * softcap
            s = jnp.where(visible(q_pos[:, None], k_pos[None, :], window), s, MASKED)  # [K, G, tile, block]
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            keep = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            acc = acc * keep[..., None] + jnp.einsum("kgts,ske->kgte", p.astype(vj.dtype), vj,
                                                     preferred_element_type=F32)
            return m_new, total * keep + jnp.sum(p, axis=-1), acc

        def prefix_block(j, state):
            k_pos = j * KEY_BLOCK + k_offsets
            return attend(state, k_pos, *(jax.lax.dynamic_slice_in_dim(a, j * KEY_BLOCK, KEY_BLOCK)
                                          for a in (ctx_k, ctx_v)))

        def row_block(j, state):
            k_pos = j * KEY_BLOCK + k_offsets
            at_row = jnp.clip(k_pos - length, 0, T - 1)
            kj, vj = jnp.take(k[row], at_row, axis=0), jnp.take(v[row], at_row, axis=0)  # [block, K, E]
            if ctx_k is not None:  # the block that straddles the prefix's end
                in_prefix = (k_pos < length)[:, None, None]
                at_prefix = jnp.minimum(k_pos, ctx_k.shape[0] - 1)
                kj = jnp.where(in_prefix, jnp.take(ctx_k, at_prefix, axis=0), kj)
                vj = jnp.where(in_prefix, jnp.take(ctx_v, at_prefix, axis=0), vj)
            return attend(state, k_pos, kj, vj)

        state = (jnp.full((K, G, QUERY_TILE), MASKED, F32), jnp.zeros((K, G, QUERY_TILE), F32),
                 jnp.zeros((K, G, QUERY_TILE, E), F32))
        whole = 0
        if ctx_k is not None and ctx_k.shape[0] >= KEY_BLOCK:  # a shorter prefix holds no whole block
            whole = length // KEY_BLOCK
            state = jax.lax.fori_loop(0, whole, prefix_block, state)
        _, total, acc = jax.lax.fori_loop(whole, q_pos[-1] // KEY_BLOCK + 1, row_block, state)
        out = acc / total[..., None]  # [K, G, tile, E]
        return jnp.moveaxis(out, 2, 0).reshape(QUERY_TILE, N, E)

    return loop(one_tile, jnp.arange(B * n)).reshape(B, n * QUERY_TILE, N, E)[:, :T]
