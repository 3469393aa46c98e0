"""The finite set of padded shapes the runtime compiles, and how work is fitted into them."""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.serving.packing import Pack, Packing


class SequenceTooLong(ValueError):
    """A sequence is longer than the largest length bucket (inputs are never truncated)."""

    def __init__(self, length: int, limit: int):
        super().__init__(f"sequence of {length} tokens exceeds the longest supported length of {limit} tokens")
        self.length = length
        self.limit = limit


def fit(buckets: tuple[int, ...], size: int) -> int:
    """The smallest bucket >= size (buckets sorted ascending); raise ValueError when none is."""
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        raise ValueError(f"{size} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    lengths: tuple[int, ...]  # full-sequence lengths (and shared-prefix context lengths)
    batches: tuple[int, ...]
    max_tokens: int  # a (batch, length) bucket holds at most this many tokens (batch 1 always exists)
    labels: tuple[int, ...]  # label-count buckets of the vocabulary head
    context_lengths: tuple[int, ...]  # shared-prefix lengths
    suffix_lengths: tuple[int, ...]  # item lengths after a shared prefix
    suffix_batches: tuple[int, ...]
    prefix_sharing: bool
    completion_batches: tuple[int, ...] = ()  # per-position log-probabilities (/v1/completions); () for none
    # Accelerators: sequences packed into rows (runtime.serving.packing) instead of the (batch, length) grids of
    # batches, suffix_lengths and suffix_batches; None: the grid (CPU).
    packing: "Packing | None" = None
    # What one more device batch costs, in padded tokens (its fixed price against a token's: launches, the weights
    # streamed once); the grid splits rows into batches that pad and launch least. The engine sets it from the
    # calibrated service model (runtime.serving.cost).
    batch_overhead_tokens: float = 32.0

    @property
    def max_length(self) -> int:
        return self.lengths[-1]

    @property
    def max_labels(self) -> int:
        return self.labels[-1]

    def batch_for(self, length_bucket: int, batches: tuple[int, ...] | None = None) -> int:
        """Largest batch bucket that fits `max_tokens` at this length (at least the smallest one)."""
        batches = batches or self.batches
        fitting = [b for b in batches if b * length_bucket <= self.max_tokens]
        return fitting[-1] if fitting else batches[0]

    @property
    def max_suffix(self) -> int:
        """The longest item scored after a shared prefix."""
        return self.packing.width if self.packing else self.suffix_lengths[-1]

    def full(self) -> list[tuple[int, int]]:
        """(batch, length) buckets of whole-sequence scoring; packed: (rows, width)."""
        if self.packing:
            return self.packing.full_shapes(self.lengths)
        return [(b, t) for t in self.lengths for b in self.batches if b <= self.batch_for(t)]

    def contexts(self) -> list[int]:
        return [c for c in self.context_lengths if c <= self.max_length] if self.prefix_sharing else []

    def continuations(self) -> list[tuple[int, ...]]:
        """(context, batch, length) buckets of scoring after a shared prefix; packed: (context, rows, width)."""
        if not self.prefix_sharing:
            return []
        if self.packing:
            return [(c, r, w) for c in self.contexts() for r, w in self.packing.continuation_shapes()]
        return [(c, b, s) for c in self.contexts() for s in self.suffix_lengths for b in self.suffix_batches
                if b <= self.batch_for(s, self.suffix_batches)]

    def completions(self) -> list[tuple[int, int]]:
        """(batch, length) buckets of per-position log-probabilities of whole sequences."""
        return [(b, t) for t in self.lengths for b in self.completion_batches
                if b <= self.batch_for(t, self.completion_batches)]

    def split_completions(self, lengths: list[int]) -> list[Chunk]:
        """Whole sequences of these lengths (longest first), read at every position, as device batches."""
        return self._split(lengths, self.lengths, self.completion_batches)

    def split_full(self, lengths: list[int]) -> "list[Chunk] | list[Pack]":
        """Whole sequences of these lengths (longest first) as device batches."""
        if self.packing:
            from runtime.serving.packing import pack_full
            return pack_full(self.packing, lengths, self.lengths)
        return self._split(lengths, self.lengths, self.batches)

    def split_suffixes(self, lengths: list[int]) -> "list[Chunk] | list[Pack]":
        """Continuations of these lengths (longest first) after a shared prefix, as device batches."""
        if self.packing:
            from runtime.serving.packing import pack_continuations
            return pack_continuations(self.packing, lengths)
        return self._split(lengths, self.suffix_lengths, self.suffix_batches)

    def _split(self, lengths: list[int], length_buckets: tuple[int, ...], batch_buckets: tuple[int, ...]
               ) -> list[Chunk]:
        """Rows sorted longest first, cut into batches as large as the token budget allows at each length bucket
        (similar lengths share a batch)."""
        chunks, start = [], 0
        while start < len(lengths):
            length = fit(length_buckets, lengths[start])
            largest = self.batch_for(length, batch_buckets)
            rows = min(largest, len(lengths) - start)
            batch = fit(batch_buckets, rows)
            if self.packing:
                if rows < self.packing.fill * batch and rows >= batch_buckets[0]:
                    # accelerators: several bucket-sized batches rather than one mostly padded (few, large buckets)
                    batch = rows = max(b for b in batch_buckets if b <= rows)
            else:
                usable = tuple(b for b in batch_buckets if b <= largest) or batch_buckets[:1]
                batch = _next_batch(rows, length, usable, self.batch_overhead_tokens)
                rows = min(rows, batch)
            chunks.append(Chunk(start, rows, batch, length))
            start += rows
        return chunks

    def heads(self) -> list[tuple[int, int]]:
        """(batch, labels) buckets of the vocabulary head (packed: batch = a shape's slots)."""
        if self.packing:
            shapes = self.full() + [(r, w) for _, r, w in self.continuations()]
            batches = sorted({self.packing.slots_for(r, w) for r, w in shapes})
            return [(b, n) for b in batches for n in self.labels]
        batches = sorted(set(self.batches) | set(self.suffix_batches if self.prefix_sharing else ()))
        return [(b, n) for b in batches for n in self.labels]

    def count(self) -> int:
        return (len(self.full()) + len(self.contexts()) + len(self.continuations()) + len(self.heads())
                + len(self.completions()))


@functools.lru_cache(maxsize=4096)
def _next_batch(rows: int, length: int, buckets: tuple[int, ...], overhead: float) -> int:
    """The batch bucket of the next device batch of `rows` rows (at most the largest bucket): one batch padded up to
    hold them all, or a smaller full one with the rest in further batches, whichever costs fewer padded tokens plus
    `overhead` tokens a batch (5 rows in buckets 1, 4, 16: 4 + 1, not one batch of 16)."""
    @functools.cache
    def cost(r: int) -> float:  # the least padded tokens + overheads of r rows
        if r == 0:
            return 0.0
        return min([overhead + fit(buckets, r) * length,
                    *(overhead + b * length + cost(r - b) for b in buckets if b < r)])
    up = fit(buckets, rows)
    best = min((b for b in buckets if b < rows), key=lambda b: (cost(rows - b) + b * length, -b), default=None)
    if best is None or overhead + up * length <= overhead + best * length + cost(rows - best):
        return up
    return best


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One device batch: rows [start, start + rows) of the sorted input, padded to (batch, length)."""
    start: int
    rows: int
    batch: int
    length: int

    @property
    def padded_tokens(self) -> int:
        return self.batch * self.length


def label_buckets(max_labels: int, steps: tuple[int, ...] | None = None) -> tuple[int, ...]:
    buckets = [n for n in (steps or (4, 16, 64, 256, 1024, 4096)) if n < max_labels]
    return tuple(buckets + [max_labels])
