"""Platform choices, decided in one place: dtype, layer loop, attention kernel, matmul precision, bucket layout and
the default shape buckets, for the backend JAX runs on (cpu, gpu, tpu); whether an attention kernel runs a model is
runtime.assembly.attention_fit's.

Each choice is a setting whose default, `auto`, means what `resolve` picks here; an explicit setting wins. Why each
default is what it is, with the measurements behind it and their dates, is in docs/how-it-works.md ("Platform
choices"); the numbers below in comments are those measurements' conclusions, not copies of the table.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from pathlib import Path

import jax
import numpy as np

from runtime.model import invariant
from runtime.model.experts import TILES_PER_STEP
from runtime.model.kernels import Kernels
from runtime.assembly import bitclasses
from runtime.requests import launch
from runtime.shapes.buckets import label_buckets, rounded_up
from runtime.shapes.grid import GridLayout
from runtime.shapes.layout import BucketLayout
from runtime.shapes.packed import PackedLayout
from runtime.settings import Settings

log = logging.getLogger("scorefn.runtime")

DEFAULT_BUCKETS = {  # backend -> (batch buckets, suffix batch buckets, max tokens of one bucket, completion batches)
    # CPU suffix batches 4, 16 (not 8, 32), and 1: a request's one text after a cached prompt (the prefix cache's W7)
    # computes its own row, not four. docs/how-it-works/platform.md's table has the measurements.
    "cpu": ((1, 2, 4, 8, 16, 32), (1, 4, 16), 16384, (1, 8)),
    "accelerator": ((1, 2, 4, 8, 16, 32, 64, 128, 256), (8, 32, 128, 256, 512), 65536, (1, 16)),
}
# Accelerators' batch-invariant kernels run the token stream in chunks of this many tokens (one GEMM shape per matmul,
# whatever the batch: XLA:GPU's GEMM for a row moved with the number of rows, five bit classes for 1..512 rows on an
# H100); a single item pays a chunk.
ACCELERATOR_STREAM_CHUNK = 512
# A CPU's expert tiles without batch invariance: fewer rows pad less (docs/how-it-works/platform.md, SCOREFN_EXPERTS).
CPU_EXPERT_TILE = 16
# CPU feature classes, best first: the flags (as /proc/cpuinfo names them) each needs, and the instruction set XLA:CPU
# is capped at (XLA_FLAGS=--xla_cpu_max_isa) to compile executables that run on any host of the class. XLA:CPU
# compiles for the features of the host it compiles on and its loader does not refuse an executable that needs one
# the host lacks (it logs, and the executable may then stop on an illegal instruction): the executable store keys
# what it holds by the class it was compiled for (runtime.assembly.store), and a start picks a set its host runs.
CPU_CLASSES = (("amx", ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f"), "AMX"),
               ("avx512_bf16", ("avx512_bf16", "avx512f"), "AVX512_BF16"),
               ("avx512", ("avx512f",), "AVX512"),
               ("avx2", ("avx2", "fma"), "AVX2"),
               ("baseline", (), "AVX"))  # what jaxlib itself needs: no executable set goes lower
CPU_CLASS_NAMES = tuple(name for name, _, _ in CPU_CLASSES)
# The number format of each CPU class (SCOREFN_DTYPE auto): a fixed table, so the same image on the same class always
# computes in the same format (a matmul timed at every start flipped it on an AMD EPYC Zen 4 in 1 of 3 idle starts).
# The figures come from `scorefn platform --probe` (matmul_probe: 2048x576 @ 576x1536, the embedded model's MLP, in
# float32 and in bfloat16 with float32 accumulation) and `scorefn bench` on 2-core hosts of the class.
CPU_FORMATS = {
    "amx": ("bfloat16", "AMX multiplies bfloat16 tiles with float32 accumulation: 1,234 GFLOP/s against 295 in "
                        "float32 (Intel Xeon, 2026-11-24)"),
    "avx512_bf16": ("bfloat16", "AVX512-BF16 multiplies bfloat16 pairs with float32 accumulation: 318-373 GFLOP/s "
                                "against 165-193 in float32, the embedded model 1.5-1.6x as fast end to end (AMD EPYC "
                                "Zen 4, 2026-11-26)"),
    "avx512": ("float32", "no bfloat16 matrix instructions: bfloat16 would be emulated (2.7x slower at batch 1, AMD "
                          "EPYC, 2026-11-23)"),
    "avx2": ("float32", "no bfloat16 matrix instructions: bfloat16 would be emulated (2.7x slower at batch 1, AMD "
                        "EPYC, 2026-11-23)"),
    "baseline": ("float32", "no bfloat16 matrix instructions known"),
}
# Classes whose matrix instructions multiply bfloat16 (with float32 accumulation): elsewhere bfloat16 is emulated.
BF16_MATMUL_CLASSES = tuple(name for name, (dtype, _) in CPU_FORMATS.items() if dtype == "bfloat16")
CPUINFO = Path("/proc/cpuinfo")
MAX_ISA = re.compile(r"--xla_cpu_max_isa=(\w+)")  # in XLA_FLAGS: the instruction set XLA:CPU compiles up to


@dataclasses.dataclass(frozen=True)
class HostCpu:
    """The host's CPU as the matmuls see it: its model name and feature flags."""
    model: str
    flags: frozenset[str]

    @property
    def feature_class(self) -> str:
        """The best of CPU_CLASSES whose flags the CPU has ("baseline" for none, or an unknown CPU)."""
        return next(name for name, needs, _ in CPU_CLASSES if self.flags.issuperset(needs))

    def runs(self, feature_class: str) -> bool:
        """Whether executables compiled for `feature_class` run here (it is this CPU's class or a lower one)."""
        return CPU_CLASS_NAMES.index(feature_class) >= CPU_CLASS_NAMES.index(self.feature_class)

    def describe(self) -> str:
        shown = " ".join(sorted({flag for _, needs, _ in CPU_CLASSES for flag in needs} & self.flags))
        return f"{self.model}, feature class {self.feature_class} ({shown or 'none of ' + CPU_CLASSES[-2][0]})"


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


