"""From how many rows a matmul's rows keep their bits on this host: what the batch-invariant kernels' smallest matmuls
are sized by (runtime.model.invariant; Kernels.stream_rows and tile_rows).

XLA:CPU picks a matmul's kernel by its shape. A row of `x[:M] @ w` has one set of bits for every M from a threshold up
and others below it; the threshold depends on the dtype, the matmul's other sizes and the host's kernels (measured on
an AMD EPYC Zen 4, 2026-11-26: bfloat16 any M from 2; float32 from 33 for 576 x 1536, from 51 for the attention's
64 x 32 and 64 x 65; on an Intel Xeon with AMX, bfloat16 576 x 1536 from 33). So the host's own matmuls decide: one
program computes every shape the model multiplies at a list of row counts and compares the first and last row of each
with the same rows of the largest. Bits, not timings: the same image on the same CPU class always decides the same.

The answer depends on the host's kernels and on nothing a start varies, so it is recorded (a JSON file beside the
executable store, keyed by everything that could change it) and a later start reads it instead of compiling the probe
again (~4 s on 2 cores).
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

Shape = tuple[int, int, str]  # (inner, outer, dtype): x [M, inner] @ w [inner, outer] in dtype, float32 accumulation


def measure(shapes: tuple[Shape, ...]) -> dict[Shape, int]:
    """For each shape, the fewest rows (one of ROWS) from which every larger listed row count gives the first and
    the last row of `x[:M] @ w` the bits they have in the largest matmul."""
    rng = np.random.default_rng(0)
    xs = {inner: rng.standard_normal((ROWS[-1], inner)).astype(np.float32) for inner, _, _ in shapes}
    ws = [rng.standard_normal((inner, outer)).astype(np.float32) for inner, outer, _ in shapes]
    last = np.asarray(ROWS) - 1

    def rows(xs, ws):  # per shape: [len(ROWS), 2, outer] (each count's first and last row), [len(ROWS), outer]
        out = []
        for (inner, _, dtype), w in zip(shapes, ws):
            products = [jax.lax.dot_general(xs[inner][:m].astype(dtype), w.astype(dtype), (((1,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32) for m in ROWS]
            out.append((jnp.stack([p[jnp.array([0, m - 1])] for p, m in zip(products, ROWS)]), products[-1][last]))
        return out
    found = {}
    for shape, (ends, reference) in zip(shapes, jax.device_get(jax.jit(rows)(xs, ws))):
        same = [np.array_equal(first_last[0], reference[0]) and np.array_equal(first_last[1], reference[i])
                for i, first_last in enumerate(ends)]
        found[shape] = next(m for i, m in enumerate(ROWS) if all(same[i:]))
    return found


def floor(shapes: tuple[Shape, ...], cpu: str, record: Path | None = None) -> int:
    """The fewest rows from which every one of `shapes` keeps its bits: read from `record` when it holds these shapes
    for this CPU (`cpu`: the classes compiled for and run on, whose kernels decide), else measured (and written
    there)."""
    key = _key(shapes, cpu)
    recorded = _read(record).get(key) if record is not None else None
    if recorded is not None:
        return int(recorded)
    found = max(_measured(shapes).values())
    if record is not None:
        _write(record, key, found)
    return found


@functools.cache
def _measured(shapes: tuple[Shape, ...]) -> dict[Shape, int]:
    found = measure(shapes)
    log.info("matmul bit classes: %s", ", ".join(f"{i}x{o} {d} from {m} rows" for (i, o, d), m in found.items()))
    return found


def _key(shapes: tuple[Shape, ...], cpu: str) -> str:
    """Everything the answer depends on: the shapes, the JAX and XLA builds and flags, and the CPU."""
    parts = [sorted(shapes), jax.__version__, importlib.metadata.version("jaxlib"), os.environ.get("XLA_FLAGS", ""),
             cpu, list(ROWS)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def _read(record: Path) -> dict:
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        return {}


def _write(record: Path, key: str, found: int) -> None:
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({**_read(record), key: found}, indent=1))
        partial.replace(record)
    except OSError as exc:  # a read-only image: measured again at the next start
        log.debug("matmul bit classes not recorded: %s", exc)
