"""LoRA adapters in Hugging Face PEFT's format, stacked so that one device batch mixes rows of several adapters and
of the base model (the Punica / S-LoRA approach).

An adapter is a directory with `adapter_config.json` and `adapter_model.safetensors` (what PEFT's `save_pretrained`
writes). Each targeted projection W [I, O] of a layer gets x @ W + scale * (x @ A) @ B, A [I, r] and B [r, O] from
PEFT's lora_A [r, I] and lora_B [O, r]; scale = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA.

Stacked: every attention and MLP projection of the model (those runtime.model.params declares LoRA can target,
whatever the adapters target: the shapes, and so the compiled programs, depend only on the slots and the rank) gets
`lora_a_<name>` [Layers, I, S * R] and `lora_b_<name>` [Layers, S * R, O] (the scale folded into B), slot s in
columns s * R .. s * R + r, zeros past an adapter's rank and where it targets nothing. `lora_columns` [S * R] says
which adapter (1..S) each column belongs to; a token of adapter a keeps the columns of a (0: the base model keeps
none), so its update is ((x @ A_all) * mask) @ B_all: two matmuls a projection for the whole batch, exact zeros from
every other slot.

A sequence-classification adapter (PEFT's SEQ_CLS task: `modules_to_save` its `score` head, trained on the causal
LM's layers) brings its own head [labels, D]: `lora_heads` [S, MAX_HEAD_LABELS, D] holds each slot's (zeros past
its labels, and for adapters without one), read at a row's last token as a *ForSequenceClassification model reads
its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from runtime.model.config import ModelConfig
from runtime.model import params

# PEFT's module names -> the runtime's (a fused module of Phi-3 -> its parts, split along the output)
MODULES = {"q_proj": ("wq",), "k_proj": ("wk",), "v_proj": ("wv",), "o_proj": ("wo",), "gate_proj": ("w_gate",),
           "up_proj": ("w_up",), "down_proj": ("w_down",), "qkv_proj": ("wq", "wk", "wv"),
           "gate_up_proj": ("w_gate", "w_up")}
TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
HEADS = ("score", "classifier")  # the heads PEFT's SEQ_CLS task saves (modules_to_save)
HEAD = re.compile(rf"^base_model\.model\.({'|'.join(HEADS)})\.weight$")
MAX_HEAD_LABELS = 16  # labels of a classification adapter's head (the stacked heads' fixed shape)
# PEFT options that change the arithmetic in ways not served: a start refuses an adapter that sets one.
UNSERVED = ("use_dora", "lora_bias", "layer_replication", "trainable_token_indices", "target_parameters",
            "rank_pattern", "alpha_pattern")
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the adapter, and the module or setting at fault."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    rank: int
    # (layer, runtime name) -> (A [I, r], B [r, O] times the scale), float32
    updates: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    head: np.ndarray | None = None  # a classification adapter's own head [labels, D], float32

    @property
    def labels(self) -> tuple[str, ...]:
        """A classification adapter's label names (PEFT saves none: LABEL_0, LABEL_1, ... as transformers names
        them by default); () for an adapter without a head."""
        return () if self.head is None else tuple(f"LABEL_{i}" for i in range(self.head.shape[0]))


def parse_adapters(spec: str) -> list[tuple[str, Path]]:
    """SCOREFN_LORA_ADAPTERS: `name=path,...` -> [(name, path)]; empty: none."""
    out: list[tuple[str, Path]] = []
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, path = entry.partition("=")
        name = name.strip()
        if not sep or not name or not path.strip():
            raise AdapterError(f"SCOREFN_LORA_ADAPTERS: '{entry}' is not name=path")
        if name in (n for n, _ in out):
            raise AdapterError(f"SCOREFN_LORA_ADAPTERS: adapter '{name}' is given twice")
        out.append((name, Path(path.strip())))
    return out


def _same_base(declared: str | None, model_id: str) -> bool:
    """PEFT's base_model_name_or_path against the served model's id: equal, or the same last path component (a
    hub id against a local copy of it); an adapter that names none is taken at its shapes' word."""
    if not declared:
        return True
    return declared == model_id or Path(declared.rstrip("/")).name == Path(model_id.rstrip("/")).name


