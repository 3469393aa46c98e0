"""Platform choices, decided in one place: dtype, layer loop, attention kernel, matmul precision, bucket layout and
the default shape buckets, for the backend JAX runs on (cpu, gpu, tpu), and whether cuDNN attention runs a model.

Each choice is a setting whose default, `auto`, means what `resolve` picks here; an explicit setting wins. Why each
default is what it is, with the measurements behind it and their dates, is in docs/how-it-works.md ("Platform
choices"); the numbers below in comments are those measurements' conclusions, not copies of the table.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import numpy as np

from runtime.model import attention
from runtime.model.config import ModelConfig
from runtime.model.transformer import Kernels
from runtime.serving.buckets import label_buckets, rounded_up
from runtime.serving.grid import GridLayout
from runtime.serving.layout import BucketLayout
from runtime.serving.packed import PackedLayout
from runtime.settings import Settings

log = logging.getLogger("scorefn.runtime")

DEFAULT_BUCKETS = {
    # backend -> (batch buckets, suffix batch buckets, max tokens of one bucket, completion batch buckets)
    "cpu": ((1, 2, 4, 8, 16, 32), (8, 32), 16384, (1, 8)),
    "accelerator": ((1, 2, 4, 8, 16, 32, 64, 128, 256), (8, 32, 128, 256, 512), 65536, (1, 16)),
}
CUDNN_MAX_HEAD_DIM = 128  # cuDNN flash attention: head sizes that are multiples of 8 up to this (the probe checks)
# CPU feature classes, best first, and the flags (as /proc/cpuinfo names them) each needs. XLA:CPU compiles for the
# features of the host it compiles on, and its loader refuses an executable that needs one the host lacks: the
# executable store keys what it holds by the class (runtime.serving.store).
CPU_CLASSES = (("amx", ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f")), ("avx512_bf16", ("avx512_bf16", "avx512f")),
               ("avx512", ("avx512f",)), ("avx2", ("avx2", "fma")))
CPUINFO = Path("/proc/cpuinfo")


@dataclasses.dataclass(frozen=True)
class HostCpu:
    """The host's CPU as the matmuls see it: its model name and feature flags."""
    model: str
    flags: frozenset[str]

    @property
    def feature_class(self) -> str:
        """The best of CPU_CLASSES whose flags the CPU has; "baseline" for none (or an unknown CPU)."""
        return next((name for name, needs in CPU_CLASSES if self.flags.issuperset(needs)), "baseline")

    def describe(self) -> str:
        shown = " ".join(sorted({flag for _, needs in CPU_CLASSES for flag in needs} & self.flags))
        return f"{self.model}, feature class {self.feature_class} ({shown or 'none of ' + CPU_CLASSES[-1][0]})"


