"""From how many rows a matmul's rows keep their bits on this host: what the batch-invariant kernels' smallest matmuls
are sized by (runtime.model.invariant; Kernels.stream_rows and tile_rows).

XLA:CPU picks a matmul's kernel by its shape. A row of `x[:M] @ w` has one set of bits for every M from a threshold up
and others below it; the threshold depends on the dtype, the matmul's other sizes and the host's kernels (measured on
an AMD EPYC Zen 4, 2026-11-26: bfloat16 any M from 2; float32 from 33 for 576 x 1536, from 51 for 64 x 32 and
64 x 65; on an Intel Xeon with AMX, bfloat16 576 x 1536 from 33; on an Intel Xeon with AVX-512, 2026-11-27, float32
51 for 64 x 32 and 64 x 65 as on the Zen 4, but 1 for 64 x 64, which is why attention's key blocks hold 64 keys).
So the host's own matmuls decide: one
program computes every shape the model multiplies at a list of row counts and compares the first and last row of each
with the same rows of the largest. Bits, not timings: the same image on the same CPU class always decides the same.

The answer depends on the host's kernels and on nothing a start varies, so it is recorded (a JSON file in the cache
directory, SCOREFN_CACHE_DIR, keyed by everything that could change it) and a later start reads it instead of compiling
the probe again (~4 s on 2 cores), whichever executable store it uses.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("scorefn.runtime")

# Row counts the probe compares, every threshold measured so far among them (2, 33, 51, 63); the last is the reference.
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 33, 40, 48, 51, 56, 63, 64, 65, 80, 96, 128, 129, 192, 256, 512, 1024, 4096,
        16384)

# Rows of an expert's tile the probe tries, fewest first (runtime.model.experts: fewer rows pad less; 8 kept its
# bits on the AMD EPYC but ran 1.1-1.4x slower than 16 on the bench's MoE, 2026-12-06).
TILES = (16, 32, 64)

Shape = tuple[int, int, str]  # (inner, outer, dtype): x [M, inner] @ w [inner, outer] in dtype, float32 accumulation


def measure(shapes: tuple[Shape, ...], counts: tuple[int, ...] = ROWS, reference: int | None = None,
            columns: bool = False) -> dict[Shape, tuple[int, int]]:
    """For each shape, the rows (of `counts`) from which and up to which every listed count gives the first and the
    last row of `x[:M] @ w` the bits they have with `reference` rows (default: the most): (lo, hi), a span of counts
    around the reference. `columns`: the same for the columns of `w @ x[:M].T` with w held [outer, inner], as the
    vocabulary head multiplies hidden states (runtime.model.heads): its weight is the left operand."""
    reference = counts[-1] if reference is None else reference
    rng = np.random.default_rng(0)
    xs = {inner: rng.standard_normal((max(counts), inner)).astype(np.float32) for inner, _, _ in shapes}
    ws = [rng.standard_normal((outer, inner) if columns else (inner, outer)).astype(np.float32)
          for inner, outer, _ in shapes]
    at = counts.index(reference)

    def product(x, w):  # the rows of x @ w [M, outer], or the columns of w @ x.T [outer, M], as the head holds them
        if columns:
            return jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    def pick(product, at):  # rows `at` of a product, or its columns (never transposed: XLA would lay the dot out anew)
        return jnp.take(product, jnp.array(at), axis=1 if columns else 0)

    def rows(xs, ws):  # per shape and count: the product's first and last rows, and the reference's same rows
        out = []
        for (inner, _, dtype), w in zip(shapes, ws):
            products = {m: product(xs[inner][:m].astype(dtype), w.astype(dtype)) for m in counts}
            out.append([(pick(products[m], [0, min(m, reference) - 1]),
                         pick(products[reference], [0, min(m, reference) - 1])) for m in counts])
        return out
    found = {}
    for shape, pairs in zip(shapes, jax.device_get(jax.jit(rows)(xs, ws))):
        same = [np.array_equal(got, want) for got, want in pairs]
        lo = at
        while lo > 0 and same[lo - 1]:
            lo -= 1
        hi = at
        while hi + 1 < len(counts) and same[hi + 1]:
            hi += 1
        found[shape] = (counts[lo], counts[hi])
    return found


def span(shapes: tuple[Shape, ...], cpu: str, reference: int, counts: tuple[int, ...],
         record: Path | None = None, columns: bool = False) -> tuple[int, int]:
    """The counts of rows (`columns`: of columns, see `measure`) around `reference` with which every one of `shapes`
    gives each row the bits it has with `reference` rows: read from `record` when it holds these shapes for this CPU,
    else measured (and written there)."""
    key = _key((*shapes, ("span", reference, counts, *(("columns",) if columns else ()))), cpu)
    recorded = _read(record).get(key) if record is not None else None
    if recorded is not None:
        return tuple(recorded)
    spans = _measured(shapes, counts, reference, columns).values()
    found = (max(lo for lo, _ in spans), min(hi for _, hi in spans))
    if record is not None:
        _write(record, key, found)
    return found


def floor(shapes: tuple[Shape, ...], cpu: str, record: Path | None = None) -> int:
    """The fewest rows from which every one of `shapes` keeps its bits: read from `record` when it holds these shapes
    for this CPU (`cpu`: the classes compiled for and run on, whose kernels decide), else measured (and written
    there)."""
    key = _key(shapes, cpu)
    recorded = _read(record).get(key) if record is not None else None
    if recorded is not None:
        return int(recorded)
    found = max(lo for lo, _ in _measured(shapes, ROWS, ROWS[-1]).values())
    if record is not None:
        _write(record, key, found)
    return found


def tile_rows(shapes: tuple[Shape, ...], cpu: str, group: int, record: Path | None = None) -> int:
    """The fewest rows of TILES with which `group` tiles multiplied at once, each by its own weights ([group, T,
    inner] @ [group, inner, outer], runtime.model.experts), give every row the same bits wherever it sits among
    them, for every one of `shapes`; else the last of TILES. Read from `record` when it holds the answer, else
    measured (and written there)."""
    key = _key((*shapes, ("tiles", group, TILES)), cpu)
    recorded = _read(record).get(key) if record is not None else None
    if recorded is not None:
        return int(recorded)
    found = next((tile for tile in TILES if _anywhere_alike(shapes, tile, group)), TILES[-1])
    log.info("expert tiles: %d rows keep a row's bits wherever it sits among %d tiles", found, group)
    if record is not None:
        _write(record, key, found)
    return found


def _anywhere_alike(shapes: tuple[Shape, ...], tile: int, group: int) -> bool:
    """Whether the rows of `group` tiles of `tile` rows, moved to other places (other tiles, other rows of a tile),
    come out with the bits they had: the same weights in every tile, so that a moved row meets its own."""
    rng = np.random.default_rng(1)
    rows = group * tile
    moves = sorted({1, tile - 1, tile, tile + 1, rows // 2} - {0, rows})

    def moved(x, w):
        at = lambda shift: jnp.roll(x, shift, axis=0).reshape(group, tile, -1)
        out = lambda shift: jnp.roll(jnp.einsum("gti,gio->gto", at(shift), w, preferred_element_type=jnp.float32)
                                     .reshape(rows, -1), -shift, axis=0)
        return [out(shift) for shift in (0, *moves)]
    for inner, outer, dtype in shapes:
        x = jnp.asarray(rng.standard_normal((rows, inner)), dtype)
        w = jnp.broadcast_to(jnp.asarray(rng.standard_normal((inner, outer)), dtype), (group, inner, outer))
        first, *others = jax.device_get(jax.jit(moved)(x, w))
        if not all(np.array_equal(first, other) for other in others):
            return False
    return True


@functools.cache
def _measured(shapes: tuple[Shape, ...], counts: tuple[int, ...], reference: int, columns: bool = False
              ) -> dict[Shape, tuple[int, int]]:
    found = measure(shapes, counts, reference, columns)
    side = "columns" if columns else "rows"
    log.info("matmul bit classes: %s", ", ".join(f"{i}x{o} {d}: {lo}-{hi} {side} as {reference}"
                                                  for (i, o, d), (lo, hi) in found.items()))
    return found


def _key(shapes: tuple, cpu: str) -> str:
    """Everything the answer depends on: the shapes, the JAX and XLA builds and flags, and the CPU."""
    parts = [sorted(map(str, shapes)), jax.__version__, importlib.metadata.version("jaxlib"), os.environ.get("XLA_FLAGS", ""),
             cpu, list(ROWS)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def _read(record: Path) -> dict:
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        return {}


def _write(record: Path, key: str, found) -> None:
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({**_read(record), key: found}, indent=1))
        partial.replace(record)
    except OSError as exc:  # a read-only image: measured again at the next start
        log.debug("matmul bit classes not recorded: %s", exc)
