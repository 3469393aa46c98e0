"""Whether the attention kernel the platform picked (runtime.assembly.platform.resolve) runs this model on this mesh,
else XLA's attention: cuDNN cannot soft-cap scores, mask sliding windows or take attention sinks, and a start-up
probe must agree with XLA; the Pallas kernels (batch-invariant attention on accelerators) cannot take sinks. An
explicit SCOREFN_ATTENTION naming a kernel that cannot run the model fails the start, saying why; auto falls back
with a warning.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from runtime.assembly.platform import Platform, attention_dtype
from runtime.model import attention
from runtime.model.config import ModelConfig

log = logging.getLogger("scorefn.runtime")

CUDNN_MAX_HEAD_DIM = 128  # cuDNN flash attention: head sizes that are multiples of 8 up to this (the probe checks)
PALLAS = ("pallas", "pallas_tpu")


def fit_to_model(platform: Platform, cfg: ModelConfig, max_length: int, explicit: bool,
                 probe: bool = True) -> Platform:
    """cuDNN attention only where it runs this model: nothing `cudnn_cannot_run` names, and a start-up probe that
    agrees with XLA; the Pallas kernels only where `pallas_cannot_run` names nothing. `explicit`: SCOREFN_ATTENTION
    asked for the kernel picked, so a model it cannot run is an error rather than a fallback. `probe` False:
    compile-only devices cannot run the probe, so the compile assumes it passes (a start whose probe fails compiles
    with XLA)."""
    kernels = platform.kernels
    if kernels.attention in PALLAS:
        problem = pallas_cannot_run(cfg)
    elif kernels.attention == "cudnn":
        problem = cudnn_cannot_run(cfg, kernels.attention_dtype, max_length) or (
            cudnn_probe(cfg, kernels.attention_dtype) if probe else None)
    else:
        return platform
    if problem is None:
        return platform
    if explicit:
        named = "pallas" if kernels.attention in PALLAS else kernels.attention
        raise ValueError(f"SCOREFN_ATTENTION={named} cannot run this model: {problem}")
    log.warning("attention falls back to XLA: %s", problem)
    return _with_xla_attention(platform)


def pallas_cannot_run(cfg: ModelConfig) -> str | None:
    """Why the Pallas kernels cannot run this model's attention; None when nothing rules them out."""
    if cfg.attention_sinks:
        return (f"{cfg.architecture} has attention sinks (a learned logit per head in each softmax), which the "
                f"Pallas attention kernels do not take; XLA runs its attention (batch invariance on an accelerator "
                f"then rests on XLA's kernels)")
    return None


def cudnn_cannot_run(cfg: ModelConfig, dtype: str, max_length: int) -> str | None:
    """Why cuDNN attention cannot run this model at these lengths, from the config alone (no device needed, so a
    deviceless GPU compile can ask too); None when nothing rules it out."""
    if dtype not in ("bfloat16", "float16"):
        return f"cuDNN attention needs bfloat16 or float16, not {dtype}"
    if cfg.head_dim % 8 or cfg.head_dim > CUDNN_MAX_HEAD_DIM:
        return (f"cuDNN attention runs head sizes that are multiples of 8 up to {CUDNN_MAX_HEAD_DIM}, "
                f"this model's is {cfg.head_dim}")
    if cfg.attention_softcap is not None:
        return (f"{cfg.architecture} soft-caps its attention scores (tanh, cap {cfg.attention_softcap:g}), which "
                f"cuDNN attention cannot compute; XLA runs its attention")
    if cfg.attention_sinks:
        return (f"{cfg.architecture} has attention sinks (a learned logit per head in each softmax), which cuDNN "
                f"attention cannot take; XLA runs its attention")
    if cfg.sliding_window is not None and cfg.sliding_window < max_length:
        return f"a sliding window of {cfg.sliding_window} tokens needs masks that cuDNN attention does not take"
    return None


def fit_to_layout(platform: Platform, layout, explicit: bool) -> Platform:
    """A mesh runs one device batch at a time (its collectives wait for every device); cuDNN attention on a mesh
    needs Q, K and V split alike (its partitioner refuses otherwise), else it runs XLA's."""
    if layout is not None and platform.concurrent_batches > 1:
        platform = dataclasses.replace(platform, concurrent_batches=1)
    if platform.kernels.attention != "cudnn" or layout is None or not layout.parts["attention"] or layout.parts["kv"]:
        return platform
    problem = (f"the mesh splits the query heads over {layout.model} devices but not the KV heads, and cuDNN "
               f"attention needs both split alike")
    if explicit:
        raise ValueError(f"SCOREFN_ATTENTION=cudnn cannot run this model on this mesh: {problem}")
    log.warning("attention falls back to XLA: %s", problem)
    return _with_xla_attention(platform)


def _with_xla_attention(platform: Platform) -> Platform:
    kernels = dataclasses.replace(platform.kernels, attention="xla",
                                  attention_dtype=attention_dtype(platform.backend, platform.dtype, "xla"))
    return dataclasses.replace(platform, kernels=kernels)


def cudnn_probe(cfg: ModelConfig, dtype: str) -> str | None:
    """Run both attention calls the model makes through cuDNN and XLA on small random inputs of this model's
    head layout; None when cuDNN runs them and agrees, else what went wrong."""
    rng = np.random.default_rng(0)
    B, T, C, N, K, E = 2, 8, 16, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def normal(*shape):
        return jax.numpy.asarray(rng.standard_normal(shape), dtype)

    q, k, v, ctx_k, ctx_v = normal(B, T, N, E), normal(B, T, K, E), normal(B, T, K, E), normal(C, K, E), normal(C, K, E)
    ctx_len = np.int32(11)
    positions = ctx_len + np.broadcast_to(np.arange(T), (B, T))

    def both(implementation):
        return [np.asarray(out, np.float32) for out in jax.jit(lambda: (
            attention.causal(q, k, v, None, implementation),
            attention.after_context(q, k, v, ctx_k, ctx_v, ctx_len, positions, None, implementation)))()]
    try:
        cudnn = both("cudnn")
    except Exception as exc:  # cuDNN missing, too old, or this layout unsupported: XLA still runs it
        return f"cuDNN attention did not run ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    xla = both("xla")
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(cudnn, xla))
    if worst > 0.05:  # bfloat16 inputs, outputs of magnitude ~1
        return f"cuDNN and XLA attention disagree by {worst:.3g} on the start-up probe"
    return None