def host_cpu(cpuinfo: str | None = None) -> HostCpu:
    """The host's CPU from /proc/cpuinfo, or from `cpuinfo` (its text: tests inject other hosts'). An unreadable file
    gives an unknown CPU of the baseline class."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())  # the first processor's
    flags = fields.get("flags") or fields.get("features") or ""  # x86 / arm
    return HostCpu(fields.get("model name") or "unknown CPU", frozenset(flags.split()))


@dataclasses.dataclass(frozen=True)
class Platform:
    backend: str  # cpu | gpu | tpu
    dtype: str  # float32 | bfloat16
    kernels: Kernels
    layout: BucketLayout  # whole sequences and items after a shared prefix: the grid or packed rows
    max_bucket_tokens: int
    completion_batch_buckets: tuple[int, ...]
    label_buckets: tuple[int, ...] = (4, 16, 64, 256, 1024)
    # Rounds dispatched and not yet fetched. An accelerator runs one while the host plans and dispatches the next;
    # on a CPU host and "device" share the cores, so one (and a drain never waits behind a second).
    rounds_in_flight: int = 1

    def describe(self) -> str:
        k = self.kernels
        return (f"{self.backend}: {self.dtype}, batch-invariant {'on' if k.batch_invariant else 'off'}, layer loop "
                f"{'unrolled' if k.unroll else 'scanned'}, attention "
                f"{k.attention} in {k.attention_dtype}, matmul precision {k.matmul_precision or 'default'}, "
                f"{self.layout.describe()}, completion batches {self.completion_batch_buckets}, labels "
                f"{self.label_buckets}, at most {self.max_bucket_tokens} tokens per bucket, {self.rounds_in_flight} "
                f"round(s) in flight")


def attention_dtype(backend: str, dtype: str, attention: str) -> str:
    """bfloat16 Q/K/V where the kernel needs them (cuDNN) or the platform is built for them (TPU); float32 else:
    on the embedded model bfloat16 attention raised the p99 log-prob error of bfloat16 weights from 0.055 to
    0.093 (41 prompts x 16 labels, CPU emulation), so XLA on a CPU or GPU keeps attention in float32."""
    return dtype if dtype != "float32" and (attention == "cudnn" or backend == "tpu") else "float32"


def current_backend() -> str:
    return _backend_name(jax.default_backend())


def backend_of(device) -> str:
    """cpu | gpu | tpu of a device, real or compile-only."""
    return _backend_name(device.platform)


def _backend_name(platform: str) -> str:
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def resolve(settings: Settings, backend: str | None = None, data: int = 1) -> Platform:
    """The platform's choices for `settings` (auto settings filled in) on a mesh whose data axis is `data` devices
    (it splits every device batch by rows: auto batch buckets are rounded up to multiples of it, explicit ones stay
    as set and runtime.serving.sharding names any that do not split); no device work, no model needed."""
    backend = backend or current_backend()
    accelerator = backend != "cpu"
    batches, suffix_batches, max_tokens, completion_batches = DEFAULT_BUCKETS["accelerator" if accelerator else "cpu"]
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if accelerator else "float32")
    loop = settings.layer_loop if settings.layer_loop != "auto" else (
        "unroll" if backend == "cpu" and dtype == "bfloat16" else "scan")
    # The batch-invariant kernels run XLA attention over the grid's rows: auto yields to an explicit cudnn or packed.
    cannot = settings.attention == "cudnn" or settings.bucket_layout == "packed"
    if settings.batch_invariant == "true" and cannot:
        raise ValueError("SCOREFN_BATCH_INVARIANT=true needs XLA attention and the grid layout (SCOREFN_ATTENTION="
                         f"{settings.attention}, SCOREFN_BUCKET_LAYOUT={settings.bucket_layout})")
    batch_invariant = settings.batch_invariant == "true" or (settings.batch_invariant == "auto" and not accelerator
                                                             and not cannot)
    attention = settings.attention if settings.attention != "auto" else (
        "cudnn" if backend == "gpu" and dtype == "bfloat16" and not batch_invariant else "xla")
    kernels = Kernels(unroll=loop == "unroll", attention=attention,
                      attention_dtype=attention_dtype(backend, dtype, attention),
                      matmul_precision="highest" if accelerator else None, batch_invariant=batch_invariant)

    def buckets(explicit: tuple[int, ...] | None, auto: tuple[int, ...]) -> tuple[int, ...]:
        return explicit or rounded_up(auto, data)
    layout_name = settings.bucket_layout if settings.bucket_layout != "auto" else (
        "packed" if accelerator and not batch_invariant else "grid")
    layout: BucketLayout
    if layout_name == "packed":  # rows no wider than the longest sequence served
        width = min(PackedLayout.width, settings.length_buckets[-1])
        layout = PackedLayout(width=width, narrow=tuple(w for w in PackedLayout.narrow if w < width)).for_data_axis(data)
    else:
        layout = GridLayout(buckets(settings.batch_buckets, batches), settings.suffix_length_buckets,
                            buckets(settings.suffix_batch_buckets, suffix_batches))
    # Accelerators: two label buckets (each is an executable per slot count); the CPU keeps its finer set.
    labels = label_buckets(settings.max_labels, (16,) if accelerator else None)
    return Platform(backend, dtype, kernels, layout, settings.max_bucket_tokens or max_tokens,
                    buckets(settings.completion_batch_buckets, completion_batches), labels,
                    rounds_in_flight=2 if accelerator else 1)


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
