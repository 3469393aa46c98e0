"""Platform choices, decided in one place from measurements: dtype, layer loop, attention kernel, matmul precision
and the default shape buckets, for the backend JAX runs on (cpu, gpu, tpu).

| choice | cpu (2-core dev machine) | gpu (H100) / tpu |
| --- | --- | --- |
| dtype | float32: bfloat16 ran 2.7x slower at batch 1 | bfloat16 weights and activations |
| layer loop | scanned; unrolled only for bfloat16 (its fast kernels need static weight slices: 1.35x) | scanned: unrolled compiled 12x slower on the GPU (56.6 s against 4.8 s) |
| attention | XLA, float32 Q/K/V | GPU: cuDNN flash attention on bfloat16 Q/K/V (float32 softmax), XLA in float32 otherwise; TPU: XLA on bfloat16 Q/K/V |
| float32 matmuls | exact already | precision "highest": the GPU default (TF32) moved log-probs by 0.028 |
| buckets | batches up to 32, suffix batches 8 and 32, completion batches 1 and 8 (2 cores saturate at batch 1) | batches up to 256, suffix batches up to 512 (W2 1,522 -> 1,836 items/s), completion batches 1, 8, 64 |
| rounds in flight | 1: host and device share the cores | 2: the next round is planned and dispatched while one runs |

Each is a setting whose default, `auto`, means this table; an explicit setting wins.
"""

from __future__ import annotations

import dataclasses
import logging

from runtime.model.config import ModelConfig
from runtime.model.transformer import Kernels
from runtime.serving.buckets import label_buckets
from runtime.serving.packing import Packing
from runtime.settings import Settings

log = logging.getLogger("scorefn.runtime")

DEFAULT_BUCKETS = {
    # backend -> (batch buckets, suffix batch buckets, max tokens of one bucket, completion batch buckets)
    "cpu": ((1, 2, 4, 8, 16, 32), (8, 32), 16384, (1, 8)),
    "accelerator": ((1, 2, 4, 8, 16, 32, 64, 128, 256), (8, 32, 128, 256, 512), 65536, (1, 16)),
}
CUDNN_MAX_HEAD_DIM = 128  # cuDNN flash attention: head sizes that are multiples of 8 up to this (the probe checks)


@dataclasses.dataclass(frozen=True)
class Platform:
    backend: str  # cpu | gpu | tpu
    dtype: str  # float32 | bfloat16
    kernels: Kernels
    batch_buckets: tuple[int, ...]
    suffix_batch_buckets: tuple[int, ...]
    max_bucket_tokens: int
    completion_batch_buckets: tuple[int, ...]
    label_buckets: tuple[int, ...] = (4, 16, 64, 256, 1024)
    packing: Packing | None = None  # sequences packed into rows (runtime.serving.packing); None: the grid
    # Rounds dispatched and not yet fetched. An accelerator runs one while the host plans and dispatches the next;
    # on a CPU host and "device" share the cores, so one (and a drain never waits behind a second).
    rounds_in_flight: int = 1

    def describe(self) -> str:
        k = self.kernels
        return (f"{self.backend}: {self.dtype}, layer loop {'unrolled' if k.unroll else 'scanned'}, attention "
                f"{k.attention} in {k.attention_dtype}, matmul precision {k.matmul_precision or 'default'}, "
                + (f"packed rows of {self.packing.width} ({self.packing.rows}), " if self.packing else
                   f"batches {self.batch_buckets}, suffix batches {self.suffix_batch_buckets}, ")
                + f"completion batches {self.completion_batch_buckets}, labels {self.label_buckets}, "
                f"at most {self.max_bucket_tokens} tokens per bucket, {self.rounds_in_flight} round(s) in flight")


def attention_dtype(backend: str, dtype: str, attention: str) -> str:
    """bfloat16 Q/K/V where the kernel needs them (cuDNN) or the platform is built for them (TPU); float32 else:
    on the embedded model bfloat16 attention raised the p99 log-prob error of bfloat16 weights from 0.055 to
    0.093 (41 prompts x 16 labels, CPU emulation), so XLA on a CPU or GPU keeps attention in float32."""
    return dtype if dtype != "float32" and (attention == "cudnn" or backend == "tpu") else "float32"


def current_backend() -> str:
    import jax

    return _backend_name(jax.default_backend())