def compile_class(host: HostCpu | None = None, xla_flags: str | None = None) -> str:
    """The CPU feature class this process compiles for: the host's, or a lower one where XLA_FLAGS caps the
    instruction set (--xla_cpu_max_isa, as `scorefn warmup --cpu-class` sets it)."""
    host = host or host_cpu()
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    capped = MAX_ISA.search(flags)
    isa = capped.group(1).upper() if capped else None
    cap = next((name for name, _, name_isa in CPU_CLASSES if name_isa == isa), "baseline" if isa else None)
    if cap is None or not host.runs(cap):
        return host.feature_class
    return cap


def max_isa_flag(feature_class: str) -> str:
    """The XLA flag that compiles executables for `feature_class` on a host of a higher one."""
    return f"--xla_cpu_max_isa={dict((name, isa) for name, _, isa in CPU_CLASSES)[feature_class]}"


@dataclasses.dataclass(frozen=True)
class CpuFormat:
    """The number format a CPU computes in (SCOREFN_DTYPE auto) for the feature class its executables are compiled
    for, and why: one line for the start's log, `scorefn bench` and /metrics."""
    feature_class: str
    dtype: str  # float32 | bfloat16
    reason: str

    def describe(self) -> str:
        return f"CPU class {self.feature_class}: {self.reason}"


def matmul_probe(rows: int = 2048, width: int = 576, inner: int = 1536, repeats: int = 15) -> dict[str, float]:
    """GFLOP/s of one model-shaped matmul ([rows, width] @ [width, inner]) in float32 and in bfloat16 with float32
    accumulation, as the model computes them; the median of `repeats` runs each. A tool (`scorefn platform --probe`,
    `scorefn bench`): what CPU_FORMATS was decided from, never a decision at start (timings are noisy)."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((rows, width), np.float32), rng.standard_normal((width, inner), np.float32)
    figures = {}
    for dtype in ("float32", "bfloat16"):
        wd = jax.numpy.asarray(w, dtype)
        run = jax.jit(lambda a, b: jax.numpy.einsum("ti,io->to", a.astype(b.dtype), b,
                                                    preferred_element_type=np.float32))
        run(x, wd).block_until_ready()
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            run(x, wd).block_until_ready()
            seconds.append(time.perf_counter() - started)
        figures[dtype] = 2 * rows * width * inner / sorted(seconds)[repeats // 2] / 1e9
    return figures


def cpu_format(feature_class: str, dtype: str = "auto", formats: dict[str, tuple[str, str]] = CPU_FORMATS
               ) -> CpuFormat:
    """The class's format from `formats` (CPU_FORMATS; tests inject others); `dtype` (SCOREFN_DTYPE) when not auto."""
    if dtype != "auto":
        return CpuFormat(feature_class, dtype, "SCOREFN_DTYPE")
    return CpuFormat(feature_class, *formats[feature_class])


