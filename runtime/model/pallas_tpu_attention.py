"""Batch-invariant attention as a Pallas kernel on a TPU (Mosaic): the arithmetic of runtime.model.pallas_attention
(the GPU's) laid out as Mosaic wants it.

Each program computes BLOCK_Q queries of one head of one row, walking the keys in blocks of BLOCK_K at absolute
positions (block j holds the keys at positions j * BLOCK_K and on) with an online softmax, every block through one
function, `_attend`: a query's scores are dot products over the head dim and its weighted values sums over a block's
keys, each a matmul of the kernel's fixed tiles, so a row of them has the same bits in any tile and whatever the other
rows; the softmax's row maximum and sum are reductions within the tile, alike for every row. Blocks past a query are
visited when its tile needs them, their keys masked (finite MASKED, weight exactly 0); blocks wholly before a sliding
window add a finite sum that the first visible block multiplies by exactly 0. So a query's bits depend on its position
and its sequence's keys alone: not on its row, the row's padding, the batch, or whether a shared prefix's keys come
from the context (the cascade) or from the row itself.

Mosaic slices a block of rows at aligned offsets only, so the keys are laid out at absolute positions before the
kernel: each row's keys from the block that holds the prefix's end on (that block's keys before the end from the
prefix, the rest the row's), built by XLA once a layer. The prefix's whole blocks are read from the context as they
are, by every tile of queries (the GPU runs them once for the flattened queries of every row: a kernel of its own).

Shapes: B rows, T queries a row, N heads, K KV heads, G = N // K, E head dim, C context keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# The GPU kernels' tiles, masking value and absent window: one design on both accelerators
from runtime.model.pallas_attention import BLOCK_K, BLOCK_Q, F32, MASKED, NO_WINDOW

INTERPRET = False  # tests on a CPU: the kernel's semantics run as JAX operations (pallas_call interpret mode)


def causal(q: jax.Array, k: jax.Array, v: jax.Array, window, scale: float | None = None,
           softcap: float | None = None, context=None, interpret: bool | None = None) -> jax.Array:
    """runtime.model.invariant.causal's contract: q [B, T, N, E], k/v [B, T, K, E] at positions length + t (length:
    the shared prefix's, 0 without `context` = (keys, values [C, K, E], length)) -> [B, T, N, E] float32. `window`:
    None, an int or a traced int32 scalar. `interpret`: run the kernel's semantics as JAX operations (default:
    INTERPRET)."""
    interpret = INTERPRET if interpret is None else interpret
    B, T, N, E = q.shape
    K = k.shape[2]
    G = N // K
    scale = 1.0 / np.sqrt(E) if scale is None else scale
    padded = -(-T // BLOCK_Q) * BLOCK_Q
    if context is None:
        ctx_k = ctx_v = jnp.zeros((BLOCK_K, K, E), k.dtype)
        length = jnp.int32(0)
    else:
        ctx_k, ctx_v, length = context
        length = jnp.asarray(length, jnp.int32)
    # Whole blocks, and one more: the block that holds the prefix's end is always in range.
    C = (-(-ctx_k.shape[0] // BLOCK_K) + 1) * BLOCK_K
    ctx_k, ctx_v = (jnp.pad(a.astype(k.dtype), ((0, C - a.shape[0]), (0, 0), (0, 0))) for a in (ctx_k, ctx_v))
    if context is None:  # the rows' keys are at absolute positions already: nothing to lay out
        keys, values = (jnp.pad(a, ((0, 0), (0, BLOCK_K + padded - T), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
                        for a in (k, v))
    else:
        keys, values = (_from_the_prefix_end(rows, prefix, length, padded)
                        for rows, prefix in ((k, ctx_k), (v, ctx_v)))
    scalars = jnp.stack([length, jnp.asarray(NO_WINDOW if window is None else window, jnp.int32)])
    by_head = lambda b, h, i, scalars: (b, h, i, 0)  # noqa: E731
    # lax.div, not //, here and in the kernel: a floor division lowers through the compiling host's TPU generation
    # (none on a CPU compiling deviceless), and these are never negative
    kv_head = lambda h: jax.lax.div(h, jnp.int32(G))  # noqa: E731
    by_kv_head = lambda b, h, i, scalars: (b, kv_head(h), 0, 0)  # noqa: E731
    context_spec = pl.BlockSpec((None, C, E), lambda b, h, i, scalars: (kv_head(h), 0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), softcap=softcap),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, N, padded // BLOCK_Q),
            in_specs=[pl.BlockSpec((None, None, BLOCK_Q, E), by_head),
                      pl.BlockSpec((None, None, BLOCK_K + padded, E), by_kv_head),
                      pl.BlockSpec((None, None, BLOCK_K + padded, E), by_kv_head),
                      context_spec, context_spec],
            out_specs=pl.BlockSpec((None, None, BLOCK_Q, E), by_head)),
        out_shape=jax.ShapeDtypeStruct((B, N, padded, E), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="invariant_attention_tpu",
    )(scalars, jnp.pad(q, ((0, 0), (0, padded - T), (0, 0), (0, 0))).transpose(0, 2, 1, 3), keys, values,
      ctx_k.transpose(1, 0, 2), ctx_v.transpose(1, 0, 2))
    return out[:, :, :T].transpose(0, 2, 1, 3)


def _from_the_prefix_end(rows: jax.Array, prefix: jax.Array, length: jax.Array, padded: int) -> jax.Array:
    """A row's keys (or values) [B, T, K, E] at positions length + t, and the context's [C, K, E], as
    [B, K, BLOCK_K + padded, E]: the keys at positions first * BLOCK_K + p (first = length // BLOCK_K), the prefix's
    before `length`, the row's from there, zeros after."""
    B, T, K, E = rows.shape
    first = length // BLOCK_K
    offset = length - first * BLOCK_K  # the prefix's keys in its last block
    head = jax.lax.dynamic_slice_in_dim(prefix, first * BLOCK_K, BLOCK_K)
    spaced = jnp.pad(rows, ((0, 0), (BLOCK_K, padded - T + BLOCK_K), (0, 0), (0, 0)))
    shifted = jax.lax.dynamic_slice_in_dim(spaced, BLOCK_K - offset, BLOCK_K + padded, axis=1)
    from_prefix = (jnp.arange(BLOCK_K + padded) < offset)[None, :, None, None]
    head = jnp.pad(head, ((0, padded), (0, 0), (0, 0)))[None]
    return jnp.where(from_prefix, head, shifted).transpose(0, 2, 1, 3)


def _attend(carry, q, keys, values, q_pos, k_start, window, scale: float, softcap: float | None):
    """One block of keys [BLOCK_K, E] starting at position k_start into the online-softmax state (running maximum
    [BLOCK_Q, 1], total [BLOCK_Q, 1], weighted values [BLOCK_Q, E]) of the queries q [BLOCK_Q, E] at positions q_pos
    [BLOCK_Q, BLOCK_K] (each row one query's): the one arithmetic of every block."""
    m, total, acc = carry
    # Explicit: accelerators trace under matmul precision "highest", which Mosaic refuses for bfloat16 operands (their
    # products are exact in float32 anyway); float32 operands keep it.
    precision = jax.lax.Precision.HIGHEST if q.dtype == F32 else jax.lax.Precision.DEFAULT
    scores = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=F32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    scores = jnp.where((k_pos <= q_pos) & (q_pos - k_pos < window), scores, MASKED)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
    p = jnp.exp(scores - m_new)
    keep = jnp.exp(m - m_new)
    weighted = jax.lax.dot_general(p.astype(values.dtype), values, (((1,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=F32)
    return m_new, total * keep + jnp.sum(p, axis=1, keepdims=True), acc * keep + weighted


def _kernel(scalars_ref, q_ref, k_ref, v_ref, ctx_k_ref, ctx_v_ref, o_ref, *, scale: float, softcap: float | None):
    """One tile of BLOCK_Q queries of one head of one row: q_ref [BLOCK_Q, E]; the row's keys and values from the
    prefix's last block on, k_ref and v_ref [BLOCK_K + rows, E], and the context's, ctx_k_ref and ctx_v_ref [C, E], of
    its KV head; scalars_ref: the prefix's length and the window."""
    i = pl.program_id(2)
    length, window = scalars_ref[0], scalars_ref[1]
    first = jax.lax.div(length, jnp.int32(BLOCK_K))  # the prefix's whole blocks
    q = q_ref[...]
    q_pos = length + i * BLOCK_Q + jax.lax.broadcasted_iota(jnp.int32, (BLOCK_Q, BLOCK_K), 0)  # absolute positions

    def prefix_block(j, carry):
        at = pl.ds(pl.multiple_of(j * BLOCK_K, BLOCK_K), BLOCK_K)
        return _attend(carry, q, ctx_k_ref[at, :], ctx_v_ref[at, :], q_pos, j * BLOCK_K, window, scale, softcap)

    def row_block(j, carry):
        at = pl.ds(pl.multiple_of((j - first) * BLOCK_K, BLOCK_K), BLOCK_K)
        return _attend(carry, q, k_ref[at, :], v_ref[at, :], q_pos, j * BLOCK_K, window, scale, softcap)

    E = q.shape[-1]
    carry = (jnp.full((BLOCK_Q, 1), MASKED, F32), jnp.zeros((BLOCK_Q, 1), F32), jnp.zeros((BLOCK_Q, E), F32))
    carry = jax.lax.fori_loop(0, first, prefix_block, carry)
    last = jax.lax.div(length + i * BLOCK_Q + BLOCK_Q - 1, jnp.int32(BLOCK_K)) + 1
    _, total, acc = jax.lax.fori_loop(first, last, row_block, carry)
    o_ref[...] = acc / total