def backend_of(device) -> str:
    """cpu | gpu | tpu of a device, real or compile-only."""
    return _backend_name(device.platform)


def _backend_name(platform: str) -> str:
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def resolve(settings: Settings, backend: str | None = None) -> Platform:
    """The platform's choices for `settings` (auto settings filled in); no device work, no model needed."""
    backend = backend or current_backend()
    accelerator = backend != "cpu"
    batches, suffix_batches, max_tokens, completion_batches = DEFAULT_BUCKETS["accelerator" if accelerator else "cpu"]
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if accelerator else "float32")
    loop = settings.layer_loop if settings.layer_loop != "auto" else (
        "unroll" if backend == "cpu" and dtype == "bfloat16" else "scan")
    attention = settings.attention if settings.attention != "auto" else (
        "cudnn" if backend == "gpu" and dtype == "bfloat16" else "xla")
    kernels = Kernels(unroll=loop == "unroll", attention=attention,
                      attention_dtype=attention_dtype(backend, dtype, attention),
                      matmul_precision="highest" if accelerator else None)
    layout = settings.bucket_layout if settings.bucket_layout != "auto" else ("packed" if accelerator else "grid")
    packing = None
    if layout == "packed":  # rows no wider than the longest sequence served
        width = min(Packing.width, settings.length_buckets[-1])
        packing = Packing(width=width, narrow=tuple(w for w in Packing.narrow if w < width))
    # Accelerators: two label buckets (each is an executable per slot count); the CPU keeps its finer set.
    labels = label_buckets(settings.max_labels, (16,) if accelerator else None)
    return Platform(backend, dtype, kernels, settings.batch_buckets or batches,
                    settings.suffix_batch_buckets or suffix_batches, settings.max_bucket_tokens or max_tokens,
                    settings.completion_batch_buckets or completion_batches, labels, packing,
                    rounds_in_flight=2 if accelerator else 1)


def fit_to_data_axis(platform: Platform, settings: Settings, data: int) -> Platform:
    """Auto batch buckets rounded up to multiples of the mesh's data axis, which splits every device batch;
    explicit ones stay as set (runtime.serving.sharding.check_batches names any that do not split)."""
    def fit(explicit: tuple[int, ...] | None, auto: tuple[int, ...]) -> tuple[int, ...]:
        return explicit or tuple(sorted({-(-b // data) * data for b in auto}))
    if data == 1:
        return platform
    return dataclasses.replace(
        platform, packing=platform.packing.fit_to_data_axis(data) if platform.packing else None,
        batch_buckets=fit(settings.batch_buckets, platform.batch_buckets),
        suffix_batch_buckets=fit(settings.suffix_batch_buckets, platform.suffix_batch_buckets),
        completion_batch_buckets=fit(settings.completion_batch_buckets, platform.completion_batch_buckets))


def fit_to_model(platform: Platform, cfg: ModelConfig, max_length: int, explicit: bool,
                 probe: bool = True) -> Platform:
    """cuDNN attention only where it runs this model: nothing `cudnn_cannot_run` names, and a start-up probe that
    agrees with XLA. `explicit`: SCOREFN_ATTENTION asked for cudnn, so a model it cannot run is an error rather
    than a fallback. `probe` False: compile-only devices cannot run the probe, so the compile assumes it passes (a
    start whose probe fails compiles with XLA)."""
    kernels = platform.kernels
    if kernels.attention != "cudnn":
        return platform
    problem = cudnn_cannot_run(cfg, kernels.attention_dtype, max_length) or (
        cudnn_probe(cfg, kernels.attention_dtype) if probe else None)
    if problem is None:
        return platform
    if explicit:
        raise ValueError(f"SCOREFN_ATTENTION=cudnn cannot run this model: {problem}")
    log.warning("attention falls back to XLA: %s", problem)
    return _with_xla_attention(platform)


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
    if cfg.sliding_window is not None and cfg.sliding_window < max_length:
        return f"a sliding window of {cfg.sliding_window} tokens needs masks that cuDNN attention does not take"
    return None


def fit_to_layout(platform: Platform, layout, explicit: bool) -> Platform:
    """cuDNN attention on a mesh needs queries, keys and values split alike (its partitioner refuses otherwise): a
    model axis that splits the query heads but not the KV heads runs XLA attention instead."""
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
    import jax
    import numpy as np

    from runtime.model import attention

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
