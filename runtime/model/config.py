"""Model configuration: one frozen dataclass built from a Hugging Face config.json by one function."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np


class ModelConfigError(ValueError):
    """The model directory or its config.json cannot be served."""


# architecture name in config.json -> (family, task)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "causal_lm"),
    "MistralForCausalLM": ("mistral", "causal_lm"),
    "Qwen2ForCausalLM": ("qwen2", "causal_lm"),
    "Qwen3ForCausalLM": ("qwen3", "causal_lm"),
    "LlamaForSequenceClassification": ("llama", "sequence_classification"),
    "Qwen2ForSequenceClassification": ("qwen2", "sequence_classification"),
    "Qwen3ForSequenceClassification": ("qwen3", "sequence_classification"),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str  # llama | mistral | qwen2 | qwen3
    task: str  # causal_lm | sequence_classification
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None  # llama3 parameters, as sorted items (hashable)
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, or Llama with attention_bias
    o_bias: bool  # Llama with attention_bias
    mlp_bias: bool
    qk_norm: bool  # Qwen3
    sliding_window: int | None  # Mistral
    max_position_embeddings: int
    num_labels: int = 0  # sequence classification heads
    id2label: tuple[str, ...] = ()
    pad_token_id: int | None = None
    problem_type: str | None = None  # sequence classification: "multi_label_classification" reads with sigmoid

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def logit_dim(self) -> int:
        return self.num_labels if self.task == "sequence_classification" else self.vocab_size

    def non_embedding_params(self) -> int:
        d, h, f = self.hidden_size, self.head_dim, self.intermediate_size
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        return self.num_layers * (attn + 3 * d * f)

    def flops_per_token(self, context: int = 0) -> float:
        """Forward FLOPs of one token attending to `context` keys, vocabulary projection excluded."""
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * context
        return 2.0 * self.non_embedding_params() + attention

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2] in float64, with llama3 scaling when configured."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if self.rope_scaling is None:
            return inv
        params = dict(self.rope_scaling)
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled)


def _rope(raw: dict[str, Any], arch: str) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    # transformers >= 5 writes `rope_parameters`; older config.json files have rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [key for key in keys if key not in params]
        if missing:
            raise ModelConfigError(f"{arch}: llama3 rope scaling is missing {missing}")
        return theta, tuple(sorted((key, params[key]) for key in keys))
    raise ModelConfigError(f"{arch}: rope type {rope_type!r} is not supported (supported: default, llama3)")


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict of a Hugging Face config.json; reject what we cannot run exactly."""
    architectures = raw.get("architectures") or []
    arch = architectures[0] if architectures else f"<model_type {raw.get('model_type')!r}>"
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelConfigError(f"architecture {arch} is not supported (supported: {supported})")
    family, task = ARCHITECTURES[arch]
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        theta, rope_scaling = _rope(raw, arch)
        sliding = raw.get("sliding_window") if family == "mistral" else None
        if family in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
            raise ModelConfigError(f"{arch}: use_sliding_window=true is not supported")
        if raw.get("hidden_act", raw.get("hidden_activation", "silu")) != "silu":
            raise ModelConfigError(f"{arch}: hidden_act {raw.get('hidden_act')!r} is not supported (silu only)")
        if heads % kv_heads:
            raise ModelConfigError(f"{arch}: {heads} attention heads are not a multiple of {kv_heads} KV heads")
        attention_bias = bool(raw.get("attention_bias", False))
        num_labels = 0
        id2label: tuple[str, ...] = ()
        if task == "sequence_classification":
            mapping = {int(k): str(v) for k, v in (raw.get("id2label") or {}).items()}
            num_labels = int(raw.get("num_labels") or len(mapping) or 2)
            id2label = tuple(mapping.get(i, f"LABEL_{i}") for i in range(num_labels))
        return ModelConfig(
            architecture=arch, family=family, task=task,
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias, o_bias=attention_bias and family != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=family == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            num_labels=num_labels, id2label=id2label,
            pad_token_id=raw.get("pad_token_id") if isinstance(raw.get("pad_token_id"), int) else None,
            problem_type=raw.get("problem_type") if isinstance(raw.get("problem_type"), str) else None,
        )
    except KeyError as exc:
        raise ModelConfigError(f"{arch}: config.json lacks required field {exc.args[0]!r}") from exc


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: invalid JSON: {exc}") from exc
    return config_from_hf(raw)
