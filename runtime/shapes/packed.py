"""The packed layout (the accelerators'): several sequences share a row of fixed width, each attending only to itself.

A grid of (batch, length) buckets needs one executable per pair, and the shared-prefix path one per (context,
batch, item length): hundreds of executables, minutes of compiling per accelerator instance. Packing folds batch and
length into rows: a device batch is R rows of W tokens, each row holding as many whole sequences as fit (first
fit, longest first), with their own positions (from 0, or from the shared prefix's length) and a segment id per
token; attention is causal within a segment (runtime.model.attention.packed), so a sequence never sees another.
The MLP and the cascade's context attention already treat all tokens alike. Buckets are then a few row counts
per width (a device batch larger than one bucket is split into several, a smaller one rounded up only when
that pads at most 1 - `fill` of it), and a slot count M per shape: the rows' last tokens are gathered into
[M, D] for the label head.

Shapes, by default (runtime.assembly.platform picks them; docs/how-it-works/compile.md counts the executables):
- full sequences up to W tokens: rows of W = 128, R in 1, 2, 4, 16, 64; a single row of 16 ... 96 tokens for a
  few short sequences (single-item latency: 23 tokens run in 24, not 32);
- longer sequences: rows of each longer length bucket (256 ... 2048), R in 1, 8;
- continuations after a shared prefix (items up to W tokens): for each context length, rows of W (R in 1, 2, 4,
  16, 64) or a single row of 32.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from runtime.shapes.buckets import fit
from runtime.shapes.layout import BucketLayout, DeviceBatch, PlanLimits
from runtime.shapes.programs import PROGRAMS


@dataclasses.dataclass(frozen=True)
class PackedLayout(BucketLayout):
    width: int = 128  # W: rows of short sequences and of continuations
    rows: tuple[int, ...] = (1, 2, 4, 16, 64)  # row-count buckets of W-wide rows
    narrow: tuple[int, ...] = (16, 24, 32, 48, 64, 96)  # one-row widths below W for whole sequences
    narrow_continuations: tuple[int, ...] = (32,)  # one-row widths below W after a shared prefix
    wide_rows: tuple[int, ...] = (1, 8)  # row-count buckets of rows wider than W (each longer length bucket)
    slots: tuple[int, ...] = (4, 16, 64, 256, 1024)  # sequences one device batch reads (the head's batch)
    min_item_tokens: int = 8  # slots per row: width / this (shorter sequences fill fewer tokens of a row)
    fill: float = 0.75  # round a row count up to a bucket only when its tokens fill at least this much of it
    name = "packed"
    full_program = PROGRAMS["hidden_packed"]
    continuation_program = PROGRAMS["hidden_packed_after_context"]

    # ---- the BucketLayout interface ------------------------------------------------------------------

    def full_buckets(self, limits: PlanLimits) -> list[tuple[int, ...]]:
        return [(r, w, self.slots_for(r, w)) for r, w in self.full_shapes(limits.lengths)]

    def continuation_buckets(self, limits: PlanLimits) -> list[tuple[int, ...]]:
        return [(r, w, self.slots_for(r, w)) for r, w in self.continuation_shapes()]

    def head_batch(self, bucket: tuple[int, ...]) -> int:
        return bucket[-1]

    def split_full(self, limits: PlanLimits, lengths: list[int]) -> list[DeviceBatch]:
        return pack_full(self, lengths, limits.lengths)

    def split_continuations(self, limits: PlanLimits, lengths: list[int]) -> list[DeviceBatch]:
        return pack_continuations(self, lengths)

    def max_continuation(self, limits: PlanLimits) -> int:
        return self.width

    def full_rows(self, limits: PlanLimits, length: int) -> int:
        """Rows of the largest device batch at this width (what a busy device runs)."""
        return self.rows[-1] if length <= self.width else self.wide_rows[-1]

    def continuation_rows(self, limits: PlanLimits, length: int) -> int:
        return self.rows[-1]

    def for_data_axis(self, data: int) -> "PackedLayout":
        """Row counts and slots that split over `data` devices (every device batch is split by rows); no
        one-row shapes then."""
        if data == 1:
            return self

        def up(values):
            return tuple(sorted({-(-v // data) * data for v in values}))
        return dataclasses.replace(self, rows=up(self.rows), wide_rows=up(self.wide_rows), slots=up(self.slots))

    def problems(self, limits: PlanLimits, data: int) -> list[str]:
        return []  # row counts and slots are fitted to the data axis (for_data_axis)

    def describe(self) -> str:
        return f"packed rows of {self.width} ({self.rows})"

    # ---- shapes ---------------------------------------------------------------------------------------

    @property
    def min_rows(self) -> int:
        return self.rows[0]

    def slots_for(self, rows: int, width: int) -> int:
        """Slots of a (rows, width) shape: room for sequences of min_item_tokens (capped at the largest bucket)."""
        wanted = rows * max(1, width // self.min_item_tokens)
        return fit(self.slots, min(wanted, self.slots[-1]))

    def narrow_widths(self, continuation: bool) -> tuple[int, ...]:
        """One-row widths below W (single device only: a sharded batch has at least a row per device)."""
        if self.min_rows != 1:
            return ()
        return tuple(w for w in (self.narrow_continuations if continuation else self.narrow) if w < self.width)

    def full_shapes(self, lengths: tuple[int, ...]) -> list[tuple[int, int]]:
        """(rows, width) of whole-sequence device batches; `lengths` are the length buckets (the longest one is
        the longest sequence served)."""
        shapes = [(1, w) for w in self.narrow_widths(False) if w < lengths[-1]]
        shapes += [(r, self.width) for r in self.rows]
        shapes += [(r, w) for w in lengths if w > self.width for r in self.wide_rows]
        return shapes

    def continuation_shapes(self) -> list[tuple[int, int]]:
        """(rows, width) of device batches after a shared prefix (for each context length)."""
        return [(1, w) for w in self.narrow_widths(True)] + [(r, self.width) for r in self.rows]

    def row_width(self, length: int, lengths: tuple[int, ...]) -> int:
        return self.width if length <= self.width else fit(lengths, length)


@dataclasses.dataclass
class Pack(DeviceBatch):
    """One device batch: `rows` x `length` (its width) tokens; `row_members[r]` the indices (into the caller's list)
    of the sequences in row r, in order; `head_batch` (its slots) sequences at most."""
    row_members: list[list[int]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, rows: int, width: int, slots: int, row_members: list[list[int]]) -> "Pack":
        return cls([i for row in row_members for i in row], (rows, width, slots), rows, width, slots, row_members)

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.length

    def arrays(self, sequences: Sequence[Sequence[int]], adapters: Sequence[int], start: int = 0
               ) -> tuple[np.ndarray, ...]:
        """tokens, positions (from `start`), segments (-1: padding) [rows, width], last_index [slots] (flat) and
        each token's LoRA adapter [rows, width] (padding: 0)."""
        tokens = np.zeros((self.rows, self.length), np.int32)
        adapter = np.zeros((self.rows, self.length), np.int32)
        positions = np.zeros((self.rows, self.length), np.int32)
        segments = np.full((self.rows, self.length), -1, np.int32)
        last = np.zeros((self.head_batch,), np.int32)
        slot = 0
        for r, row in enumerate(self.row_members):
            offset = 0
            for segment, i in enumerate(row):
                n = len(sequences[i])
                tokens[r, offset: offset + n] = sequences[i]
                positions[r, offset: offset + n] = np.arange(start, start + n)
                segments[r, offset: offset + n] = segment
                adapter[r, offset: offset + n] = adapters[i]
                last[slot] = r * self.length + offset + n - 1
                slot += 1
                offset += n
        return tokens, positions, segments, last, adapter


def first_fit(lengths: list[int], order: list[int], width: int, per_row: int) -> list[list[int]]:
    """Sequences (indices in `order`, longest first) into rows of `width` tokens, at most `per_row` per row."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for r, room in enumerate(free):
            if lengths[i] <= room and len(rows[r]) < per_row:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(width - lengths[i])
    return rows


def pack(packing: PackedLayout, lengths: list[int], width: int, row_buckets: tuple[int, ...],
         narrow: tuple[int, ...] = ()) -> list[Pack]:
    """Sequences of these lengths (each at most `width`) as device batches of `width`-wide rows. Row counts are
    buckets: the rest of the rows in one bucket when their tokens fill at least `fill` of it, else the largest
    bucket they fill (several device batches rather than one padded one). A batch of one row may take a
    `narrow` width (first fit leaves the emptiest rows last)."""
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    per_row = max(1, min(packing.slots_for(b, width) // b for b in row_buckets))
    rows = first_fit(lengths, order, width, per_row)
    used = [sum(lengths[i] for i in row) for row in rows]
    packs, start = [], 0
    while start < len(rows):
        rest = len(rows) - start
        up = next((b for b in row_buckets if b >= rest), None)
        if up is not None and sum(used[start:]) >= packing.fill * up * width:
            take = bucket = up
        else:
            bucket = max((b for b in row_buckets if b <= rest), default=row_buckets[0])
            take = min(bucket, rest)
        members = rows[start: start + take]
        w = width
        if bucket == 1:  # the narrowest row that holds it, slots included
            w = next((n for n in narrow if used[start] <= n and len(members[0]) <= packing.slots_for(1, n)), width)
        packs.append(Pack.of(bucket, w, packing.slots_for(bucket, w), members))
        start += take
    return packs


def pack_full(packing: PackedLayout, lengths: list[int], length_buckets: tuple[int, ...]) -> list[Pack]:
    """Whole sequences: short ones packed into W-wide rows (or one narrow row), longer ones into rows of their
    length bucket (sequences of one width bucket together)."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(packing.row_width(n, length_buckets), []).append(i)
    packs = []
    for width, indices in sorted(groups.items()):
        buckets = packing.rows if width == packing.width else packing.wide_rows
        narrow = packing.narrow_widths(False) if width == packing.width else ()
        for p in pack(packing, [lengths[i] for i in indices], width, buckets, narrow):
            packs.append(Pack.of(p.rows, p.length, p.head_batch, [[indices[i] for i in row] for row in p.row_members]))
    return packs


def pack_continuations(packing: PackedLayout, lengths: list[int]) -> list[Pack]:
    """Items after a shared prefix (each at most W tokens) into W-wide rows."""
    return pack(packing, lengths, packing.width, packing.rows, packing.narrow_widths(True))
