"""The checkpoint error that runtime.model.weights and runtime.model.gguf both raise.

It lives in neither of them, so that weights can import gguf (it reads a GGUF-prepared directory through it)
while gguf raises the same error, without an import cycle. Importers use it as runtime.model.weights.WeightsError.
"""

from __future__ import annotations


class WeightsError(ValueError):
    """The checkpoint's tensors do not match its config."""