def host_cpu_format(dtype: str = "auto") -> CpuFormat:
    """This process's CpuFormat: the one of the class it compiles for."""
    return cpu_format(compile_class(), dtype=dtype)


def classes_below(feature_class: str) -> tuple[str, ...]:
    """The feature classes whose executables run wherever `feature_class`'s do, best first: a start whose own set
    is not stored takes the first of them the executable store holds whole (runtime.assembly.compose)."""
    return CPU_CLASS_NAMES[CPU_CLASS_NAMES.index(feature_class) + 1:]


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
    cpu: CpuFormat | None = None  # a CPU backend: the feature class compiled for, and why this dtype
    concurrent_batches: int = 1  # device batches run at once (runtime.requests.launch; 1: accelerators, meshes)

    def info(self) -> dict[str, str]:
        """The choices a dashboard or client groups by (/metrics scorefn_platform_info)."""
        cpu = {"cpu_model": host_cpu().model, "cpu_class": self.cpu.feature_class, "dtype_reason": self.cpu.reason
               } if self.cpu else {}
        return {"backend": self.backend, "dtype": self.dtype,
                "batch_invariant": str(self.kernels.batch_invariant).lower(), **cpu}

    def describe(self) -> str:
        k = self.kernels
        why = f" ({self.cpu.describe()})" if self.cpu else ""
        invariant = f"on (matmuls of at least {k.min_rows} rows)" if k.batch_invariant else "off"
        return (f"{self.backend}: {self.dtype}{why}, batch-invariant {invariant}, layer loop "
                f"{'unrolled' if k.unroll else 'scanned'}, attention {k.attention} in {k.attention_dtype}, matmul "
                f"precision {k.matmul_precision or 'default'}, {self.layout.describe()}, completion batches "
                f"{self.completion_batch_buckets}, labels {self.label_buckets}, at most {self.max_bucket_tokens} tokens"
                f" a bucket, {self.rounds_in_flight} round(s) in flight, {self.concurrent_batches} batch(es) at once")


def attention_dtype(backend: str, dtype: str, attention: str) -> str:
    """Q/K/V in the model's format (float32 softmax and accumulation), except XLA attention on a GPU: float32 there,
    the exact choice beside cuDNN (which needs bfloat16). On a CPU bfloat16 attention stays within the exactness rule
    (its error against transformers float32 no larger than transformers bfloat16's): embedded model, 41 prompts x
    16 labels, three sets, AMD EPYC Zen 4, 2026-11-26: mean 0.016, p99 0.058-0.068, max 0.068-0.157 (float32
    attention 0.012-0.014 / 0.050-0.056 / 0.060-0.117; transformers bfloat16 0.053-0.056 / 0.22-0.24 / 0.44), and
    its matmuls run at the bfloat16 speed, with the bfloat16 rows' bit classes (runtime.assembly.bitclasses)."""
    return "float32" if dtype == "float32" or (backend == "gpu" and attention == "xla") else dtype


def current_backend() -> str:
    return _backend_name(jax.default_backend())


def backend_of(device) -> str:
    """cpu | gpu | tpu of a device, real or compile-only."""
    return _backend_name(device.platform)


