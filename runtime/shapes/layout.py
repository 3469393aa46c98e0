"""A bucket layout: how whole sequences, and the items after a shared prefix, are laid out in the device batches of
compiled buckets. One small interface (BucketLayout) and its implementations: the grid (runtime.shapes.grid: one
bucket per batch size and length, the CPU's) and packed rows (runtime.shapes.packed: several sequences per row,
the accelerators'). The bucket plan (runtime.shapes.buckets) holds one and asks it; nothing else branches on it.

A layout gives
- the programs it runs (runtime.shapes.programs) and their buckets for a plan's limits (PlanLimits),
- how rows of given lengths are split into device batches (DeviceBatch: which sequences, padded how),
- the arrays of a device batch, and which slot of its head output each sequence's result is in,
- what a device batch costs on a busy device (the rows of the largest one at a length), for admission.
Pure Python (NumPy for the arrays).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from runtime.shapes.programs import Program


def largest_batch(length_bucket: int, batches: tuple[int, ...], max_tokens: int) -> int:
    """Largest batch bucket that fits `max_tokens` at this length (at least the smallest one)."""
    fitting = [b for b in batches if b * length_bucket <= max_tokens]
    return fitting[-1] if fitting else batches[0]


@dataclasses.dataclass(frozen=True)
class PlanLimits:
    """The numbers of a bucket plan (runtime.shapes.buckets) a layout reads: its length buckets, the most tokens a
    device batch holds, a batch's fixed price in padded tokens, and whether shared prefixes are compiled."""
    lengths: tuple[int, ...]
    max_tokens: int
    batch_overhead_tokens: float
    prefix_sharing: bool

    def batch_for(self, length_bucket: int, batches: tuple[int, ...]) -> int:
        return largest_batch(length_bucket, batches, self.max_tokens)


@dataclasses.dataclass
class DeviceBatch:
    """One device batch: the sequences it holds (indices into the list that was split), its bucket (the program's
    sizes, without a shared prefix's context), and what it pads to."""
    members: list[int]  # in the order of the head's slots: result i is members[i]'s
    bucket: tuple[int, ...]
    rows: int  # rows of the batch that hold tokens (a grid batch: its sequences; packed: rows used)
    length: int  # the width of a row (its length bucket)
    head_batch: int  # rows the head reads (a grid batch's size; packed: its slots)

    @property
    def padded_tokens(self) -> int:
        raise NotImplementedError

    def arrays(self, sequences: Sequence[Sequence[int]], adapters: Sequence[int], start: int = 0
               ) -> tuple[np.ndarray, ...]:
        """The program's token arguments for these members of `sequences`, each of `adapters`' LoRA adapter
        (positions counted from `start`: the shared prefix's length, for items after one)."""
        raise NotImplementedError

    def targets(self, targets: Sequence[Sequence[int]] | None, tail: int) -> np.ndarray:
        """Each head slot's targets [head_batch, tail]: its member's label tokens right-aligned, the tokens its last
        positions predict (-1: none, and for every slot without `targets`)."""
        out = np.full((self.head_batch, tail), -1, np.int32)
        for r, i in enumerate(self.members if targets is not None else ()):
            if targets[i]:
                out[r, tail - len(targets[i]):] = targets[i]
        return out


class BucketLayout:
    name: str
    full_program: Program  # whole sequences, read at their last token
    continuation_program: Program  # items after a shared prefix; its buckets start with the context's length

    def full_buckets(self, limits: PlanLimits) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def continuation_buckets(self, limits: PlanLimits) -> list[tuple[int, ...]]:
        """Buckets of items after a shared prefix, without the context (each compiles for every context length)."""
        raise NotImplementedError

    def head_batch(self, bucket: tuple[int, ...]) -> int:
        """Rows the head reads after a device batch of this (full or continuation) bucket."""
        raise NotImplementedError

    def split_full(self, limits: PlanLimits, lengths: list[int]) -> list[DeviceBatch]:
        """Whole sequences of these lengths as device batches."""
        raise NotImplementedError

    def split_continuations(self, limits: PlanLimits, lengths: list[int]) -> list[DeviceBatch]:
        """Items of these lengths after a shared prefix as device batches."""
        raise NotImplementedError

    def max_continuation(self, limits: PlanLimits) -> int:
        """The longest item scored after a shared prefix."""
        raise NotImplementedError

    def full_rows(self, limits: PlanLimits, length: int) -> int:
        """Rows of the largest device batch of whole sequences at this row width (what a busy device runs)."""
        raise NotImplementedError

    def continuation_rows(self, limits: PlanLimits, length: int) -> int:
        """Rows of the largest device batch of items of this width after a shared prefix (what a busy device runs)."""
        raise NotImplementedError

    def problems(self, limits: PlanLimits, data: int) -> list[str]:
        """Why this layout's device batches would not split over `data` devices (empty: they do)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError
