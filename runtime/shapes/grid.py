"""The grid layout (the CPU's): one bucket per (batch size, length) for whole sequences and per (context, batch
size, item length) for items after a shared prefix; each row holds one sequence, right-padded to its length bucket.
Rows are sorted longest first so that similar lengths share a batch, and cut into the batch buckets that pad and
launch least (runtime.shapes.buckets.chunks)."""

from __future__ import annotations

import dataclasses

from runtime.shapes.buckets import chunks
from runtime.shapes.layout import BucketLayout, DeviceBatch, PlanLimits
from runtime.shapes.programs import PROGRAMS


@dataclasses.dataclass(frozen=True)
class GridLayout(BucketLayout):
    batches: tuple[int, ...]  # batch buckets of whole sequences
    suffix_lengths: tuple[int, ...]  # item lengths after a shared prefix
    suffix_batches: tuple[int, ...]  # batch buckets of items after a shared prefix
    name = "grid"
    full_program = PROGRAMS["hidden"]
    continuation_program = PROGRAMS["hidden_after_context"]

    def full_buckets(self, limits: PlanLimits) -> list[tuple[int, ...]]:
        return [(b, t) for t in limits.lengths for b in self.batches if b <= limits.batch_for(t, self.batches)]

    def continuation_buckets(self, limits: PlanLimits) -> list[tuple[int, ...]]:
        return [(b, s) for s in self.suffix_lengths for b in self.suffix_batches
                if b <= limits.batch_for(s, self.suffix_batches)]

    def head_batch(self, bucket: tuple[int, ...]) -> int:
        return bucket[0]

    def split_full(self, limits: PlanLimits, lengths: list[int]) -> list[DeviceBatch]:
        return chunks(lengths, limits.lengths, self.batches, limits.max_tokens, limits.batch_overhead_tokens)

    def split_continuations(self, limits: PlanLimits, lengths: list[int]) -> list[DeviceBatch]:
        return chunks(lengths, self.suffix_lengths, self.suffix_batches, limits.max_tokens,
                      limits.batch_overhead_tokens)

    def max_continuation(self, limits: PlanLimits) -> int:
        return self.suffix_lengths[-1]

    def full_rows(self, limits: PlanLimits, length: int) -> int:
        return limits.batch_for(length, self.batches)

    def continuation_rows(self, limits: PlanLimits, length: int) -> int:
        return limits.batch_for(length, self.suffix_batches)

    def problems(self, limits: PlanLimits, data: int) -> list[str]:
        checks = [("SCOREFN_BATCH_BUCKETS", sorted({b for b, _ in self.full_buckets(limits)}))]
        if limits.prefix_sharing:
            checks.append(("SCOREFN_SUFFIX_BATCH_BUCKETS", sorted({b for b, _ in self.continuation_buckets(limits)})))
        return [f"{setting} has {', '.join(map(str, bad))}" for setting, batches in checks
                if (bad := [b for b in batches if b % data])]

    def describe(self) -> str:
        return f"grid: batches {self.batches}, suffix batches {self.suffix_batches}"

