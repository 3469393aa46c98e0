"""The grid layout (the CPU's): one bucket per (batch size, length) for whole sequences and per (context, batch
size, item length) for items after a shared prefix; each row holds one sequence, right-padded to its length bucket.
Rows are sorted longest first so that similar lengths share a batch, and cut into the batch buckets that pad and
launch least (runtime.serving.buckets.chunks)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from runtime.serving.buckets import chunks
from runtime.serving.layout import BucketLayout, DeviceBatch
from runtime.serving.programs import PROGRAMS

if TYPE_CHECKING:
    from runtime.serving.buckets import BucketPlan


@dataclasses.dataclass(frozen=True)
class GridLayout(BucketLayout):
    batches: tuple[int, ...]  # batch buckets of whole sequences
    suffix_lengths: tuple[int, ...]  # item lengths after a shared prefix
    suffix_batches: tuple[int, ...]  # batch buckets of items after a shared prefix
    name = "grid"
    full_program = PROGRAMS["hidden"]
    continuation_program = PROGRAMS["hidden_after_context"]

    def full_buckets(self, plan: "BucketPlan") -> list[tuple[int, ...]]:
        return [(b, t) for t in plan.lengths for b in self.batches if b <= plan.batch_for(t, self.batches)]

    def continuation_buckets(self, plan: "BucketPlan") -> list[tuple[int, ...]]:
        return [(b, s) for s in self.suffix_lengths for b in self.suffix_batches
                if b <= plan.batch_for(s, self.suffix_batches)]

    def head_batch(self, bucket: tuple[int, ...]) -> int:
        return bucket[0]

    def split_full(self, plan: "BucketPlan", lengths: list[int]) -> list[DeviceBatch]:
        return chunks(lengths, plan.lengths, self.batches, plan.max_tokens, plan.batch_overhead_tokens)

    def split_continuations(self, plan: "BucketPlan", lengths: list[int]) -> list[DeviceBatch]:
        return chunks(lengths, self.suffix_lengths, self.suffix_batches, plan.max_tokens, plan.batch_overhead_tokens)

    def max_continuation(self, plan: "BucketPlan") -> int:
        return self.suffix_lengths[-1]

    def full_rows(self, plan: "BucketPlan", length: int) -> int:
        return plan.batch_for(length, self.batches)

    def continuation_rows(self, plan: "BucketPlan", length: int) -> int:
        return plan.batch_for(length, self.suffix_batches)

    def problems(self, plan: "BucketPlan", data: int) -> list[str]:
        checks = [("SCOREFN_BATCH_BUCKETS", sorted({b for b, _ in self.full_buckets(plan)}))]
        if plan.prefix_sharing:
            checks.append(("SCOREFN_SUFFIX_BATCH_BUCKETS", sorted({b for b, _ in self.continuation_buckets(plan)})))
        return [f"{setting} has {', '.join(map(str, bad))}" for setting, batches in checks
                if (bad := [b for b in batches if b % data])]

    def describe(self) -> str:
        return f"grid: batches {self.batches}, suffix batches {self.suffix_batches}"

