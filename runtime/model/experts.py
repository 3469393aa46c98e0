"""Routed experts (a mixture-of-experts block) at their active FLOPs, with the same bits whatever the batch.

Each token goes to its top-k experts. The (token, expert) pairs are sorted by expert, each expert's pairs fill whole
tiles of `tile` rows (its last tile padded with zero rows), and a loop multiplies TILES_PER_STEP tiles a step, each
by its own expert's gate, up and down projections (one batched matmul), over only the steps that hold tiles. Every
step is one compiled shape whatever the batch, so a pair's result does not depend on which other tokens chose its
expert, as long as a row's bits do not depend on where it sits among the tiles: Kernels.expert_tile is the fewest
rows the host's probe finds so (runtime.assembly.bitclasses.tile_rows). The router's weight multiplies the expert's
hidden activations (a product, no sum: nothing for XLA:CPU to contract into an FMA); a token's k outputs are then
added in its top-k order. gpt-oss's experts have biases (added elementwise, so a row's bits still depend on its own
values only; the down projection's bias weighted by the router, as transformers weighs the whole output) and its
own clamped SwiGLU (`gated`).

The work is (pairs + at most one part-filled tile per expert) rows against the dense path's tokens x experts rows
(`routed_rows`), so the dense path (every expert on every token, weighted 0 where not chosen) is kept only where it
computes fewer rows and the bits need not hold (runtime.model.decoder_layer decides, per compiled shape).
jax.lax.ragged_dot computed every group densely on XLA:CPU (1.55 s against 0.21 s for every expert on 736 tokens
of the bench's MoE, AMD EPYC, 2026-12-06).

Shapes: N tokens, D hidden, X experts, F expert hidden, k experts per token, P = N * k pairs, G tiles a step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from typing import Callable

from runtime.model.layers import ACTIVATIONS, dense

F32 = jnp.float32
# Tiles a step of the loop multiplies at once, each by its own expert's weights (one batched matmul): fewer, larger
# matmuls than a tile a step (docs/how-it-works/platform.md, SCOREFN_EXPERTS).
TILES_PER_STEP = 8


def router_top_k(x: jax.Array, router: jax.Array, top_k: int, normalize: bool, bias: jax.Array | None = None,
                 top_k_first: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (weights, experts) [..., k] in float32: the top-k of the router's softmax as transformers'
    Qwen3-MoE, Mixtral and OLMoE compute it, renormalized to sum 1 when `normalize` (norm_topk_prob); or, with
    `top_k_first` (gpt-oss), the softmax over the top-k logits. `bias`: the router's (gpt-oss)."""
    logits = dense(x.astype(F32), router.astype(F32), bias)  # [..., X]
    if top_k_first:
        top, chosen = jax.lax.top_k(logits, top_k)
        return jax.nn.softmax(top, axis=-1), chosen
    top, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, chosen


def gated(activation: str, alpha: float = 1.702, limit: float = 7.0) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """An expert's hidden activations from its gate and up projections: act(gate) * up, or gpt-oss's clamped SwiGLU
    (`clamped_swiglu`: the gate clamped above at `limit`, up to [-limit, limit], gate * sigmoid(alpha * gate) *
    (up + 1))."""
    if activation != "clamped_swiglu":
        return lambda gate, up: ACTIVATIONS[activation](gate) * up

    def clamped_swiglu(gate, up):
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return gate * jax.nn.sigmoid(gate * alpha) * (up + 1)
    return clamped_swiglu


def routed_rows(tokens: int, experts: int, top_k: int, tile: int) -> int:
    """Rows the routed layout computes for `tokens` tokens: their pairs in whole tiles, at most one part-filled tile
    per expert (and never more tiles than the pairs could fill with one token per row)."""
    return tile * tile_count(tokens, experts, top_k, tile)


