"""Every setting in one table: name, default, help. Read from the environment as SCOREFN_<NAME>.

Pure Python (no JAX, no Litestar) so that both the handler and the runtime can import it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable


def _csv_ints(text: str) -> tuple[int, ...]:
    values = tuple(sorted({int(part) for part in text.replace(" ", "").split(",") if part}))
    if not values or values[0] <= 0:
        raise ValueError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def _auto(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`auto` (None: runtime.assembly.platform decides per backend) or a value parsed by `parse`."""
    return lambda text: None if text.strip().lower() == "auto" else parse(text)


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return value
    return parse


def _csv_strs(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {text!r}")
    return level


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a number above 0, got {text!r}")
    return value


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {text!r}")


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    default: str
    parse: Callable[[str], Any]
    help: str

    @property
    def env(self) -> str:
        return "PORT" if self.name == "port" else f"SCOREFN_{self.name.upper()}"


def default_cache_dir() -> str:
    """User-level, as uv's and pip's: $XDG_CACHE_HOME/scorefn, else ~/.cache/scorefn."""
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scorefn")


SETTINGS: tuple[Setting, ...] = (
    Setting("model", "", str,
            "Model to serve: a Hugging Face directory or a .gguf file. Empty: the embedded SmolLM2-135M-Instruct."),
    Setting("model_id", "", str,
            "Name the API reports and accepts in `model`. Empty: derived from the model (e.g. SmolLM2-135M-Instruct)."),
    Setting("cache_dir", default_cache_dir(), str,
            "Where the converted embedded model and the XLA compilation cache live."),
    Setting("compile_cache_dir", "", str,
            "JAX persistent compilation cache directory. Empty: <cache_dir>/xla."),
    Setting("dtype", "auto", _choice("auto", "float32", "bfloat16"),
            "Weights and activations: float32 or bfloat16 (matmuls always accumulate in float32; float32 is float32 "
            "on every platform, no TF32). auto: bfloat16 on GPU and TPU; on a CPU fixed by its feature class "
            "(the same on every start): bfloat16 with AMX or AVX512-BF16, float32 elsewhere (GET /v1/models says "
            "which). float32 when scores must match transformers "
            "float32 to 1e-6."),
    Setting("attention", "auto", _choice("auto", "xla", "cudnn", "pallas"),
            "Attention kernel: xla or cudnn (jax.nn.dot_product_attention's), or pallas (the batch-invariant "
            "kernels' on a GPU or TPU: Pallas kernels over fixed key blocks, Triton's or Mosaic's). auto: pallas on "
            "a GPU or TPU with SCOREFN_BATCH_INVARIANT; cudnn (flash attention) on a GPU with bfloat16 when a "
            "start-up probe runs it; else xla."),
    Setting("layer_loop", "auto", _choice("auto", "scan", "unroll"),
            "Run the layers as one scanned body or unrolled (compiles several times slower). auto: scan."),
    Setting("experts", "auto", _choice("auto", "routed", "all"),
            "Mixture-of-experts models: routed (each token's top-k experts only, in fixed tiles of tokens per "
            "expert) or all (every expert on every token, the unchosen weighted 0). auto: routed with batch "
            "invariance (its bits hold either way; routed computes its active FLOPs), else per compiled shape "
            "whichever computes fewer rows."),
    # 24: a short classification prompt (a 15-token query and an item of ~8) padded to 32 paid a third more tokens
    # than it has: one such item 59.7 -> 46.8 ms, 256 of them 2.48 -> 2.16 s (AMD EPYC Zen 4, 2026-11-28), for 8 more
    # programs.
    Setting("length_buckets", "24,32,64,128,256,512,1024,2048", _csv_ints,
            "Padded sequence lengths compiled at start-up; the largest is the longest accepted sequence."),
    Setting("batch_buckets", "auto", _auto(_csv_ints),
            "Padded batch sizes compiled at start-up; larger batches are split. "
            "auto: 1,2,4,8,16,32 on CPU; 1,2,4,...,256 on GPU and TPU."),
    Setting("max_bucket_tokens", "auto", _auto(int),
            "Skip buckets (full or shared-prefix suffix) with more tokens than this; such batches are split "
            "instead. auto: 16384 on CPU, 65536 on GPU and TPU."),
    Setting("context_buckets", "32,128,512,1024,2048", _csv_ints,
            "Shared-prefix lengths compiled for shared-prefix scoring (each at most the largest length bucket)."),
    Setting("suffix_length_buckets", "8,12,16,24,32,48,64,128", _csv_ints,
            "Item lengths (tokens after a shared prefix) compiled for shared-prefix scoring."),
    Setting("suffix_batch_buckets", "auto", _auto(_csv_ints),
            "Batch sizes compiled for shared-prefix scoring; larger requests run several such batches. "
            "auto: 4,16 on CPU; 8,32,128,256,512 on GPU and TPU."),
    Setting("completion_batch_buckets", "auto", _auto(_csv_ints),
            "Batch sizes compiled for per-position log-probabilities (/v1/completions). "
            "auto: 1,8 on CPU; 1,16 on GPU and TPU (a larger batch runs as several of 16)."),
    Setting("bucket_layout", "auto", _choice("auto", "grid", "packed"),
            "grid: one executable per (batch, length) and per (context, batch, item length); packed: several "
            "sequences per row, buckets by row count (a fraction of the grid's executables). auto: grid on CPU, "
            "packed on GPU and TPU."),
    Setting("batch_invariant", "auto", _choice("auto", "true", "false"),
            "Scores whose bits depend only on the model, its dtype and the item's own tokens and labels: never on "
            "the other items or requests batched with it, its row, bucket, or a shared prefix (the grid layout; XLA "
            "attention on a CPU, a Pallas kernel on a GPU, its token stream in fixed chunks on an accelerator; XLA's "
            "deterministic mode and no autotuning on a GPU). auto: true on CPU, false on GPU and TPU."),
    Setting("ready", "auto", _choice("auto", "all", "first"),
            "When /ready turns 200. all: once every bucket is compiled or loaded from the executable store. first: "
            "once the first requests' buckets are (the smallest of each program, and those the start's timing "
            "runs); the others are then compiled after ready, smallest first, and stored: a request that needs one "
            "waits for its compile, which is done next, and never compiles itself. auto: first on a start that "
            "finds none of its buckets stored (a first start on a CPU compiles for minutes), all otherwise."),
    Setting("prefix_sharing", "true", _bool,
            "Compute a request's longest common token prefix once and score items against its keys/values."),
    Setting("prefix_cache_bytes", "auto", _auto(int),
            "Bytes of prefixes' keys and values kept across requests (the prefix cache: a prompt that requests "
            "repeat is computed once; least recently used evicted). 0: no cache, and none of its programs compiled. auto: an eighth of the host's "
            "available memory at start-up on a CPU, at most 4 GiB; a quarter of the device's free memory on a GPU "
            "or TPU."),
    Setting("batch_wait_ms", "2", float,
            "How long the device thread waits to coalesce concurrent requests into one device batch."),
    Setting("max_items", "1024", int, "Most items in one /v1/score request (400 too_many_items beyond)."),
    Setting("max_labels", "1024", int, "Most labels (label_token_ids or labels) in one request."),
    Setting("max_label_tokens", "8", int,
            "Most tokens of one label (a label of several tokens is scored as the sum of its tokens' "
            "log-probabilities; every forward pass reads this many last positions when a row holds such a label)."),
    Setting("max_total_tokens", "262144", int, "Most tokens summed over all sequences of one request."),
    Setting("max_body_bytes", "4194304", int, "Largest request body in bytes (413 request_too_large beyond)."),
    Setting("max_queue", "256", int,
            "Most requests waiting for the device, a hard cap beside SCOREFN_MAX_WAIT_S; beyond it 429 "
            "rate_limit_exceeded."),
    Setting("max_wait_s", "auto", _auto(_positive_float),
            "Admission: a small request (its own device work within half of this) is refused (429 "
            "rate_limit_exceeded, Retry-After) when it would not be answered within this many seconds; under "
            "overload the instance keeps at most 4x this of work queued. A device round holds a quarter of it, at "
            "most SCOREFN_MAX_ROUND_S. auto: 4 rounds (SCOREFN_MAX_ROUND_S's), at least 2."),
    Setting("max_round_s", "auto", _auto(_positive_float),
            "The most predicted device seconds one round holds: a new small request waits for the round in flight, "
            "so longer rounds delay its answer, and shorter ones split large requests into more slices and pay "
            "more device batches. auto: the start's price of 5 device batches, within 0.3 to 1. `scorefn batch` in "
            "process sets 4 (nobody waits on its rounds)."),
    Setting("request_timeout_s", "30", float,
            "A request still queued after this many seconds is dropped with 503 (its work is not computed)."),
    Setting("api_keys", "", _csv_strs,
            "Comma-separated API keys; when set, /v1/*, /v2/* and /rerank require `Authorization: Bearer <key>`."),
    Setting("drain_grace_s", "10", float, "On SIGTERM, how long in-flight requests may take to finish."),
    Setting("classifiers", "", str,
            "TOML file declaring prompt-verbalizer classifiers. Empty: the built-in sentiment classifier."),
    Setting("rerankers", "", str,
            "TOML file declaring /v1/rerank rerankers. Empty: the built-in relevance reranker (a one-label "
            "sequence-classification model: the model itself)."),
    Setting("lora_adapters", "", str,
            "LoRA adapters to serve beside the base model, as name=path,... (each a local directory in PEFT's "
            "format: adapter_config.json and adapter_model.safetensors). A request selects one with \"model\": "
            "\"<name>\"; one device batch mixes adapters and the base."),
    Setting("max_loras", "0", int,
            "Adapter slots compiled into every program. 0: as many as SCOREFN_LORA_ADAPTERS names. Set it (and "
            "SCOREFN_MAX_LORA_RANK) to keep the stored executables when the adapters change."),
    Setting("max_lora_rank", "16", int,
            "Highest LoRA rank served: every adapter is padded to it (the compiled shapes); a higher one fails the "
            "start."),
    Setting("mesh", "", str,
            "Device mesh as DATAxMODEL (e.g. 1x4). Empty: all local devices on the data axis. auto batch "
            "buckets round up to multiples of DATA; explicit ones must be multiples."),
    Setting("log_level", "INFO", _log_level,
            "Log level of the server and the CLI; DEBUG also shows the probes and scrapes (/health, /ready, /metrics)."),
    Setting("log_requests_debug", "false", _bool,
            "Log each request body (its first 4 KiB, at INFO) before handling it (debugging only)."),
    Setting("host", "0.0.0.0", str, "Address `scorefn serve` binds."),
    Setting("port", "8080", int, "Port `scorefn serve` binds (env PORT, as on Cloud Run)."),
)

SETTINGS_BY_NAME = {setting.name: setting for setting in SETTINGS}


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str
    model_id: str
    cache_dir: str
    compile_cache_dir: str
    dtype: str  # auto | float32 | bfloat16 (runtime.assembly.platform resolves auto)
    attention: str  # auto | xla | cudnn | pallas
    layer_loop: str  # auto | scan | unroll
    experts: str  # auto | routed | all
    length_buckets: tuple[int, ...]
    batch_buckets: tuple[int, ...] | None  # None: auto
    max_bucket_tokens: int | None
    context_buckets: tuple[int, ...]
    suffix_length_buckets: tuple[int, ...]
    suffix_batch_buckets: tuple[int, ...] | None
    completion_batch_buckets: tuple[int, ...] | None
    bucket_layout: str  # auto | grid | packed
    batch_invariant: str  # auto | true | false
    ready: str  # auto | all | first
    prefix_sharing: bool
    prefix_cache_bytes: int | None  # None: auto (runtime.assembly.compose.prefix_cache)
    batch_wait_ms: float
    max_items: int
    max_labels: int
    max_label_tokens: int
    max_total_tokens: int
    max_body_bytes: int
    max_queue: int
    max_wait_s: float | None  # None: auto (runtime.requests.round_builder.admission_limits)
    max_round_s: float | None
    request_timeout_s: float
    api_keys: tuple[str, ...]
    drain_grace_s: float
    classifiers: str
    rerankers: str
    lora_adapters: str
    max_loras: int
    max_lora_rank: int
    mesh: str
    log_level: str
    log_requests_debug: bool
    host: str
    port: int

    @property
    def xla_cache_dir(self) -> str:
        return self.compile_cache_dir or str(Path(self.cache_dir) / "xla")

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)


def load_settings(environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
    """Settings from the environment (SCOREFN_*, PORT), then keyword overrides (already parsed)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        raw = environ.get(setting.env, setting.default)
        try:
            values[setting.name] = setting.parse(raw)
        except ValueError as exc:
            raise ValueError(f"setting {setting.env}={raw!r} is invalid: {exc}") from exc
    values.update(overrides)
    return Settings(**values)
