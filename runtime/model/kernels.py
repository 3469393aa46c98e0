"""How the model's layers and heads run (Kernels): the loop, the attention implementation and dtype, the matmul
precision, and the batch-invariant kernels' tiles. runtime.assembly.platform picks them per platform from
measurements; runtime.model.transformer and runtime.model.decoder_layer read them.
"""

from __future__ import annotations

import dataclasses

from runtime.model import invariant


@dataclasses.dataclass(frozen=True)
class Kernels:
    """How the layers run; runtime.assembly.platform picks these per platform from measurements."""
    unroll: bool = False  # unroll the layer loop instead of lax.scan
    experts: str = "auto"  # routed experts: routed | all | auto (runtime.model.decoder_layer._experts)
    # jax.nn.dot_product_attention's xla | cudnn, or the batch-invariant kernels' pallas (GPU) | pallas_tpu (Mosaic)
    attention: str = "xla"
    attention_dtype: str = "float32"  # queries, keys and values of attention (and the shared-prefix KV)
    matmul_precision: str | None = None  # traced under jax.default_matmul_precision (e.g. "highest": no TF32)
    batch_invariant: bool = False  # whole rows computed so that a row's bits never depend on the others (invariant)
    # A scanned stack of bfloat16 weights held as their bits (16-bit integers): XLA:CPU slices bfloat16 through
    # float32 and back (2.4x the time of one item's layers), integers as they are. CPU only: accelerators slice
    # bfloat16 as it is.
    weight_bits: bool = False
    # Batch-invariant kernels: the fewest rows of a matmul (the token stream's, an attention tile's), from which rows
    # have the same bits whatever their number (runtime.assembly.bitclasses measures it on the host).
    min_rows: int = invariant.MIN_ROWS
    # Routed experts: the rows of each expert's tiles (runtime.model.experts); with batch invariance, as many as keep
    # a row's bits wherever it sits among them (runtime.assembly.bitclasses.tile_rows measures it on the host).
    expert_tile: int = invariant.MIN_ROWS
    # Accelerators: the stream's token-wise work (norms, projections, rotation, MLP) in a loop over fixed chunks of
    # this many tokens, each one compiled shape (a GPU picks a GEMM per shape: a row's bits moved with the batch's
    # rows); 0: the whole stream at once (a CPU: its matmuls' rows keep their bits from min_rows up).
    stream_chunk: int = 0
    # and the rows of a tile of the label log-probabilities' head that give a row the bits it has in a tile of TILE
    head_rows: tuple[int, int] = (invariant.TILE, invariant.TILE)