def load_adapter(name: str, path: Path, shapes: dict[str, tuple[int, int]], num_layers: int, model_id: str,
                 max_rank: int) -> Adapter:
    """One PEFT LoRA adapter, checked against the served model: `shapes` maps each projection the model has
    (runtime names) to its [I, O]."""
    where = f"LoRA adapter '{name}' ({path})"
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise AdapterError(f"{where}: needs {CONFIG} and {WEIGHTS} (PEFT's save_pretrained), a local directory")
    config = json.loads((path / CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not served, only LORA")
    for key, allowed in (("bias", "none"), ("fan_in_fan_out", False)):
        if config.get(key, allowed) not in (allowed, None):
            raise AdapterError(f"{where}: {key}={config[key]!r} is not served (only {allowed!r})")
    for key in UNSERVED:
        if config.get(key):
            raise AdapterError(f"{where}: {key}={config[key]!r} is not served")
    own = set(config.get("modules_to_save") or ())
    if not own <= set(HEADS):
        raise AdapterError(f"{where}: modules_to_save {sorted(own - set(HEADS))} is not served (only a "
                           f"sequence-classification head: {list(HEADS)})")
    if not _same_base(config.get("base_model_name_or_path"), model_id):
        raise AdapterError(f"{where}: trained on '{config['base_model_name_or_path']}', not on the served model "
                           f"'{model_id}'")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if not 0 < rank <= max_rank:
        raise AdapterError(f"{where}: rank {rank} is above SCOREFN_MAX_LORA_RANK={max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    head = None
    with safe_open(str(path / WEIGHTS), framework="numpy") as f:
        for key in f.keys():
            if HEAD.match(key):
                head = _head(f.get_tensor(key), shapes["wq"][0], where)
                continue
            match = TENSOR.match(key)
            if not match:
                raise AdapterError(f"{where}: tensor '{key}' is not a LoRA update of a decoder layer's projection")
            layer, module, half = int(match[1]), match[2], match[3]
            if module not in MODULES or not all(part in shapes for part in MODULES[module]):
                served = sorted(m for m, parts in MODULES.items() if all(p in shapes for p in parts))
                raise AdapterError(f"{where}: module '{module}' cannot take LoRA on this model (served: {served})")
            if layer >= num_layers:
                raise AdapterError(f"{where}: '{key}' is for layer {layer}; the model has {num_layers}")
            halves.setdefault((layer, module), {})[half] = f.get_tensor(key).astype(np.float32)
    updates: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: layer {layer} {module} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]  # [r, I], [O, r]
        parts = MODULES[module]
        inputs, outputs = shapes[parts[0]][0], sum(shapes[p][1] for p in parts)
        if a.shape != (rank, inputs) or b.shape != (outputs, rank):
            raise AdapterError(f"{where}: layer {layer} {module} has lora_A {list(a.shape)} and lora_B "
                               f"{list(b.shape)}; the served model needs [{rank}, {inputs}] and [{outputs}, {rank}]")
        start = 0
        for part in parts:  # a fused module: the parts share A and split B's outputs
            width = shapes[part][1]
            updates[(layer, part)] = (a.T, b[start:start + width].T * np.float32(scale))
            start += width
    if not updates:
        raise AdapterError(f"{where}: holds no LoRA weights")
    return Adapter(name, path, rank, updates, head)


def _head(weight: np.ndarray, hidden: int, where: str) -> np.ndarray:
    """A classification adapter's head [labels, D], checked."""
    if weight.ndim != 2 or weight.shape[1] != hidden:
        raise AdapterError(f"{where}: its classification head is {list(weight.shape)}; the served model needs "
                           f"[labels, {hidden}]")
    if not 0 < weight.shape[0] <= MAX_HEAD_LABELS:
        raise AdapterError(f"{where}: its classification head has {weight.shape[0]} labels; at most "
                           f"{MAX_HEAD_LABELS} are served")
    return weight.astype(np.float32)


def slots(spec: str, max_loras: int) -> int:
    """Adapter slots compiled into the programs (SCOREFN_MAX_LORAS, or as many as SCOREFN_LORA_ADAPTERS names);
    0: no LoRA at all (the programs' `adapters` argument is ignored)."""
    return max_loras or len(parse_adapters(spec))


def load_adapters(spec: str, max_loras: int, max_rank: int, cfg: ModelConfig, model_id: str) -> list[Adapter]:
    """Every adapter SCOREFN_LORA_ADAPTERS names, checked against the served model's projections."""
    named = parse_adapters(spec)
    if max_loras and len(named) > max_loras:
        raise AdapterError(f"SCOREFN_LORA_ADAPTERS names {len(named)} adapters, more than SCOREFN_MAX_LORAS="
                           f"{max_loras}")
    if named and model_id in (name for name, _ in named):
        raise AdapterError(f"LoRA adapter '{model_id}' has the served model's own name")
    shapes = projection_shapes(cfg)
    return [load_adapter(name, path, shapes, cfg.num_layers, model_id, max_rank) for name, path in named]


def declare(cfg: ModelConfig, slots: int, rank: int) -> dict[str, params.ParamInfo]:
    """The declarations of `stacked`'s arrays (runtime.model.params), by name; none without slots. Never split over
    a mesh: every device holds every slot's updates (slots x rank columns, small beside the weights)."""
    if not slots:
        return {}
    L, columns = cfg.num_layers, slots * rank
    infos = [params.ParamInfo("lora_columns", (columns,), (None,), "int32", None),
             params.ParamInfo("lora_heads", (slots, MAX_HEAD_LABELS, cfg.hidden_size), (None,) * 3, "float32", None)]
    for name, (inputs, outputs) in projection_shapes(cfg).items():  # A and B in the model's dtype, as its weights
        for half, shape in (("a", (inputs, columns)), ("b", (columns, outputs))):
            infos.append(params.ParamInfo(f"layers.lora_{half}_{name}", (L, *shape), (params.LAYERS, None, None), None,
                                          None))
    return {info.name: info for info in infos}


def stacked_size(arrays: dict) -> tuple[int, int]:
    """(slots, rank) of the stacked LoRA arrays among a model's `arrays` (or their shapes' stand-ins); (0, 0) when
    it has none."""
    if "lora_heads" not in arrays:
        return 0, 0
    slots = arrays["lora_heads"].shape[0]
    return slots, arrays["lora_columns"].shape[0] // slots


def stacked(adapters: list[Adapter], cfg: ModelConfig, slots: int, rank: int) -> dict[str, np.ndarray]:
    """The model's LoRA arrays (see the module's docstring) for these adapters in slots 1..len(adapters)."""
    if len(adapters) > slots:
        raise AdapterError(f"{len(adapters)} LoRA adapters exceed SCOREFN_MAX_LORAS={slots}")
    arrays = {name: np.zeros(info.shape, np.float32) for name, info in declare(cfg, slots, rank).items()}
    arrays["lora_columns"] = np.repeat(np.arange(1, slots + 1, dtype=np.int32), rank)
    for s, adapter in enumerate(adapters):
        if adapter.head is not None:
            arrays["lora_heads"][s, :adapter.head.shape[0]] = adapter.head
        for (layer, name), (a, b) in adapter.updates.items():
            arrays[f"layers.lora_a_{name}"][layer, :, s * rank: s * rank + a.shape[1]] = a
            arrays[f"layers.lora_b_{name}"][layer, s * rank: s * rank + b.shape[0], :] = b
    return arrays


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection of the model LoRA can target (runtime.model.params) -> its [I, O]."""
    return {info.name.removeprefix("layers."): info.shape[1:] for info in params.declare(cfg).values() if info.lora}
