"""Weights: Hugging Face tensor names -> this runtime's stacked layout, one shape check per tensor.

Unknown, missing or duplicate tensors fail loudly; nothing is guessed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
from safetensors import safe_open

from runtime.model.config import ModelConfig, ModelConfigError
from runtime.model.errors import WeightsError  # raised here and by runtime.model.gguf; imported from here
from runtime.model.gguf import GGUF_WEIGHTS, read_gguf_weights


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # name in runtime.model.transformer.Transformer's `arrays`
    layer: int | None  # index along the stacked layer axis, None for unstacked tensors
    hf_shape: tuple[int, ...]  # shape as stored in the checkpoint
    transpose: bool  # torch Linear [out, in] -> [in, out]
    expert: int | None = None  # index along the stacked expert axis (Qwen3-MoE)
    offset: float = 0.0  # added once at load: Gemma's norms compute x * (1 + weight), the same float32 sum
    split: tuple[tuple[str, int], ...] = ()  # a fused tensor (Phi-3 qkv_proj, gate_up_proj): (name, rows) in order


# Tensors that checkpoints may carry but the model derives itself.
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _norm_names(cfg: ModelConfig) -> dict[str, str]:
    """Hugging Face layer-norm names -> this runtime's: what `post_attention_layernorm` is depends on the family
    (Llama: the norm before the MLP; Gemma 2/3 and OLMo 2: the norm of the attention output)."""
    if cfg.pre_norms and not cfg.post_norms:
        return {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
    names = {"post_attention_layernorm": "attn_post_norm", "post_feedforward_layernorm": "mlp_post_norm"}
    if cfg.pre_norms:
        names |= {"input_layernorm": "attn_norm", "pre_feedforward_layernorm": "mlp_norm"}
    return names


class _Layer(NamedTuple):
    name: str
    hf_shape: tuple[int, ...]
    transpose: bool
    split: tuple[tuple[str, int], ...] = ()
    expert: int | None = None


def _layer_tensors(cfg: ModelConfig) -> dict[str, _Layer]:
    """Per-layer suffix -> where that tensor of each layer goes."""
    D, F, E = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * E, cfg.num_kv_heads * E
    per_layer = {f"{hf}.weight": _Layer(name, (D,), False) for hf, name in _norm_names(cfg).items()}
    if cfg.family == "phi3":  # fused projections, split at load into the names every other family uses
        per_layer["self_attn.qkv_proj.weight"] = _Layer("wq", (q_out + 2 * kv_out, D), True,
                                                        (("wq", q_out), ("wk", kv_out), ("wv", kv_out)))
        per_layer["mlp.gate_up_proj.weight"] = _Layer("w_gate", (2 * F, D), True, (("w_gate", F), ("w_up", F)))
    else:
        per_layer |= {"self_attn.q_proj.weight": _Layer("wq", (q_out, D), True),
                      "self_attn.k_proj.weight": _Layer("wk", (kv_out, D), True),
                      "self_attn.v_proj.weight": _Layer("wv", (kv_out, D), True)}
        if not cfg.num_experts:
            per_layer |= {"mlp.gate_proj.weight": _Layer("w_gate", (F, D), True),
                          "mlp.up_proj.weight": _Layer("w_up", (F, D), True)}
    per_layer["self_attn.o_proj.weight"] = _Layer("wo", (D, q_out), True)
    if cfg.num_experts:
        X, Fm = cfg.num_experts, cfg.moe_intermediate_size
        per_layer["mlp.gate.weight"] = _Layer("router", (X, D), True)
        for e in range(X):
            per_layer |= {f"mlp.experts.{e}.gate_proj.weight": _Layer("experts_gate", (Fm, D), True, (), e),
                          f"mlp.experts.{e}.up_proj.weight": _Layer("experts_up", (Fm, D), True, (), e),
                          f"mlp.experts.{e}.down_proj.weight": _Layer("experts_down", (D, Fm), True, (), e)}
    else:
        per_layer["mlp.down_proj.weight"] = _Layer("w_down", (D, F), True)
    if cfg.qkv_bias:
        per_layer |= {"self_attn.q_proj.bias": _Layer("bq", (q_out,), False),
                      "self_attn.k_proj.bias": _Layer("bk", (kv_out,), False),
                      "self_attn.v_proj.bias": _Layer("bv", (kv_out,), False)}
    if cfg.o_bias:
        per_layer["self_attn.o_proj.bias"] = _Layer("bo", (D,), False)
    if cfg.mlp_bias:
        per_layer |= {"mlp.gate_proj.bias": _Layer("b_gate", (F,), False),
                      "mlp.up_proj.bias": _Layer("b_up", (F,), False),
                      "mlp.down_proj.bias": _Layer("b_down", (D,), False)}
    if cfg.qk_norm:
        q_size, kv_size = (E, E) if cfg.qk_norm == "head" else (q_out, kv_out)
        per_layer |= {"self_attn.q_norm.weight": _Layer("q_norm", (q_size,), False),
                      "self_attn.k_norm.weight": _Layer("k_norm", (kv_size,), False)}
    return per_layer


def weight_map(cfg: ModelConfig) -> dict[str, Target]:
    """Every tensor the checkpoint must contain, by Hugging Face name."""
    D = cfg.hidden_size
    targets = {
        "model.embed_tokens.weight": Target("embed", None, (cfg.vocab_size, D), False),
        "model.norm.weight": Target("final_norm", None, (D,), False, offset=cfg.norm_offset),
    }
    if cfg.task == "sequence_classification":
        targets["score.weight"] = Target("score_head", None, (cfg.num_labels, D), False)
    elif not cfg.tie_word_embeddings:
        targets["lm_head.weight"] = Target("lm_head", None, (cfg.vocab_size, D), False)
    for i in range(cfg.num_layers):
        for suffix, t in _layer_tensors(cfg).items():
            offset = cfg.norm_offset if t.name.endswith("norm") else 0.0
            targets[f"model.layers.{i}.{suffix}"] = Target(f"layers.{t.name}", i, t.hf_shape, t.transpose, t.expert,
                                                           offset, tuple((f"layers.{n}", r) for n, r in t.split))
    return targets


def array_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every array's shape in the model's layout, from the config alone (compiling needs no weights): fused
    tensors as their parts, experts stacked after layers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for target in weight_map(cfg).values():
        out, *rest = target.hf_shape
        for name, rows in target.split or ((target.name, out),):
            shape = tuple(reversed((rows, *rest))) if target.transpose else (rows, *rest)
            lead = () if target.layer is None else (cfg.num_layers,) if target.expert is None else \
                (cfg.num_layers, cfg.num_experts)
            shapes[name] = (*lead, *shape)
    return shapes


def _is_expected_extra(name: str, cfg: ModelConfig) -> bool:
    # Tied checkpoints sometimes store the (identical) lm_head too.
    return bool(IGNORED.search(name)) or (name == "lm_head.weight" and cfg.tie_word_embeddings)


def _place(arrays: dict[str, np.ndarray], cfg: ModelConfig, name: str, target: Target, value: np.ndarray) -> None:
    value = value.T if target.transpose else value
    if target.layer is None:
        arrays[name] = value
        return
    lead = (cfg.num_layers,) if target.expert is None else (cfg.num_layers, cfg.num_experts)
    stack = arrays.get(name)
    if stack is None:
        stack = arrays[name] = np.empty((*lead, *value.shape), np.float32)
    stack[target.layer if target.expert is None else (target.layer, target.expert)] = value


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
        if target.offset:
            value = value + np.float32(target.offset)
        if not target.split:
            _place(arrays, cfg, target.name, target, value)
            continue
        start = 0
        for part, rows in target.split:  # rows of the fused [out, in] tensor, in order
            _place(arrays, cfg, part, target, value[start: start + rows])
            start += rows
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
    """Every tensor, through safetensors' "flax" framework: it reads bfloat16, which NumPy cannot."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="flax") as handle:
            for name in handle.keys():
                yield _strip_prefix(name, cfg), np.asarray(handle.get_tensor(name), dtype=np.float32)


def load_arrays(model_dir: str | Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelConfigError(f"{model_dir}: not a directory")
    if (model_dir / GGUF_WEIGHTS).is_file():  # a directory prepared from a GGUF file (runtime.model.gguf)
        return assemble(cfg, read_gguf_weights(model_dir))
    return assemble(cfg, read_safetensors(model_dir, cfg))
