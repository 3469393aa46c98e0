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


def test_the_embedded_models_block_types_dequantize_bit_for_bit_as_gguf_does(embedded_dir):
    """scorefn's whole-tensor Q4_1 and Q8_0 dequantization against the `gguf` package's, on every such tensor of the
    embedded model's file and on random blocks (every nibble and int8 value, scales of every exponent, signs)."""
    import gguf
    import numpy as np

    from runtime.model.gguf import WHOLE_TENSOR

    table = json.loads((embedded_dir / GGUF_WEIGHTS).read_text())
    data = np.memmap(table["gguf"], dtype=np.uint8, mode="r")
    rng = np.random.default_rng(0)
    for kind, block_bytes, scale_bytes in (("Q4_1", 20, 4), ("Q8_0", 34, 2)):  # float16 d (and m), then q
        blocks = rng.integers(0, 256, (4096, block_bytes), dtype=np.uint8)
        scales = rng.standard_normal(4096 * 2).astype(np.float16) * np.float16(2.0) ** rng.integers(-14, 15, 4096 * 2)
        blocks[:, :scale_bytes] = scales.view(np.uint8).reshape(4096, -1)[:, :scale_bytes]
        tensors = [blocks.reshape(64, -1)] + [
            data[e["offset"]:e["offset"] + e["bytes"]].view(e["dtype"]).reshape(e["shape"])
            for e in table["tensors"].values() if e["type"] == kind]
        assert len(tensors) > 1, kind
        for raw in tensors:
            expected = np.asarray(gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float32)
            got = WHOLE_TENSOR[kind](raw)
            assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), expected.view(np.uint32)), kind
