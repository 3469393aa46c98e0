"""Scores to probabilities on the host, in float64 NumPy (no SciPy: serving never installs it, see lock/not-served.txt).

Pure NumPy, like runtime.settings: the handler imports it without importing JAX.
"""

from __future__ import annotations

import numpy as np


def softmax(values: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x - max) / sum(exp(x - max)) along `axis`, in float64 (SciPy's softmax, the same steps)."""
    values = np.asarray(values, dtype=np.float64)
    shifted = np.exp(values - values.max(axis=axis, keepdims=True))
    return shifted / shifted.sum(axis=axis, keepdims=True)


def sigmoid(values: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) in float64, through exp(-|x|) so that no exponent overflows."""
    values = np.asarray(values, dtype=np.float64)
    small = np.exp(-np.abs(values))
    return np.where(values >= 0, 1.0 / (1.0 + small), small / (1.0 + small))
