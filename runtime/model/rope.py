"""Rotary position embeddings: the scaling types of transformers' `ROPE_INIT_FUNCTIONS`, in NumPy (float64).

Each type gives the inverse frequencies [rotary_dim / 2] and the attention scaling that multiplies cos and sin
(yarn and longrope; 1 for the others), as transformers computes them:
- default, linear (frequencies / factor), llama3 (wavelength bands), yarn (ramp between interpolation and
  extrapolation, mscale), all independent of the sequence;
- dynamic (NTK): for a sequence of n > max_position_embeddings tokens the base grows with n;
- longrope: short factors up to original_max_position_embeddings tokens, long factors beyond.
transformers recomputes the last two from the batch's longest position; this runtime does it per row, from the
row's own length (the same as transformers on that sequence alone), through a table with one row per served
length (`frequency_table`). `length_limit` says up to which length the frequencies stay the same: a shared prefix
is only computed once when every sequence of the request fits within it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

# Parameters each type reads (besides rope_type/type, rope_theta, partial_rotary_factor); anything else in the
# dict is refused by name, since it would mean a scaling this runtime does not compute.
TYPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
    "longrope": {"short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
REQUIRED = {
    "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",), "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


class RopeError(ValueError):
    """A rope_parameters / rope_scaling entry this runtime cannot compute exactly."""


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class Rope:
    kind: str  # default | linear | dynamic | yarn | longrope | llama3
    theta: float
    rotary_dim: int  # head_dim, or its first part (partial_rotary_factor)
    max_position_embeddings: int
    params: tuple[tuple[str, Any], ...] = ()  # the type's parameters, sorted (lists as tuples)

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    def length_limit(self) -> int | None:
        """The longest sequence whose frequencies equal the shortest one's; None when no length changes them."""
        if self.kind == "dynamic":
            return self.max_position_embeddings
        if self.kind == "longrope":
            return int(self.get("original_max_position_embeddings"))
        return None

    def inverse_frequencies(self, seq_len: int | None = None) -> tuple[np.ndarray, float]:
        """(inverse frequencies [rotary_dim / 2] float64, attention scaling) for a sequence of seq_len tokens."""
        return _TYPES[self.kind](self, seq_len)

    def frequency_table(self, max_length: int) -> tuple[np.ndarray, float]:
        """Inverse frequencies by length: [1, R/2] when no served length changes them, else [max_length, R/2] with
        row n - 1 for a sequence of n tokens."""
        limit = self.length_limit()
        if limit is None or max_length <= limit:
            inv, scaling = self.inverse_frequencies()
            return inv[None], scaling
        rows = [self.inverse_frequencies(n)[0] for n in range(1, max_length + 1)]
        return np.stack(rows), self.inverse_frequencies()[1]


def parse_rope(params: dict[str, Any], *, theta: float, head_dim: int, partial: float, max_position_embeddings: int,
               original_max: int | None, allowed: tuple[str, ...] | None, where: str) -> Rope:
    """A Rope from a config's rope_parameters (transformers >= 5) or rope_scaling dict; theta/partial/original_max
    are the top-level values, which the dict's own win over (as transformers standardizes them)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in TYPE_KEYS or (allowed is not None and kind not in allowed):
        supported = sorted(TYPE_KEYS) if allowed is None else list(allowed)
        raise RopeError(f"{where}: rope type {kind!r} is not supported (supported: {', '.join(supported)})")
    unknown = sorted(set(params) - COMMON_KEYS - TYPE_KEYS[kind])
    if unknown:
        raise RopeError(f"{where}: rope parameter(s) {', '.join(unknown)} of type {kind!r} are not supported")
    missing = [key for key in REQUIRED.get(kind, ()) if params.get(key) is None]
    if missing:
        raise RopeError(f"{where}: {kind} rope scaling is missing {missing}")
    values = {key: _hashable(value) for key, value in params.items() if key in TYPE_KEYS[kind]}
    if kind in ("yarn", "longrope", "llama3"):
        # transformers: a top-level original_max_position_embeddings (Phi-3) wins, then the dict's, then the maximum.
        values["original_max_position_embeddings"] = int(
            original_max or params.get("original_max_position_embeddings") or max_position_embeddings)
    partial = float(params.get("partial_rotary_factor", partial))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or rotary_dim <= 0:
        raise RopeError(f"{where}: partial_rotary_factor {partial} gives an odd rotary dimension {rotary_dim}")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(values[key]) != rotary_dim // 2:
                raise RopeError(f"{where}: longrope {key} has {len(values[key])} entries, needs {rotary_dim // 2}")
    return Rope(kind, float(params.get("rope_theta", theta)), rotary_dim, int(max_position_embeddings),
                tuple(sorted(values.items())))


def _base(rope: Rope, theta: float | None = None) -> np.ndarray:
    dim = rope.rotary_dim
    return 1.0 / ((theta or rope.theta) ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _default(rope: Rope, seq_len: int | None) -> tuple[np.ndarray, float]:
    return _base(rope), 1.0


def _linear(rope: Rope, seq_len: int | None) -> tuple[np.ndarray, float]:
    return _base(rope) / rope.get("factor"), 1.0


def _dynamic(rope: Rope, seq_len: int | None) -> tuple[np.ndarray, float]:
    dim, factor, limit = rope.rotary_dim, rope.get("factor"), rope.max_position_embeddings
    n = max(seq_len or limit, limit)
    theta = rope.theta * ((factor * n / limit) - (factor - 1)) ** (dim / (dim - 2))
    return _base(rope, theta), 1.0


def _yarn(rope: Rope, seq_len: int | None) -> tuple[np.ndarray, float]:
    dim, base, factor = rope.rotary_dim, rope.theta, rope.get("factor")
    original = rope.get("original_max_position_embeddings")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.get("beta_fast") or 32), correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def _longrope(rope: Rope, seq_len: int | None) -> tuple[np.ndarray, float]:
    original = rope.get("original_max_position_embeddings")
    factor = rope.get("factor") or rope.max_position_embeddings / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(rope.get("long_factor" if seq_len and seq_len > original else "short_factor"), np.float64)
    return _base(rope) / ext, float(attention)


def _llama3(rope: Rope, seq_len: int | None) -> tuple[np.ndarray, float]:
    inv = _base(rope)
    factor, low, high = rope.get("factor"), rope.get("low_freq_factor"), rope.get("high_freq_factor")
    old_len = rope.get("original_max_position_embeddings")
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled), 1.0


_TYPES = {"default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "longrope": _longrope,
          "llama3": _llama3}
