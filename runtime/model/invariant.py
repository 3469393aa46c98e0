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
- The norms' sums of squares are matmuls against ones (`rms_norm`). The q/k norms, the MoE router's softmax and the
  RoPE tables run over fixed tiles of TOKEN_TILE tokens in a loop (`tokenwise`): over all tokens at once a row's
  bits moved with their number (q/k norms on tiny Gemma 3, OLMo 2 and Qwen3-MoE configs). Every tile is computed by
  the one compiled kernel of that shape, whatever the batch or bucket, and a token's bits do not depend on its place
  in a tile (the cascade's items start anywhere). The rotation runs over the whole stream with exact products
  (runtime.model.layers.rotate): XLA:CPU contracts a product and a sum into an FMA per fusion, and
  the rotation fused with what cut or gathered the rows moved bits (tiny Llama and Gemma, 2026-11-26 and -28). A
  loop over tiles of tokens kept them too, at ~4 ms of one item's 45 (the embedded model, AMD EPYC Zen 4). The
  final norm runs over tiles of TILE rows, the label head over columns (runtime.model.heads).
- Attention runs per tile of QUERY_TILE queries over blocks of KEY_BLOCK keys at absolute positions (block j holds
  the keys at positions j * KEY_BLOCK and on), in order, with an online softmax: blocks past the queries are never
  visited, keys masked inside a block add exact zeros, so the arithmetic of a query depends only on its position
  and the keys of its own sequence, not on its row, the row's padding or where the row starts.
- Items after a shared prefix (the cascade) are rows that start at the prefix's length, any length: a block that
  straddles the prefix's end takes its first keys from the prefix and the rest from the row (`causal`'s context),
  so each query visits the blocks of a row holding the whole sequence.
- XLA:CPU contracts multiply-adds into FMAs per fusion (measured 2026-11-25): values that reach the loops above are
  gathered inside them, never padded or cut beforehand, so that what computes them is not fused with a pad of a
  different shape in each program (the rotation, the first found, no longer depends on it: its products are exact).
- Per-position log-probabilities (/v1/completions) read the vocabulary head over fixed tiles of POSITION_TILE
  positions; the token drawn at a temperature, over tiles of TILE rows.
A mesh with only a data axis runs this program on each device's rows (runtime.assembly.sharding), so its bits are one
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
# Tokens of a tile of `tokenwise`'s loops (the q/k norms, the RoPE tables, the router): each iteration
# costs ~25 us beyond its work, so tiles are large; a tile's bits do not depend on its size, which is fixed.
TOKEN_TILE = 128
STREAM_ALIGN = 8  # the stream's tokens, a multiple of this
TILE = 16  # rows of the heads' tiles (the label log-probabilities' from Kernels.head_rows: the same bits)
# The rows a label head's tile may have (head_tile): every count up to 32, then a few, so that a tile's size is always
# one runtime.assembly.bitclasses compared (its matmul's classes were 2-24, 25-32, 33-48, 49-64 columns: Zen 4).
HEAD_TILES = (*range(1, 33), 48, 64, 96, 128, 192, 256)
# The fewest rows of the kernels' matmuls (the token stream's, an attention tile's) where the host's own are not
# measured (runtime.assembly.bitclasses): every threshold measured so far is below it (33, 51 and 63 rows).
MIN_ROWS = 64
# Queries of an attention tile at most (a row up to this long is one tile). A tile visits the key blocks up to its
# last query: a 256-token row as one tile ran every query over its 4 blocks (16 tile-blocks of 64 queries), as tiles
# of 64 it runs 10. /v1/completions' 8 x 256 positions 1,976 -> 1,909 ms, the same bits (a query's bits do not depend
# on its tile: AMD EPYC Zen 4, 2026-11-28); tiles of 32 gained nothing more.
QUERY_TILE_MAX = 64
# Keys of an attention block, at absolute positions (a multiple of them). 64: a score matmul [rows, E] x [E, 64] and
# the weighted values' [rows, 64] x [64, E] keep their bits from 1 row (E = 16, 32, 64), where 32 keys or E + 1 value
# columns needed 51 rows (XLA:CPU, float32, Intel Xeon with AVX-512, 2026-11-27): the floor of every stream's rows.
KEY_BLOCK = 64
# Positions of a tile of per-position log-probabilities (each tile reads the whole vocabulary head): the embedded
# model's [128, 576] x [576, 49152] bfloat16 head ran at ~350 GFLOP/s where 64 positions ran at 230-280 and 256 at
# ~280 (AMD EPYC Zen 4, 2026-11-28); 8 x 256 positions 1,909 -> 1,822 ms, the same bits.
POSITION_TILE = 128


