"""MXFP4 weights (gpt-oss checkpoints, quantization_config quant_method "mxfp4"), dequantized at load.

A quantized tensor `<name>` is stored as two: `<name>_blocks` [..., R, G, 16] uint8, each byte two FP4 (E2M1) values
(the low nibble first), and `<name>_scales` [..., R, G] uint8, one shared power of two per block of 32 values (E8M0:
2 ** (scale - 127)). Row r of the dequantized [..., R, G * 32] is then transposed as transformers'
`convert_moe_packed_tensors` does (its last two axes swapped), which gives the layout of the unquantized checkpoint:
gate_up_proj [X, D, 2F], down_proj [X, F, D]. Every value is an FP4 value times a power of two, exact in float32.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from runtime.model.errors import WeightsError

# E2M1: the 16 codes' values (the high bit the sign)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
SCALE_BIAS = 127
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., R, G, B] uint8 and scales [..., R, G] uint8 -> float32 [..., G * B * 2, R]."""
    if blocks.shape[:-1] != scales.shape:
        raise WeightsError(f"MXFP4 blocks {blocks.shape} do not match their scales {scales.shape}")
    blocks = blocks.astype(np.uint8)
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # [..., R, G, B, 2]
    exponents = scales.astype(np.int32) - SCALE_BIAS
    values = np.ldexp(values, exponents[..., None, None]).astype(np.float32)
    rows = values.reshape(*scales.shape[:-1], -1)  # [..., R, G * B * 2]
    return np.ascontiguousarray(np.swapaxes(rows, -1, -2))


def dequantized(tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors with each `<name>_blocks` / `<name>_scales` pair (in any order) as `<name>`,
    dequantized; the others as they are. A half of a pair whose other half never comes fails loudly."""
    waiting: dict[str, tuple[str, np.ndarray]] = {}  # name -> (suffix, the half read first)
    for name, value in tensors:
        suffix = next((s for s in (BLOCKS, SCALES) if name.endswith(s)), None)
        if suffix is None:
            yield name, value
            continue
        base = name.removesuffix(suffix)
        other = waiting.pop(base, None)
        if other is None:
            waiting[base] = (suffix, value)
            continue
        if other[0] == suffix:
            raise WeightsError(f"tensor {name} appears more than once in the checkpoint")
        blocks, scales = (value, other[1]) if suffix == BLOCKS else (other[1], value)
        yield base, dequantize(blocks, scales)
    if waiting:
        shown = ", ".join(base + suffix for base, (suffix, _) in sorted(waiting.items())[:5])
        raise WeightsError(f"MXFP4 tensor(s) without their blocks or scales: {shown}")
