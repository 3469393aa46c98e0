"""Batch-invariant attention as one Pallas kernel (GPU, through Triton): each program computes BLOCK_Q queries of one
head of one row, walking the keys in blocks of BLOCK_K at absolute positions (block j holds the keys at positions
j * BLOCK_K and on) with an online softmax, from a shared prefix's keys or the row's own.

The same arithmetic as runtime.model.invariant.causal (the CPU's, in XLA), in one kernel launch instead of a loop of
them (a loop of per-tile XLA dots was 334x the default on an H100): a query's scores are dot products over the head dim
and its weighted values sums over a block's keys, each an MMA of the kernel's fixed tiles, so a row of them has the
same bits in any tile and whatever the other rows; the softmax's row maximum and sum are reductions within the tile,
alike for every row. Blocks past a query are visited when its tile needs them: their keys are masked (finite MASKED,
weight exactly 0), so they change nothing; blocks wholly before a sliding window add a finite sum that the first
visible block multiplies by exactly 0. So a query's bits depend on its position and the keys of its sequence alone:
not on its row, the row's padding, the batch, or whether a shared prefix's keys come from the context (the cascade)
or from the row itself.

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
    scale = 1.0 / np.sqrt(E) if scale is None else scale
    padded = -(-T // BLOCK_Q) * BLOCK_Q
    q, k, v = (jnp.pad(a, ((0, 0), (0, padded - T), (0, 0), (0, 0))) for a in (q, k, v))
    if context is None:
        ctx_k = ctx_v = jnp.zeros((BLOCK_K, K, E), k.dtype)
        length = jnp.zeros((1,), jnp.int32)
    else:
        ctx_k, ctx_v, length = context
        width = -(-ctx_k.shape[0] // BLOCK_K) * BLOCK_K
        ctx_k, ctx_v = (jnp.pad(a.astype(k.dtype), ((0, width - a.shape[0]), (0, 0), (0, 0))) for a in (ctx_k, ctx_v))
        length = jnp.reshape(length, (1,)).astype(jnp.int32)
    window = jnp.full((1,), NO_WINDOW if window is None else window, jnp.int32)
    C = ctx_k.shape[0]
    G = N // K
    kernel = functools.partial(_kernel, scale=float(scale), softcap=softcap, rows=padded, context_keys=C,
                               has_context=context is not None)
    out = pl.pallas_call(
        kernel,
        grid=(padded // BLOCK_Q, B, N),
        in_specs=[pl.BlockSpec((None, BLOCK_Q, None, E), lambda i, b, h: (b, i, h, 0)),
                  pl.BlockSpec((None, padded, None, E), lambda i, b, h: (b, 0, h // G, 0)),
                  pl.BlockSpec((None, padded, None, E), lambda i, b, h: (b, 0, h // G, 0)),
                  pl.BlockSpec((C, None, E), lambda i, b, h: (0, h // G, 0)),
                  pl.BlockSpec((C, None, E), lambda i, b, h: (0, h // G, 0)),
                  pl.BlockSpec((1,), lambda i, b, h: (0,)),
                  pl.BlockSpec((1,), lambda i, b, h: (0,))],
        out_specs=pl.BlockSpec((None, BLOCK_Q, None, E), lambda i, b, h: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((B, padded, N, E), F32),
        compiler_params=pl_triton.CompilerParams(num_warps=4 if E <= 64 else 8, num_stages=2),  # fixed: its bits
        interpret=interpret,
        name="invariant_attention",
    )(q, k, v, ctx_k, ctx_v, length, window)
    return out[:, :T]


def _kernel(q_ref, k_ref, v_ref, ctx_k_ref, ctx_v_ref, length_ref, window_ref, o_ref, *, scale: float,
            softcap: float | None, rows: int, context_keys: int, has_context: bool):
    """One tile of BLOCK_Q queries of one head of one row: q_ref [BLOCK_Q, E]; the row's keys and values k_ref,
    v_ref [rows, E] and the context's [context_keys, E] of its KV head; o_ref [BLOCK_Q, E]."""
    i = pl.program_id(0)
    length, window = length_ref[0], window_ref[0]
    q = q_ref[...]
    q_pos = length + i * BLOCK_Q + jnp.arange(BLOCK_Q)  # absolute positions

    def block(j, carry):
        m, total, acc = carry  # [BLOCK_Q], [BLOCK_Q], [BLOCK_Q, E]
        k_pos = j * BLOCK_K + jnp.arange(BLOCK_K)
        at_row = jnp.clip(k_pos - length, 0, rows - 1)
        keys, values = k_ref[at_row, :], v_ref[at_row, :]
        if has_context:  # keys before the prefix's end come from it (the block that straddles it takes both)
            in_prefix = (k_pos < length)[:, None]
            at_prefix = jnp.clip(k_pos, 0, context_keys - 1)
            keys = jnp.where(in_prefix, ctx_k_ref[at_prefix, :], keys)
            values = jnp.where(in_prefix, ctx_v_ref[at_prefix, :], values)
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

    E = q.shape[-1]
    start = (jnp.full((BLOCK_Q,), MASKED, F32), jnp.zeros((BLOCK_Q,), F32), jnp.zeros((BLOCK_Q, E), F32))
    last = (length + i * BLOCK_Q + BLOCK_Q - 1) // BLOCK_K + 1
    _, total, acc = jax.lax.fori_loop(0, last, block, start)
    o_ref[...] = acc / total[:, None]