def flatten(x: jax.Array, tokens: int | None = None, min_tokens: int = 1, align: int = STREAM_ALIGN) -> jax.Array:
    """Rows x [B, T, ...] as one stream of tokens [1, M, ...]: the rows' B * T tokens, then zero tokens up to
    M = `tokens` (default: at least `min_tokens`, a multiple of `align`)."""
    B, T = x.shape[:2]
    m = -(-max(B * T, min_tokens) // align) * align if tokens is None else tokens
    return _padded(x.reshape(B * T, *x.shape[2:]), m - B * T)[None]


def tokenwise(fn: Callable, stream):
    """fn over the tokens of streams [1, M, ...] (flatten's) in tiles of TOKEN_TILE."""
    out = rowwise(fn, jax.tree.map(lambda a: a[0], stream), TOKEN_TILE)
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


def query_tile(length: int, groups: int, min_rows: int) -> int:
    """Queries per attention tile of rows of `length` tokens: the whole row up to QUERY_TILE_MAX, and at least enough
    that a tile's matmul rows (queries x the G heads of a KV head) reach `min_rows` (Kernels.min_rows)."""
    return max(min(length, QUERY_TILE_MAX), -(-min_rows // groups))


def causal(q: jax.Array, k: jax.Array, v: jax.Array, window, scale: float | None = None,
           softcap: float | None = None, context=None, min_rows: int = 1, sinks: jax.Array | None = None) -> jax.Array:
    """Causal attention over whole rows, per tile of queries (`query_tile`) and block of KEY_BLOCK keys at absolute
    positions (block j holds the keys at positions j * KEY_BLOCK and on), merged in order by an online softmax:
    q [B, T, N, E], k/v [B, T, K, E] (any T) -> [B, T, N, E] float32. `window` None, an int or a traced int32 scalar
    (a key k is visible from query q when q - window < k <= q).

    `context`: (keys, values [C, K, E], length) of a shared prefix the rows continue (any length): the rows' tokens
    are at positions length + t. The blocks wholly inside the prefix are the same for every query: one matmul of all
    the queries of the device batch against each (rows of `min_rows` or more are one bit class, so it gives each
    query the bits of its own row's matmul). The block that straddles the prefix's end takes its first keys from
    the prefix and the rest from the row; so every query visits the blocks, and the keys in them, of the same query
    in a row holding the whole sequence.

    Why the bits do not move: a score is a dot over the head dim and a block's weighted values a dot over the block's
    keys, each a matmul row of at least `min_rows` rows (one bit class whatever the batch); the softmax's sum is a
    matmul of the weights against columns of ones, never a reduction whose order could follow the shape; the running
    maximum is exact in any order. Blocks past a query are visited when its tile needs them: its keys are masked, so
    they add exact zeros. Blocks wholly before a sliding window add a finite sum that the first
    visible block multiplies by exactly 0. `sinks` [N] (gpt-oss): each head's logit starts the running state (its
    maximum, a total of 1, no values), a constant of the head whatever the batch."""
    B, T, N, E = q.shape
    K = k.shape[2]
    G = N // K
    scale = 1.0 / np.sqrt(E) if scale is None else scale  # jax.nn.dot_product_attention's default
    ctx_k, ctx_v, length = (None, None, 0) if context is None else context
    tile = query_tile(T, G, min_rows)
    n = -(-T // tile)
    rows = tile * G  # a tile's matmul rows per row and KV head: its queries, each with its G heads
    # [n, B, K, rows, E]: tile i holds the row's queries i * tile .. (clipped: the last is repeated past T)
    at = jnp.minimum(jnp.arange(n * tile), T - 1)
    tiles = jnp.take(q, at, axis=1).reshape(B, n, tile, K, G, E)
    tiles = jnp.transpose(tiles, (1, 0, 3, 2, 4, 5)).reshape(n, B, K, rows, E)
    q_pos = (length + jnp.arange(n * tile).reshape(n, tile, 1) + jnp.zeros((1, 1, G), jnp.int32)).reshape(n, rows)
    k_offsets = jnp.arange(KEY_BLOCK)

    def attend(state, scores, seen, weigh):
        """One block of keys into the online softmax state (running maximum [..., rows], weighted values and total
        [..., rows, E + 1]): their scores [..., rows, block], which are visible, and `weigh(p)`, the weights' matmul
        with the block's values [..., rows, E]."""
        m, acc = state
        scores = scores * scale
        if softcap is not None:
            scores = jnp.tanh(scores / softcap) * softcap
        scores = jnp.where(seen, scores, MASKED)
        m_new = jnp.maximum(m, _last_axis_max(scores))
        p = jnp.exp(scores - m_new[..., None])
        total = row_sums(p.astype(v.dtype))  # a matmul, as the norms' sums
        return m_new, acc * jnp.exp(m - m_new)[..., None] + jnp.concatenate([weigh(p), total], axis=-1)

    state = _start(sinks, (n, B, K, rows), E, G, tile)
    first = 0
    if ctx_k is not None and ctx_k.shape[0] >= KEY_BLOCK:  # a shorter prefix holds no whole block
        first = length // KEY_BLOCK

        def prefix_block(j, state):
            kj, vj = (jax.lax.dynamic_slice_in_dim(a, j * KEY_BLOCK, KEY_BLOCK) for a in (ctx_k, ctx_v))
            scores = _rows_by_kv(matmul(tiles, kj, ((4,), (2,)), ((2,), (1,))))  # all queries at once
            seen = visible(q_pos[:, :, None], j * KEY_BLOCK + k_offsets, window)[:, None, None]
            return attend(state, scores, seen,
                          lambda p: _rows_by_kv(matmul(p.astype(vj.dtype), vj, ((4,), (0,)), ((2,), (1,)))))
        state = jax.lax.fori_loop(0, first, prefix_block, state)

    def one_tile(xs):
        i, q_i, m, acc = xs  # a tile of every row: queries [B, K, rows, E], its state [B, K, rows(, E + 1)]
        pos_i = jax.lax.dynamic_index_in_dim(q_pos, i, keepdims=False)  # [rows]

        def row_block(j, state):
            k_pos = j * KEY_BLOCK + k_offsets
            at_row = jnp.clip(k_pos - length, 0, T - 1)
            kj, vj = jnp.take(k, at_row, axis=1), jnp.take(v, at_row, axis=1)  # [B, block, K, E]
            if ctx_k is not None:  # the block that straddles the prefix's end
                in_prefix = (k_pos < length)[None, :, None, None]
                at_prefix = jnp.minimum(k_pos, ctx_k.shape[0] - 1)
                kj = jnp.where(in_prefix, jnp.take(ctx_k, at_prefix, axis=0)[None], kj)
                vj = jnp.where(in_prefix, jnp.take(ctx_v, at_prefix, axis=0)[None], vj)
            scores = matmul(q_i, kj, ((3,), (3,)), ((0, 1), (0, 2)))  # [B, K, rows, block]
            seen = visible(pos_i[:, None], k_pos[None, :], window)
            return attend(state, scores, seen,
                          lambda p: matmul(p.astype(vj.dtype), vj, ((3,), (1,)), ((0, 1), (0, 2))))
        # A loop whatever its length: a one-trip loop, inlined, would fuse with what surrounds it (the trip count is
        # hidden from XLA, as in `loop`).
        last = jax.lax.optimization_barrier(jnp.max(pos_i) // KEY_BLOCK + 1)
        _, acc = jax.lax.fori_loop(first, last, row_block, (m, acc))
        return acc[..., :E] / acc[..., E:]  # [B, K, rows, E]

    if n == 1:  # one tile (rows up to QUERY_TILE_MAX): its loop of blocks alone, ~0.1 ms a layer less
        out = one_tile((0, tiles[0], *(a[0] for a in state)))[None]
    else:
        out = loop(one_tile, (jnp.arange(n), tiles, *state))  # [n, B, K, rows, E]
    out = jnp.transpose(out.reshape(n, B, K, tile, G, E), (1, 0, 3, 2, 4, 5)).reshape(B, n * tile, N, E)
    return out[:, :T]


def _start(sinks: jax.Array | None, shape: tuple[int, int, int, int], E: int, G: int, tile: int):
    """The online softmax's state before any key (running maximum [n, B, K, rows], weighted values and total
    [..., E + 1]): nothing seen, or each head's sink seen (row r of KV head k is head k * G + r % G)."""
    if sinks is None:
        return jnp.full(shape, MASKED, F32), jnp.zeros((*shape, E + 1), F32)
    K = shape[2]
    per_row = jnp.tile(sinks.astype(F32).reshape(K, G), (1, tile))  # [K, rows]
    total = jnp.zeros((E + 1,), F32).at[E].set(1.0)
    return jnp.broadcast_to(per_row, shape), jnp.broadcast_to(total, (*shape, E + 1))


def matmul(rows: jax.Array, other: jax.Array, contract, batch=((), ())) -> jax.Array:
    """lax.dot_general with `rows` as its left operand (its free dims the matmul's rows, whose count decides the bit
    class), accumulated in float32. jnp.einsum may swap the operands, making the other side's size the rows."""
    return jax.lax.dot_general(rows, other, (contract, batch), preferred_element_type=F32)


def _rows_by_kv(x: jax.Array) -> jax.Array:
    """[K, n, B, rows, ...] (a matmul batched over KV heads) as [n, B, K, rows, ...]."""
    return jnp.moveaxis(x, 0, 2)


SUM_COLUMNS = 16  # columns of ones a norm's sum of squares is read from (one column would become a reduction)


def row_sums(x: jax.Array) -> jax.Array:
    """x's sums over its last axis [..., 1], as a matmul against SUM_COLUMNS columns of ones in x's dtype: a matmul's
    rows keep their bits from Kernels.min_rows rows up, where a reduction's order followed the number of rows."""
    return matmul(x, jnp.ones((x.shape[-1], SUM_COLUMNS), x.dtype), ((x.ndim - 1,), (0,)))[..., :1]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32 (runtime.model.layers.rms_norm) with each row's sum of squares as a matmul against ones:
    a matmul's rows have one set of bits from Kernels.min_rows rows up, where a reduction's order followed the number
    of rows (RMSNorm 576 wide changed at 4,096 tokens, 64 wide at 64)."""
    x = x.astype(F32)
    flat = x.reshape(-1, x.shape[-1])
    sums = row_sums(flat * flat)
    mean = sums.reshape(*x.shape[:-1], 1) / x.shape[-1]
    return x * jax.lax.rsqrt(mean + eps) * weight.astype(F32)


def _last_axis_max(x: jax.Array) -> jax.Array:
    """The maximum over the last axis as elementwise maxima of halves (exact in any order): XLA:CPU's reduction
    took ~0.3 ms on an attention tile's [3, 72, 32] scores, 40% of one item's attention."""
    return _halved(jnp.maximum, x, x.ndim - 1)


def _halved(op: Callable, x: jax.Array, axis: int) -> jax.Array:
    """x reduced over `axis` by `op` of its halves, then of theirs, ...: elementwise, so every element is combined in
    the same order whatever the other axes hold (a reduction's order followed their sizes)."""
    while x.shape[axis] > 1:
        half = x.shape[axis] // 2
        cut = lambda start, stop: jax.lax.slice_in_dim(x, start, stop, axis=axis)
        top = op(cut(0, half), cut(half, 2 * half))
        x = top if x.shape[axis] % 2 == 0 else jnp.concatenate([top, cut(2 * half, x.shape[axis])], axis=axis)
    return jnp.squeeze(x, axis)


def matmul_shapes(shapes: dict[str, tuple[int, ...]], dtype: str, attention_dtype: str, head_dim: int
                  ) -> tuple[tuple[int, int, str], ...]:
    """Every (inner, outer, dtype) these kernels multiply a variable number of rows by, for a model with these
    arrays (runtime.model.params.array_shapes, and LoRA's): the layers' projections [Layers, I, O], the experts
    [Layers, X, I, O] (every expert at once: I x X * O, and X * I x O down; routed tiles have their own probe,
    runtime.assembly.bitclasses.tile_rows), the norms' sums of squares, and attention's scores and weighted values.
    What runtime.assembly.bitclasses measures."""
    found = {(shapes["embed"][1], SUM_COLUMNS, "float32"), (head_dim, KEY_BLOCK, attention_dtype),
             (KEY_BLOCK, head_dim, attention_dtype), (KEY_BLOCK, SUM_COLUMNS, attention_dtype)}
    for name, shape in shapes.items():
        base = name.removeprefix("layers.")
        if name == base or not base.startswith(("w", "experts_", "lora_")):
            continue
        if base.startswith("experts_"):  # every expert at once (SCOREFN_EXPERTS=all)
            _, experts, inner, outer = shape
            found.add((experts * inner, outer, dtype) if base == "experts_down" else (inner, experts * outer, dtype))
        else:
            found.add((*shape[1:], dtype))
    return tuple(sorted(found))


def logsumexp_columns(x: jax.Array) -> jax.Array:
    """log(sum(exp(x))) over the first axis of columns x [V, C]: the maximum (exact in any order), then the sum of the
    exponentials by halves (`_halved`), so a column's bits do not depend on how many there are."""
    top = jnp.max(x, axis=0)
    return top + jnp.log(_halved(jnp.add, jnp.exp(x - top), 0))


def head_tile(rows: int, span: tuple[int, int]) -> int:
    """Rows of a head's tile for a batch of `rows`: the fewest of HEAD_TILES that hold them, within `span`
    (Kernels.head_rows: the counts that give a row the same bits, both among HEAD_TILES), else its nearest end."""
    fits = next((t for t in HEAD_TILES if t >= rows), HEAD_TILES[-1])
    return min(max(fits, span[0]), span[1])