def tile_count(tokens: int, experts: int, top_k: int, tile: int) -> int:
    pairs = tokens * top_k
    return min(-(-pairs // tile) + min(experts, pairs), pairs)


def mixture(x: jax.Array, weights: jax.Array, chosen: jax.Array, p: dict, glu: Callable, tile: int) -> jax.Array:
    """The experts' outputs mixed by the router: x [N, D], weights/chosen [N, k] -> [N, D] float32. `glu`: the
    hidden activations of (gate, up) (`gated`)."""
    N, D = x.shape
    k = chosen.shape[-1]
    w_gate, w_up, w_down = p["experts_gate"], p["experts_up"], p["experts_down"]  # [X, D, F], [X, D, F], [X, F, D]
    X = w_gate.shape[0]
    steps = -(-tile_count(N, X, k, tile) // TILES_PER_STEP)
    n_tiles = steps * TILES_PER_STEP
    expert_of = chosen.reshape(N * k).astype(jnp.int32)
    order = jnp.argsort(expert_of, stable=True)  # the pairs by expert, each expert's in token order
    counts = jnp.bincount(expert_of, length=X)
    tiles = -(-counts // tile)
    ends = jnp.cumsum(tiles)  # each expert's tiles end here
    first_pair = jnp.cumsum(counts) - counts
    sorted_expert = expert_of[order]
    slot = (ends - tiles)[sorted_expert] * tile + jnp.arange(N * k) - first_pair[sorted_expert]  # each sorted pair's row
    # The tokens of the tiled rows (N: a zero row for the padding) and each tile's expert (the last for unused tiles)
    token_at = jnp.full(n_tiles * tile, N, jnp.int32).at[slot].set((order // k).astype(jnp.int32))
    weight_at = jnp.zeros(n_tiles * tile, F32).at[slot].set(weights.reshape(N * k).astype(F32)[order])
    tile_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(n_tiles), side="right"), X - 1)
    padded = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)]).astype(w_gate.dtype)
    steps_in = (padded[token_at].reshape(steps, TILES_PER_STEP, tile, D),
                weight_at.reshape(steps, TILES_PER_STEP, tile), tile_expert.reshape(steps, TILES_PER_STEP))

    def step(i, out):  # TILES_PER_STEP tiles, each through its expert: [G, tile, D] -> [G, tile, D]
        rows, weight, e = (jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in steps_in)
        tile_bias = lambda y, projection, scale=1.0: _biased(y, p, projection, e[:, None], scale)  # [G, 1, ...]
        gate = tile_bias(jnp.einsum("gtd,gdf->gtf", rows, w_gate[e], preferred_element_type=F32), "gate")
        up = tile_bias(jnp.einsum("gtd,gdf->gtf", rows, w_up[e], preferred_element_type=F32), "up")
        hidden = glu(gate, up) * weight[..., None]
        result = jnp.einsum("gtf,gfd->gtd", hidden.astype(w_down.dtype), w_down[e], preferred_element_type=F32)
        result = tile_bias(result, "down", weight[..., None])
        return jax.lax.dynamic_update_index_in_dim(out, result, i, 0)

    # Only the steps that hold tiles: a trip count the data decides, so XLA keeps the loop whatever it is
    used = -(-ends[-1] // TILES_PER_STEP)
    out = jax.lax.fori_loop(0, used, step, jnp.zeros((steps, TILES_PER_STEP, tile, D), F32))
    by_pair = out.reshape(n_tiles * tile, D)[jnp.zeros(N * k, jnp.int32).at[order].set(slot)].reshape(N, k, D)
    total = by_pair[:, 0]
    for j in range(1, k):  # in top-k order, one addition at a time
        total = total + by_pair[:, j]
    return total


def _biased(y: jax.Array, p: dict, projection: str, e: jax.Array, scale: jax.Array | float = 1.0) -> jax.Array:
    """y plus the bias [*e.shape, ...] of the experts `e` times `scale` where they have one (gpt-oss's b_experts_*)."""
    bias = p.get(f"b_experts_{projection}")
    return y if bias is None else y + scale * bias[e].astype(F32)


def all_experts(x: jax.Array, weights: jax.Array, chosen: jax.Array, p: dict, glu: Callable) -> jax.Array:
    """Every expert on every token, weighted 0 where not chosen (plain batched matmuls, no data-dependent gathers):
    x [N, D] -> [N, D] float32. The weights multiply the hidden activations before the down projection, so the
    [N, X, D] outputs are never materialized."""
    w_gate, w_up, w_down = p["experts_gate"], p["experts_up"], p["experts_down"]
    mix = jnp.sum(jax.nn.one_hot(chosen, w_gate.shape[0], dtype=F32) * weights[..., None].astype(F32), axis=-2)
    xw = x.astype(w_gate.dtype)
    every = jnp.arange(w_gate.shape[0])
    gate = _biased(jnp.einsum("nd,xdf->nxf", xw, w_gate, preferred_element_type=F32), p, "gate", every)
    up = _biased(jnp.einsum("nd,xdf->nxf", xw, w_up, preferred_element_type=F32), p, "up", every)
    hidden = glu(gate, up) * mix[..., None]
    out = jnp.einsum("nxf,xfd->nd", hidden.astype(w_down.dtype), w_down, preferred_element_type=F32)
    down_bias = p.get("b_experts_down")
    return out if down_bias is None else out + dense(mix, down_bias.astype(F32))