def _backend_name(platform: str) -> str:
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def resolve(settings: Settings, backend: str | None = None, data: int = 1, cpu: CpuFormat | None = None) -> Platform:
    """The platform's choices for `settings` (auto settings filled in) on a mesh whose data axis is `data` devices
    (it splits every device batch by rows: auto batch buckets are rounded up to multiples of it, explicit ones stay
    as set and runtime.assembly.sharding names any that do not split); no device work, no model needed. `cpu`: on a
    CPU backend, the format decided for the class compiled for (default: this process's, host_cpu_format)."""
    backend = backend or current_backend()
    accelerator = backend != "cpu"
    batches, suffix_batches, max_tokens, completion_batches = DEFAULT_BUCKETS["accelerator" if accelerator else "cpu"]
    if not accelerator:
        if cpu is None:
            cpu = host_cpu_format(settings.dtype)
        elif settings.dtype != "auto":
            cpu = cpu_format(cpu.feature_class, dtype=settings.dtype)
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if accelerator else cpu.dtype)
    # Scanned everywhere: unrolled, the embedded model's default CPU buckets compiled in ~15 min instead of ~2 on 2
    # cores, for 67 against 76 ms on one item (and 526 against 459 on 32; bfloat16, Intel Xeon AMX, 2026-11-26).
    loop = settings.layer_loop if settings.layer_loop != "auto" else "scan"
    # The batch-invariant kernels run XLA attention over the grid's rows: auto yields to an explicit cudnn or packed.
    cannot = settings.attention == "cudnn" or settings.bucket_layout == "packed"
    if settings.batch_invariant == "true" and cannot:
        raise ValueError("SCOREFN_BATCH_INVARIANT=true needs XLA attention and the grid layout (SCOREFN_ATTENTION="
                         f"{settings.attention}, SCOREFN_BUCKET_LAYOUT={settings.bucket_layout})")
    batch_invariant = settings.batch_invariant == "true" or (settings.batch_invariant == "auto" and not accelerator
                                                             and not cannot)
    if settings.attention == "pallas" and not batch_invariant:
        raise ValueError("SCOREFN_ATTENTION=pallas is the batch-invariant kernels' attention: it needs "
                         "SCOREFN_BATCH_INVARIANT true (or auto on a CPU)")
    # Batch-invariant: on an accelerator Pallas kernels over fixed key blocks (Mosaic's on a TPU), on a CPU XLA's.
    attention = settings.attention if settings.attention != "auto" else (
        "pallas" if accelerator and batch_invariant else
        "cudnn" if backend == "gpu" and dtype == "bfloat16" and not batch_invariant else "xla")
    attention = "pallas_tpu" if attention == "pallas" and backend == "tpu" else attention
    kernels = Kernels(unroll=loop == "unroll", experts=settings.experts, attention=attention,
                      attention_dtype=attention_dtype(backend, dtype, attention),
                      matmul_precision="highest" if accelerator else None, batch_invariant=batch_invariant,
                      weight_bits=not accelerator,
                      stream_chunk=ACCELERATOR_STREAM_CHUNK if accelerator and batch_invariant else 0)

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
                    rounds_in_flight=2 if accelerator else 1, cpu=None if accelerator else cpu,
                    concurrent_batches=1 if accelerator else launch.cpu_threads())


def fit_to_matmuls(platform: Platform, shapes: dict[str, tuple[int, ...]], head_dim: int, portable: bool,
                   record: Path | None) -> Platform:
    """A CPU's batch-invariant kernels sized by its matmuls' bit classes (runtime.assembly.bitclasses, measured once
    and kept in `record`) when compiling for the host's own class: their smallest matmuls get as many rows as the
    host's own keep one set of bits from, and the label head's tiles every count of rows that gives a row the bits
    of a tile of TILE, and routed experts' tiles the fewest rows that keep a row's bits wherever it sits among them.
    Otherwise (`portable`: a set compiled for another CPU, `scorefn warmup --cpu-class`, or such a set a start
    takes) runtime.model.invariant's MIN_ROWS and TILE, which every host measured so far keeps. Without batch
    invariance, expert tiles of CPU_EXPERT_TILE rows."""
    kernels = platform.kernels
    if platform.backend != "cpu":
        return platform
    experts = tuple(sorted({(*shape[-2:], platform.dtype) for name, shape in shapes.items()
                            if name.startswith("layers.experts_")}))
    if not kernels.batch_invariant:  # the bits need not hold: the fewest rows that are still a real matmul
        return dataclasses.replace(platform, kernels=dataclasses.replace(kernels, expert_tile=CPU_EXPERT_TILE)
                                   ) if experts else platform
    host = host_cpu().feature_class  # its matmul kernels are picked by its features at run time
    tile = invariant.MIN_ROWS
    if portable or (platform.cpu is not None and platform.cpu.feature_class != host):
        rows, head = invariant.MIN_ROWS, (invariant.TILE, invariant.TILE)
    else:
        if experts:
            tile = bitclasses.tile_rows(experts, host, TILES_PER_STEP, record)
        rows = bitclasses.floor(invariant.matmul_shapes(shapes, platform.dtype, kernels.attention_dtype, head_dim),
                                host, record)
        vocab, hidden = shapes["embed"]
        # a tile's hidden states are the columns of the head's weight @ hidden.T (runtime.model.heads)
        head = bitclasses.span(((hidden, vocab, "float32"),), host, invariant.TILE, invariant.HEAD_TILES, record,
                               columns=True)
    return dataclasses.replace(platform, kernels=dataclasses.replace(kernels, min_rows=rows, head_rows=head,
                                                                      expert_tile=tile))
