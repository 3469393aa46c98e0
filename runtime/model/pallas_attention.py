"""Batch-invariant attention as Pallas kernels (GPU, through Triton): each program computes BLOCK_Q queries of one
head, walking the keys in blocks of BLOCK_K at absolute positions (block j holds the keys at positions j * BLOCK_K and
on) with an online softmax.

The same arithmetic as runtime.model.invariant.causal (the CPU's, in XLA), in kernel launches instead of a loop of
them (a loop of per-tile XLA dots was 334x the default on an H100): a query's scores are dot products over the head dim
and its weighted values sums over a block's keys, each an MMA of the kernels' fixed tiles, so a row of them has the
same bits in any tile and whatever the other rows; the softmax's row maximum and sum are reductions within the tile,
alike for every row; every block goes through one function, `_attend`. Blocks past a query are visited when its tile
needs them: their keys are masked (finite MASKED, weight exactly 0), so they change nothing; blocks wholly before a
sliding window add a finite sum that the first visible block multiplies by exactly 0. So a query's bits depend on its
position and the keys of its sequence alone: not on its row, the row's padding, the batch, or whether a shared
prefix's keys come from the context (the cascade) or from the row itself.

After a shared prefix (the cascade) two kernels run. `_prefix_kernel` takes the queries of every row together, in
tiles of BLOCK_Q of the flattened batch, through the blocks wholly inside the prefix (the same blocks for every query),
and writes each query's online-softmax state; `_row_kernel` continues it, row by row, from the block that straddles
the prefix's end (its first keys from the prefix, the rest from the row) on. Items of 20 tokens after a 2,000-token
query no longer fill a 64-query tile each through 31 blocks of the prefix (one layer at the peers' W2 on an H200:
6.67 ms as one kernel, 2.58 ms as two).

Shapes: B rows, T queries a row, N heads, K KV heads, G = N // K, E head dim, C context keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

F32 = jnp.float32
MASKED = -1e30  # as runtime.model.attention: finite, so a block no query sees keeps the running softmax finite
BLOCK_Q = 64  # queries of a program
BLOCK_K = 64  # keys of a block, at absolute positions
NO_WINDOW = 2**30


INTERPRET = False  # tests on a CPU: the kernels' semantics run as JAX operations (pallas_call interpret mode)


def causal(q: jax.Array, k: jax.Array, v: jax.Array, window, scale: float | None = None,
           softcap: float | None = None, context=None, interpret: bool | None = None) -> jax.Array:
    """runtime.model.invariant.causal's contract: q [B, T, N, E], k/v [B, T, K, E] at positions length + t (length:
    the shared prefix's, 0 without `context` = (keys, values [C, K, E], length)) -> [B, T, N, E] float32. `window`:
    None, an int or a traced int32 scalar. `interpret`: run the kernels' semantics as JAX operations (default:
    INTERPRET)."""
    interpret = INTERPRET if interpret is None else interpret
    B, T, N, E = q.shape
    K = k.shape[2]
    G = N // K
    scale = 1.0 / np.sqrt(E) if scale is None else scale
    padded = -(-T // BLOCK_Q) * BLOCK_Q
    window = jnp.full((1,), NO_WINDOW if window is None else window, jnp.int32)
    how = dict(scale=float(scale), softcap=softcap)
    # Fixed: the tiles' bits (num_warps and num_stages decide the MMAs' layout and so the order of the reductions)
    params = pl_triton.CompilerParams(num_warps=4 if E <= 64 else 8, num_stages=2)
    if context is None:
        ctx_k = ctx_v = jnp.zeros((BLOCK_K, K, E), k.dtype)
        length = jnp.zeros((1,), jnp.int32)
    else:
        ctx_k, ctx_v, length = context
        width = -(-ctx_k.shape[0] // BLOCK_K) * BLOCK_K
        ctx_k, ctx_v = (jnp.pad(a.astype(k.dtype), ((0, width - a.shape[0]), (0, 0), (0, 0))) for a in (ctx_k, ctx_v))
        length = jnp.reshape(length, (1,)).astype(jnp.int32)
    C = ctx_k.shape[0]
    ctx_spec = pl.BlockSpec((C, None, E), lambda *grid: (0, grid[-1] // G, 0))
    scalar_spec = pl.BlockSpec((1,), lambda *grid: (0,))
    state, state_specs = (), []
    if context is not None and C >= BLOCK_K:  # a prefix of at least one whole block: the state after it
        state = _prefix_state(q, ctx_k, ctx_v, length, window, ctx_spec, scalar_spec, params, how, interpret)
        state = tuple(jnp.pad(a, ((0, 0), (0, padded - T)) + ((0, 0),) * (a.ndim - 2)) for a in state)
        queries = pl.BlockSpec((None, BLOCK_Q, None), lambda i, b, h: (b, i, h))
        state_specs = [queries, queries, pl.BlockSpec((None, BLOCK_Q, None, E), lambda i, b, h: (b, i, h, 0))]
    q, k, v = (jnp.pad(a, ((0, 0), (0, padded - T), (0, 0), (0, 0))) for a in (q, k, v))
    tile = lambda i, b, h: (b, i, h, 0)  # noqa: E731
    kernel = functools.partial(_row_kernel, rows=padded, context_keys=C, has_context=context is not None,
                               has_state=bool(state), **how)
    out = pl.pallas_call(
        kernel,
        grid=(padded // BLOCK_Q, B, N),
        in_specs=[pl.BlockSpec((None, BLOCK_Q, None, E), tile),
                  pl.BlockSpec((None, padded, None, E), lambda i, b, h: (b, 0, h // G, 0)),
                  pl.BlockSpec((None, padded, None, E), lambda i, b, h: (b, 0, h // G, 0)),
                  ctx_spec, ctx_spec, scalar_spec, scalar_spec, *state_specs],
        out_specs=pl.BlockSpec((None, BLOCK_Q, None, E), tile),
        out_shape=jax.ShapeDtypeStruct((B, padded, N, E), F32),
        compiler_params=params,
        interpret=interpret,
        name="invariant_attention",
    )(q, k, v, ctx_k, ctx_v, length, window, *state)
    return out[:, :T]


def _prefix_state(q, ctx_k, ctx_v, length, window, ctx_spec, scalar_spec, params, how, interpret):
    """Every query's online-softmax state after the blocks wholly inside the prefix: (running maximum [B, T, N],
    total [B, T, N], weighted values [B, T, N, E]), the batch's queries flattened into tiles of BLOCK_Q."""
    B, T, N, E = q.shape
    S = -(-(B * T) // BLOCK_Q) * BLOCK_Q
    flat = jnp.pad(q.reshape(B * T, N, E), ((0, S - B * T), (0, 0), (0, 0)))
    positions = jnp.pad(jnp.tile(jnp.arange(T, dtype=jnp.int32), B), (0, S - B * T)) + length[0]
    queries = pl.BlockSpec((BLOCK_Q, None), lambda i, h: (i, h))
    m, total, acc = pl.pallas_call(
        functools.partial(_prefix_kernel, **how),
        grid=(S // BLOCK_Q, N),
        in_specs=[pl.BlockSpec((BLOCK_Q, None, E), lambda i, h: (i, h, 0)), pl.BlockSpec((BLOCK_Q,), lambda i, h: (i,)),
                  ctx_spec, ctx_spec, scalar_spec, scalar_spec],
        out_specs=[queries, queries, pl.BlockSpec((BLOCK_Q, None, E), lambda i, h: (i, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((S, N), F32), jax.ShapeDtypeStruct((S, N), F32),
                   jax.ShapeDtypeStruct((S, N, E), F32)],
        compiler_params=params,
        interpret=interpret,
        name="invariant_attention_prefix",
    )(flat, positions, ctx_k, ctx_v, length, window)
    return tuple(a[:B * T].reshape(B, T, *a.shape[1:]) for a in (m, total, acc))


def _attend(carry, q, keys, values, q_pos, k_pos, window, scale: float, softcap: float | None):
    """One block of keys [BLOCK_K, E] at positions k_pos into the online-softmax state (running maximum [BLOCK_Q],
    total [BLOCK_Q], weighted values [BLOCK_Q, E]) of the queries q [BLOCK_Q, E] at positions q_pos: the one
    arithmetic of every block in both kernels."""
    m, total, acc = carry
    scores = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=F32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    seen = (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] - k_pos[None, :] < window)
    scores = jnp.where(seen, scores, MASKED)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    p = jnp.exp(scores - m_new[:, None])
    keep = jnp.exp(m - m_new)
    weighted = jax.lax.dot_general(p.astype(values.dtype), values, (((1,), (0,)), ((), ())),
                                   preferred_element_type=F32)
    return m_new, total * keep + jnp.sum(p, axis=1), acc * keep[:, None] + weighted


def _prefix_kernel(q_ref, pos_ref, ctx_k_ref, ctx_v_ref, length_ref, window_ref, m_ref, total_ref, acc_ref, *,
                   scale: float, softcap: float | None):
    """One tile of BLOCK_Q queries (of any rows) of one head through the prefix's whole blocks: q_ref [BLOCK_Q, E],
    pos_ref [BLOCK_Q] their positions; the context's keys and values [C, E] of its KV head."""
    q, q_pos, window = q_ref[...], pos_ref[...], window_ref[0]

    def block(j, carry):
        at = pl.ds(j * BLOCK_K, BLOCK_K)
        return _attend(carry, q, ctx_k_ref[at, :], ctx_v_ref[at, :], q_pos, j * BLOCK_K + jnp.arange(BLOCK_K),
                       window, scale, softcap)

    E = q.shape[-1]
    start = (jnp.full((BLOCK_Q,), MASKED, F32), jnp.zeros((BLOCK_Q,), F32), jnp.zeros((BLOCK_Q, E), F32))
    m_ref[...], total_ref[...], acc_ref[...] = jax.lax.fori_loop(0, length_ref[0] // BLOCK_K, block, start)


def _row_kernel(q_ref, k_ref, v_ref, ctx_k_ref, ctx_v_ref, length_ref, window_ref, *refs, scale: float,
                softcap: float | None, rows: int, context_keys: int, has_context: bool, has_state: bool):
    """One tile of BLOCK_Q queries of one head of one row: q_ref [BLOCK_Q, E]; the row's keys and values k_ref, v_ref
    [rows, E] and the context's [context_keys, E] of its KV head; refs: _prefix_kernel's state of the tile (running
    maximum and total [BLOCK_Q], weighted values [BLOCK_Q, E]) where `has_state`, then the output [BLOCK_Q, E]."""
    i = pl.program_id(0)
    length, window = length_ref[0], window_ref[0]
    q = q_ref[...]
    q_pos = length + i * BLOCK_Q + jnp.arange(BLOCK_Q)  # absolute positions

    def block(j, carry, prefix: bool):
        k_pos = j * BLOCK_K + jnp.arange(BLOCK_K)
        at_row = jnp.clip(k_pos - length, 0, rows - 1)
        keys, values = k_ref[at_row, :], v_ref[at_row, :]
        if prefix:  # the block that straddles the prefix's end: its keys before the end come from the prefix
            in_prefix = (k_pos < length)[:, None]
            at_prefix = jnp.clip(k_pos, 0, context_keys - 1)
            keys = jnp.where(in_prefix, ctx_k_ref[at_prefix, :], keys)
            values = jnp.where(in_prefix, ctx_v_ref[at_prefix, :], values)
        return _attend(carry, q, keys, values, q_pos, k_pos, window, scale, softcap)

    *state_refs, o_ref = refs
    E = q.shape[-1]
    carry = (tuple(ref[...] for ref in state_refs) if has_state else
             (jnp.full((BLOCK_Q,), MASKED, F32), jnp.zeros((BLOCK_Q,), F32), jnp.zeros((BLOCK_Q, E), F32)))
    first = length // BLOCK_K if has_context else 0  # the blocks before: _prefix_kernel's (none: a short prefix)
    if has_context:
        carry = block(first, carry, prefix=True)
        first = first + 1
    last = (length + i * BLOCK_Q + BLOCK_Q - 1) // BLOCK_K + 1
    _, total, acc = jax.lax.fori_loop(first, last, functools.partial(block, prefix=False), carry)
    o_ref[...] = acc / total[:, None]
