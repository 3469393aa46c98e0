"""A GGUF file's prepared directory: tokenizer and tensor table only; the weights are dequantized from the GGUF.

That the dequantized weights are right is shown by the embedded model's parity with transformers
(tests/runtime/model/test_parity_embedded.py), which loads them this way.
"""

from __future__ import annotations

import json
import shutil

import pytest

from runtime.model.config import load_config
from runtime.model.gguf import GGUF_WEIGHTS
from runtime.model.weights import WeightsError, load_arrays


def test_the_prepared_directory_holds_no_float32_copy(embedded_dir):
    assert (embedded_dir / GGUF_WEIGHTS).is_file() and (embedded_dir / "tokenizer.json").is_file()
    assert not list(embedded_dir.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in embedded_dir.iterdir()) < 10_000_000  # the float32 weights: 540 MB


def test_a_changed_gguf_file_fails_loudly(embedded_dir, tmp_path):
    prepared = tmp_path / "prepared"
    shutil.copytree(embedded_dir, prepared)
    table = json.loads((prepared / GGUF_WEIGHTS).read_text())
    table["size"] += 1  # as if the file had been replaced by another of a different size
    (prepared / GGUF_WEIGHTS).write_text(json.dumps(table))
    with pytest.raises(WeightsError, match="missing or changed; delete the directory"):
        load_arrays(prepared, load_config(prepared))
