"""Routed experts (runtime.model.experts): the routed layout computes what every expert on every token computes, a
token's result has the same bits whatever tokens share its experts and tiles (gpt-oss's biased experts, its router
and clamped SwiGLU too), and it computes fewer rows than the dense path from a few dozen tokens up. The families'
parity with transformers and the whole model's invariance: test_parity_tiny.py and test_invariance.py (Qwen3-MoE,
gpt-oss)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.model import experts, invariant

X, D, F, K = 8, 64, 96, 2  # the tiny test configs' width (64 x 96: their matmuls keep one bit class from 63 rows)
TILE = invariant.MIN_ROWS


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def block(request) -> dict:
    """The experts of a layer: Qwen3-MoE's, or gpt-oss's (biases, its router, its clamped SwiGLU)."""
    rng = np.random.default_rng(0)
    w = lambda *shape: jnp.asarray(rng.normal(0, 0.1, shape), jnp.float32)
    p = {"router": w(D, X), "experts_gate": w(X, D, F), "experts_up": w(X, D, F), "experts_down": w(X, F, D)}
    if request.param == "gpt_oss":
        p |= {"router_bias": w(X), "b_experts_gate": w(X, F), "b_experts_up": w(X, F), "b_experts_down": w(X, D)}
    return p


def route(x, p):
    if "router_bias" in p:  # gpt-oss: the softmax of the top-k logits
        return experts.router_top_k(x, p["router"], K, False, p["router_bias"], top_k_first=True)
    return experts.router_top_k(x, p["router"], K, True)


def glu(p):
    return experts.gated("clamped_swiglu", 1.702, 0.5) if "router_bias" in p else experts.gated("silu")


def tokens(n: int, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(0, 1, (n, D)), jnp.float32)


@jax.jit
def routed(x, p):
    """As the batch-invariant stream runs it: the router over fixed tiles of tokens (runtime.model.decoder_layer)."""
    weights, chosen = (a[0] for a in invariant.tokenwise(lambda t: route(t, p), x[None]))
    return experts.mixture(x, weights, chosen, p, glu(p), TILE)


@jax.jit
def dense(x, p):
    weights, chosen = route(x, p)
    return experts.all_experts(x, weights, chosen, p, glu(p))


@pytest.mark.parametrize("n", [1, 5, 70, 300])
def test_the_routed_layout_computes_what_every_expert_on_every_token_does(block, n):
    x = tokens(n, n)
    np.testing.assert_allclose(np.asarray(routed(x, block)), np.asarray(dense(x, block)), rtol=1e-5, atol=1e-5)


def test_a_tokens_bits_do_not_depend_on_the_tokens_beside_it(block):
    """The same 7 tokens alone, after 200 others, and in a batch whose other tokens route elsewhere: other tiles,
    other places in their experts' tiles, other numbers of tiles."""
    mine = tokens(7, 1)
    alone = np.asarray(routed(mine, block))
    for others in (tokens(200, 2), tokens(33, 3) * 5.0, tokens(500, 4)):
        for batch, at in ((jnp.concatenate([others, mine]), len(others)), (jnp.concatenate([mine, others]), 0)):
            assert np.array_equal(np.asarray(routed(batch, block))[at:at + 7], alone)


def test_gpt_oss_routes_by_the_softmax_of_its_top_k_logits_and_clamps_its_swiglu():
    """transformers' GptOssTopKRouter and GptOssExperts._apply_gate, written out in NumPy."""
    x = np.array([[1.0, -2.0]], np.float32)
    router, bias = np.array([[1.0, 0.0, 2.0], [0.0, -1.0, 0.5]], np.float32), np.array([0.1, 0.2, -3.0], np.float32)
    weights, chosen = experts.router_top_k(jnp.asarray(x), jnp.asarray(router), 2, False, jnp.asarray(bias), True)
    logits = x @ router + bias  # [1.1, 2.2, -4.0]
    assert chosen.tolist() == [[1, 0]]
    top = np.exp(logits[0, [1, 0]] - logits[0, 1])
    np.testing.assert_allclose(np.asarray(weights)[0], top / top.sum(), rtol=1e-6)
    gate, up = np.array([-9.0, 0.3, 9.0], np.float32), np.array([-9.0, 0.3, 9.0], np.float32)
    clamped_gate, clamped_up = np.array([-9.0, 0.3, 7.0]), np.array([-7.0, 0.3, 7.0])
    expected = clamped_gate / (1 + np.exp(-1.702 * clamped_gate)) * (clamped_up + 1)
    np.testing.assert_allclose(np.asarray(experts.gated("clamped_swiglu", 1.702, 7.0)(gate, up)), expected,
                               rtol=1e-6)


def test_the_routed_layout_computes_fewer_rows_from_a_few_dozen_tokens():
    """Qwen3-30B-A3B's 128 experts, 8 a token: every expert on 1,024 tokens is 131,072 rows, routed 8,192 pairs in
    128 tiles and at most one part-filled tile per expert, 8x fewer; one token is cheaper dense."""
    assert experts.routed_rows(1024, 128, 8, 64) == 64 * (128 + 128) == 1024 * 128 // 8
    assert experts.routed_rows(1, 128, 8, 64) > 128
    assert experts.tile_count(3, 128, 8, 64) == 24  # never more tiles than pairs
