"""Weights: Hugging Face tensor names -> this runtime's stacked layout, one shape check per tensor.

Unknown, missing or duplicate tensors fail loudly; nothing is guessed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Iterator

import numpy as np

from runtime.model.config import ModelConfig, ModelConfigError


class WeightsError(ValueError):
    """The checkpoint's tensors do not match its config."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # name in runtime.model.transformer.Llama's `arrays`
    layer: int | None  # index along the stacked layer axis, None for unstacked tensors
    hf_shape: tuple[int, ...]  # shape as stored in the checkpoint
    transpose: bool  # torch Linear [out, in] -> [in, out]


# Tensors that checkpoints may carry but the model derives itself.
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def weight_map(cfg: ModelConfig) -> dict[str, Target]:
    """Every tensor the checkpoint must contain, by Hugging Face name."""
    D, F, E = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * E, cfg.num_kv_heads * E
    targets = {
        "model.embed_tokens.weight": Target("embed", None, (cfg.vocab_size, D), False),
        "model.norm.weight": Target("final_norm", None, (D,), False),
    }
    if cfg.task == "sequence_classification":
        targets["score.weight"] = Target("score_head", None, (cfg.num_labels, D), False)
    elif not cfg.tie_word_embeddings:
        targets["lm_head.weight"] = Target("lm_head", None, (cfg.vocab_size, D), False)
    per_layer = {
        "input_layernorm.weight": ("attn_norm", (D,), False),
        "post_attention_layernorm.weight": ("mlp_norm", (D,), False),
        "self_attn.q_proj.weight": ("wq", (q_out, D), True),
        "self_attn.k_proj.weight": ("wk", (kv_out, D), True),
        "self_attn.v_proj.weight": ("wv", (kv_out, D), True),
        "self_attn.o_proj.weight": ("wo", (D, q_out), True),
        "mlp.gate_proj.weight": ("w_gate", (F, D), True),
        "mlp.up_proj.weight": ("w_up", (F, D), True),
        "mlp.down_proj.weight": ("w_down", (D, F), True),
    }
    if cfg.qkv_bias:
        per_layer |= {"self_attn.q_proj.bias": ("bq", (q_out,), False),
                      "self_attn.k_proj.bias": ("bk", (kv_out,), False),
                      "self_attn.v_proj.bias": ("bv", (kv_out,), False)}
    if cfg.o_bias:
        per_layer["self_attn.o_proj.bias"] = ("bo", (D,), False)
    if cfg.mlp_bias:
        per_layer |= {"mlp.gate_proj.bias": ("b_gate", (F,), False), "mlp.up_proj.bias": ("b_up", (F,), False),
                      "mlp.down_proj.bias": ("b_down", (D,), False)}
    if cfg.qk_norm:
        per_layer |= {"self_attn.q_norm.weight": ("q_norm", (E,), False),
                      "self_attn.k_norm.weight": ("k_norm", (E,), False)}
    for i in range(cfg.num_layers):
        for suffix, (name, shape, transpose) in per_layer.items():
            targets[f"model.layers.{i}.{suffix}"] = Target(f"layers.{name}", i, shape, transpose)
    return targets


def array_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every array's shape in the model's layout, from the config alone: compiling needs no weights."""
    shapes: dict[str, tuple[int, ...]] = {}
    for target in weight_map(cfg).values():
        shape = target.hf_shape[::-1] if target.transpose else target.hf_shape
        shapes[target.name] = shape if target.layer is None else (cfg.num_layers, *shape)
    return shapes


def _is_expected_extra(name: str, cfg: ModelConfig) -> bool:
    # Tied checkpoints sometimes store the (identical) lm_head too.
    return bool(IGNORED.search(name)) or (name == "lm_head.weight" and cfg.tie_word_embeddings)


def assemble(cfg: ModelConfig, tensors: Iterator[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Checkpoint tensors (HF names, any order) -> float32 arrays in the model's stacked layout."""
    targets = weight_map(cfg)
    arrays: dict[str, np.ndarray] = {}
    seen: set[str] = set()
    unknown: list[str] = []
    for name, value in tensors:
        if name in seen:
            raise WeightsError(f"tensor {name} appears more than once in the checkpoint")
        seen.add(name)
        target = targets.get(name)
        if target is None:
            if not _is_expected_extra(name, cfg):
                unknown.append(name)
            continue
        if tuple(value.shape) != target.hf_shape:
            raise WeightsError(f"tensor {name} has shape {tuple(value.shape)}, config implies {target.hf_shape}")
        value = np.asarray(value, dtype=np.float32)
        value = value.T if target.transpose else value
        if target.layer is None:
            arrays[target.name] = value
        else:
            stack = arrays.get(target.name)
            if stack is None:
                stack = arrays[target.name] = np.empty((cfg.num_layers, *value.shape), np.float32)
            stack[target.layer] = value
    if unknown:
        shown = ", ".join(sorted(unknown)[:5]) + (" ..." if len(unknown) > 5 else "")
        raise WeightsError(f"{len(unknown)} unknown tensor(s) for {cfg.architecture}: {shown}")
    missing = sorted(set(targets) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise WeightsError(f"{len(missing)} tensor(s) missing from the checkpoint: {shown}")
    return arrays


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [shard for shard in shards if not (model_dir / shard).is_file()]
        if missing:
            raise WeightsError(f"{model_dir}: shards listed in the index are missing: {missing}")
        return [model_dir / shard for shard in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{model_dir}: no *.safetensors weights found")
    return files


def _strip_prefix(name: str, cfg: ModelConfig) -> str:
    # Some sequence-classification exports store the body without the `model.` prefix.
    if cfg.task == "sequence_classification" and not name.startswith(("model.", "score.")):
        return "model." + name
    return name


def read_safetensors(model_dir: Path, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open  # the "flax" framework reads bfloat16, which NumPy cannot

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="flax") as handle:
            for name in handle.keys():
                yield _strip_prefix(name, cfg), np.asarray(handle.get_tensor(name), dtype=np.float32)


def load_arrays(model_dir: str | Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelConfigError(f"{model_dir}: not a directory")
    return assemble(cfg, read_safetensors(model_dir, cfg))
