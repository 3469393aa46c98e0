"""The decoder layer's parts as pure functions: projections, norms, rotary embedding, gated MLP (routed experts:
runtime.model.experts).

Shapes: B batch, T tokens, D hidden, N heads, E head dim, R rotary dims (<= E), F MLP hidden.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

F32 = jnp.float32

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def dense(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x [..., I] @ w [I, O] in w's dtype, accumulated and returned in float32."""
    y = jnp.einsum("...i,io->...o", x.astype(w.dtype), w, preferred_element_type=F32)
    return y if b is None else y + b.astype(F32)


def project(x: jax.Array, p: dict, name: str) -> jax.Array:
    """x through the layer's projection `name` (wq, w_gate, ...) and its bias where it has one (bq, b_gate, ...)."""
    return dense(x, p[name], p.get("b" + name[1:]))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32. Gemma's (1 + weight) form gets its 1 added to the weight at load."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight.astype(F32)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, exact_products: bool = False) -> jax.Array:
    """Rotary embedding in the Hugging Face (rotate-half) layout; x [B, T, N, E], cos/sin [B, T, R]: the first R
    dims of each head rotate, the rest pass (partial rotary, Phi-3 / Phi-4-mini).

    `exact_products`: both products exact (in float64, which holds a product of two float32 exactly), then summed
    and rounded, so that an element's bits never depend on the shape or the fusion it is computed in (CPU only:
    accelerators have no fast float64). Otherwise XLA:CPU contracts a product and the sum into an FMA per fusion, and
    the rotation fused with different consumers moved a token's bits (the batch-invariant stream, 2026-11-26/28);
    jax.lax.optimization_barrier does not stop it (XLA:CPU drops barriers before fusing)."""
    R = cos.shape[-1]
    rot, rest = (x, None) if R == x.shape[-1] else (x[..., :R], x[..., R:])
    half = R // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    if exact_products:
        with jax.enable_x64(True):
            wide = lambda a: a.astype(jnp.float64)
            out = (wide(rot) * wide(cos) + wide(rotated) * wide(sin)).astype(rot.dtype)
    else:
        out = rot * cos + rotated * sin
    return out if rest is None else jnp.concatenate([out, rest.astype(out.dtype)], axis=-1)


def rope_tables(positions: jax.Array, inv_freq: jax.Array, scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """positions [B, T], inverse frequencies [R/2], per row [B, R/2] or per token [B, T, R/2] -> cos, sin [B, T, R]
    (times the attention scaling of yarn / longrope, as transformers multiplies them)."""
    if inv_freq.ndim == 2:
        inv_freq = inv_freq[:, None, :]
    freqs = positions.astype(F32)[..., None] * inv_freq  # [B, T, R/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, R]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return (cos, sin) if scaling == 1.0 else (cos * scaling, sin * scaling)


def gated_mlp(x: jax.Array, p: dict, activation: str, projection: Callable | None = None) -> jax.Array:
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (gelu tanh); x [B, T, D] -> [B, T, D] float32.
    `projection(x, name)`: how a projection runs (default: `project`; runtime.model.decoder_layer adds LoRA updates)."""
    run = projection or (lambda x, name: project(x, p, name))
    gate, up = run(x, "w_gate"), run(x, "w_up")
    return run(ACTIVATIONS[activation](gate) * up, "w_down")
