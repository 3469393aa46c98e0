"""MXFP4 (runtime.model.mxfp4): blocks and scales built by the format's definition (E2M1 codes two to a byte, the low
nibble first, one E8M0 power of two per 32 values) dequantize to the values they encode, in the layout transformers'
convert_moe_packed_tensors gives; a gpt-oss checkpoint with its experts stored so loads as the unquantized one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from runtime.model import mxfp4
from runtime.model.config import load_config
from runtime.model.errors import WeightsError
from runtime.model.weights import load_arrays
from tests.runtime.conftest import CASES, tiny_checkpoint

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # the magnitudes of codes 0-7; bit 3 is the sign


def quantize_exactly(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks and scales of a tensor [..., C, R] whose every block of 32 values along C (per row r) is an E2M1 value
    times one power of two: the checkpoint stores it transposed, rows [..., R, C]."""
    rows = np.swapaxes(values, -1, -2)
    blocks = rows.reshape(*rows.shape[:-1], -1, 32)  # [..., R, G, 32]
    exponent = np.floor(np.log2(np.max(np.abs(blocks), axis=-1) / 6.0)).astype(np.int32)  # 6 = the largest E2M1
    mantissa = blocks / np.ldexp(1.0, exponent)[..., None]
    codes = np.array([[E2M1.index(abs(m)) | (8 if m < 0 else 0) for m in block] for block in
                      mantissa.reshape(-1, 32)], np.uint8).reshape(mantissa.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # C order: safetensors.numpy writes an array's memory as it lies (the transposes left these in another order)
    return np.ascontiguousarray(packed, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8)


def exact_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor [..., C, R] of E2M1 values times a power of two per block of 32 along C, each block reaching 6."""
    magnitudes = rng.choice(np.array(E2M1, np.float32), size=shape) * rng.choice([-1.0, 1.0], size=shape)
    magnitudes[..., ::32, :] = 6.0
    scales = np.ldexp(1.0, rng.integers(-8, 4, size=(*shape[:-2], shape[-2] // 32, shape[-1])))
    return (magnitudes * np.repeat(scales, 32, axis=-2)).astype(np.float32)


def test_blocks_and_scales_dequantize_to_the_values_they_encode():
    values = exact_values(np.random.default_rng(0), (3, 64, 5))
    blocks, scales = quantize_exactly(values)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    assert np.array_equal(mxfp4.dequantize(blocks, scales), values)


def test_dequantize_is_transformers_convert_moe_packed_tensors():
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 6, 3, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (2, 6, 3), dtype=np.uint8)
    reference = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    assert np.array_equal(mxfp4.dequantize(blocks, scales), reference.numpy())


def test_pairs_come_in_any_order_and_a_lone_half_fails():
    blocks, scales = np.zeros((1, 2, 1, 16), np.uint8), np.full((1, 2, 1), 127, np.uint8)
    tensors = [("a_scales", scales), ("b", np.ones(2, np.float32)), ("a_blocks", blocks)]
    assert [name for name, _ in mxfp4.dequantized(iter(tensors))] == ["b", "a"]
    with pytest.raises(WeightsError, match="without their blocks or scales: a_scales"):
        list(mxfp4.dequantized(iter(tensors[:2])))


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_loads_as_the_unquantized_one(tmp_path):
    family, overrides = CASES["gpt_oss"]
    plain, quantized = tmp_path / "plain", tmp_path / "mxfp4"
    tiny_checkpoint(family, plain, **{**overrides, "hidden_size": 64, "intermediate_size": 64})
    tensors = load_file(plain / "model.safetensors")
    rng = np.random.default_rng(2)
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # [X, in, out], quantized along `in` as gpt-oss's checkpoints are
        tensors[name] = exact_values(rng, tensors[name].shape)
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    stored = {}
    for name, value in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[name + "_blocks"], stored[name + "_scales"] = quantize_exactly(value)
        else:
            stored[name] = value
    quantized.mkdir()
    save_file(stored, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quantized / "config.json").write_text(json.dumps(config))
    cfg = load_config(quantized)
    assert cfg.quantization == "mxfp4"
    expected, loaded = load_arrays(plain, load_config(plain)), load_arrays(quantized, cfg)
    assert expected.keys() == loaded.keys()
    for name in expected:
        assert np.array_equal(loaded[name], expected[name]), name
