"""Weights: Hugging Face tensor names -> this runtime's stacked layout, one shape check per tensor, both from the
parameters' declarations (runtime.model.params).

Unknown, missing or duplicate tensors fail loudly; nothing is guessed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path
from typing import Iterator

import numpy as np
from safetensors import safe_open

from runtime.model.config import ModelConfig, ModelConfigError
from runtime.model.errors import WeightsError  # raised here and by runtime.model.gguf; imported from here
from runtime.model.gguf import GGUF_WEIGHTS, read_gguf_weights
from runtime.model import mxfp4
from runtime.model.params import declare


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # name in runtime.model.transformer.Transformer's `arrays`
    layer: int | None  # index along the stacked layer axis, None for unstacked tensors
    hf_shape: tuple[int, ...]  # shape as stored in the checkpoint
    transpose: bool  # torch Linear [out, in] -> [in, out]
    expert: int | None = None  # index along the stacked expert axis (Qwen3-MoE)
    offset: float = 0.0  # added once at load: Gemma's norms compute x * (1 + weight), the same float32 sum
    split: tuple[tuple[str, int], ...] = ()  # a fused tensor (Phi-3 qkv_proj, gate_up_proj): (name, rows) in order
    interleaved: bool = False  # its parts alternate along the last axis (gpt-oss gate_up_proj), not rows in order


# Tensors that checkpoints may carry but the model derives itself.
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def weight_map(cfg: ModelConfig) -> dict[str, Target]:
    """Every tensor the checkpoint must contain, by Hugging Face name: each parameter's slices (runtime.model.params:
    a layer's, an expert's), the parts of a fused tensor gathered under its name."""
    targets: dict[str, Target] = {}
    for info in declare(cfg).values():
        source = info.checkpoint
        lead = 1 if source.every_expert else info.slice_axes
        shape = info.shape[lead:]
        hf_shape = tuple(reversed(shape)) if source.transpose else shape
        layers = range(cfg.num_layers) if lead else (None,)
        experts = range(cfg.num_experts) if lead == 2 else (None,)
        for layer, expert in itertools.product(layers, experts):
            tensor = source.tensor.format(layer=layer, expert=expert)
            fused = targets.get(tensor)
            if fused is None:
                targets[tensor] = Target(info.name, layer, hf_shape, source.transpose, expert, source.offset,
                                         interleaved=source.interleaved)
                continue
            # a part of a fused tensor after the first: its rows follow theirs (or its columns alternate with theirs)
            axis = -1 if source.interleaved else 0
            parts = fused.split or ((fused.name, fused.hf_shape[axis]),)
            whole = list(fused.hf_shape)
            whole[axis] += hf_shape[axis]
            targets[tensor] = dataclasses.replace(fused, hf_shape=tuple(whole),
                                                  split=(*parts, (info.name, hf_shape[axis])))
    return targets


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


def _parts(value: np.ndarray, target: Target) -> list[np.ndarray]:
    """A fused tensor's parts: every n-th column from the i-th (interleaved), else its rows in order."""
    if target.interleaved:
        n = len(target.split)
        return [value[..., i::n] for i in range(n)]
    ends = np.cumsum([rows for _, rows in target.split])
    return np.split(value, ends[:-1])


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
        for part, value_part in zip((name for name, _ in target.split), _parts(value, target)):
            _place(arrays, cfg, part, target, value_part)
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
    """Every tensor, through safetensors' "flax" framework: it reads bfloat16, which NumPy cannot. Floats as float32,
    integers (MXFP4's packed blocks and scales) as they are."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="flax") as handle:
            for name in handle.keys():
                value = np.asarray(handle.get_tensor(name))
                yield _strip_prefix(name, cfg), value if value.dtype.kind in "iu" else value.astype(np.float32)


def load_arrays(model_dir: str | Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelConfigError(f"{model_dir}: not a directory")
    if (model_dir / GGUF_WEIGHTS).is_file():  # a directory prepared from a GGUF file (runtime.model.gguf)
        return assemble(cfg, read_gguf_weights(model_dir))
    tensors = read_safetensors(model_dir, cfg)
    return assemble(cfg, mxfp4.dequantized(tensors) if cfg.quantization == "mxfp4" else tensors)
