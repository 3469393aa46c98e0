"""From a model setting (empty, a .gguf file, or a Hugging Face directory) to config, weights, tokenizer."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import numpy as np

from runtime.model.config import ModelConfig, ModelConfigError, load_config
from runtime.model.gguf import EMBEDDED_ID, embedded_gguf, prepared_gguf_dir
from runtime.model.weights import load_arrays

log = logging.getLogger("scorefn.runtime")

# Nothing is ever downloaded from a model hub at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclasses.dataclass
class LoadedModel:
    model_dir: Path
    model_id: str
    cfg: ModelConfig
    arrays: dict[str, np.ndarray]
    seconds: float


def default_model_id(model: str) -> str:
    if not model:
        return EMBEDDED_ID
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def resolve_model_dir(model: str, cache_dir: str | Path) -> tuple[Path, str]:
    """(Hugging Face directory, default model id) for a model setting."""
    if not model:
        return prepared_gguf_dir(embedded_gguf(), cache_dir), default_model_id(model)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelConfigError(f"{path}: no such GGUF file")
        return prepared_gguf_dir(path, cache_dir), default_model_id(model)
    if not path.is_dir():
        raise ModelConfigError(f"{path}: not a model directory")
    return path, default_model_id(model)


def load_model(model: str, cache_dir: str | Path, model_id: str = "") -> LoadedModel:
    started = time.perf_counter()
    model_dir, default_id = resolve_model_dir(model, cache_dir)
    cfg = load_config(model_dir)
    arrays = load_arrays(model_dir, cfg)
    seconds = time.perf_counter() - started
    log.info("loaded %s (%s, %d layers) in %.2f s", model_dir, cfg.architecture, cfg.num_layers, seconds)
    return LoadedModel(model_dir, model_id or default_id, cfg, arrays, seconds)


def load_tokenizer(model_dir: str | Path):
    # Imported when used: transformers takes seconds to import, which a start spends on a worker thread beside the
    # weights (runtime.assembly.startup), and the server answers /health before it.
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{model_dir}: cannot load the tokenizer: {exc}") from exc
