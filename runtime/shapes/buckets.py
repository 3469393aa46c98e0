"""The finite set of padded shapes the runtime compiles (a bucket plan), and how rows are fitted into them.

The plan holds what every layout shares (length buckets, label-count buckets, shared-prefix contexts, the completion
batches) and a bucket layout (runtime.shapes.layout: the grid or packed rows) for whole sequences and the items
after a shared prefix. `programs()` is every (program, bucket) a start compiles.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Sequence

import numpy as np

from runtime.shapes.layout import BucketLayout, DeviceBatch, PlanLimits, largest_batch
from runtime.shapes.programs import PROGRAMS, Program


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


def rounded_up(buckets: tuple[int, ...], multiple: int) -> tuple[int, ...]:
    """Each bucket rounded up to a multiple of `multiple`, sorted, without repeats."""
    return tuple(sorted({-(-b // multiple) * multiple for b in buckets}))


def split_rows(lengths: list[int], length_buckets: tuple[int, ...], batch_buckets: tuple[int, ...],
               max_tokens: int, overhead: float) -> list[tuple[int, int, int, int]]:
    """Rows of these lengths (longest first) cut into (start, rows, batch bucket, length bucket) device batches: as
    large as the token budget allows at each length bucket (similar lengths share a batch), in the batch buckets
    that pad and launch least at `overhead` padded tokens a device batch."""
    out, start = [], 0
    while start < len(lengths):
        length = fit(length_buckets, lengths[start])
        largest = largest_batch(length, batch_buckets, max_tokens)
        rows = min(largest, len(lengths) - start)
        usable = tuple(b for b in batch_buckets if b <= largest) or batch_buckets[:1]
        batch = _next_batch(rows, length, usable, overhead)
        rows = min(rows, batch)
        out.append((start, rows, batch, length))
        start += rows
    return out


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


@dataclasses.dataclass
class Chunk(DeviceBatch):
    """A device batch of the grid: `rows` sequences right-padded to [batch, length] (batch: its head_batch)."""

    @property
    def padded_tokens(self) -> int:
        return self.head_batch * self.length

    def arrays(self, sequences: Sequence[Sequence[int]], adapters: Sequence[int],
               start: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Right-padded tokens [batch, length], each row's last real position [batch] and LoRA adapter [batch]
        (padding rows: 0)."""
        tokens = np.zeros((self.head_batch, self.length), np.int32)
        last = np.zeros((self.head_batch,), np.int32)
        adapter = np.zeros((self.head_batch,), np.int32)
        for r, i in enumerate(self.members):
            tokens[r, : len(sequences[i])] = sequences[i]
            last[r] = len(sequences[i]) - 1
            adapter[r] = adapters[i]
        return tokens, last, adapter


def chunks(lengths: list[int], length_buckets: tuple[int, ...], batch_buckets: tuple[int, ...], max_tokens: int,
           overhead: float) -> list[Chunk]:
    """Rows of these lengths (any order) as grid device batches, longest first (split_rows)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [Chunk(order[start: start + rows], (batch, length), rows, length, batch)
            for start, rows, batch, length in split_rows([lengths[i] for i in order], length_buckets, batch_buckets,
                                                         max_tokens, overhead)]


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    lengths: tuple[int, ...]  # full-sequence lengths (and shared-prefix context lengths)
    max_tokens: int  # a (batch, length) bucket holds at most this many tokens (batch 1 always exists)
    labels: tuple[int, ...]  # label-count buckets of the vocabulary head
    context_lengths: tuple[int, ...]  # shared-prefix lengths
    prefix_sharing: bool
    layout: BucketLayout  # whole sequences and the items after a shared prefix (the grid or packed rows)
    completion_batches: tuple[int, ...] = ()  # per-position log-probabilities (/v1/completions); () for none
    # What one more device batch costs, in padded tokens (its fixed price against a token's: launches, the weights
    # streamed once); rows are split into batches that pad and launch least. The engine sets it from the
    # calibrated service model (runtime.requests.cost).
    batch_overhead_tokens: float = 32.0
    lora: bool = False  # LoRA adapter slots: their classification heads' program too (runtime.model.lora)
    label_tokens: int = 1  # the most tokens of a label (the positions a row's tail is read at: Job.targets)
    # The shortest prompt read at every position that the prefix cache keeps, with its per-position outputs
    # (runtime.requests.prefix_cache.MIN_TOKENS); 0: no prefix cache, and none of its programs compiled.
    kept_prompts: int = 0

    @property
    def max_length(self) -> int:
        return self.lengths[-1]

    @property
    def max_suffix(self) -> int:
        """The longest item scored after a shared prefix."""
        return self.layout.max_continuation(self.limits)

    @property
    def limits(self) -> PlanLimits:
        """What the layout reads of this plan."""
        return PlanLimits(self.lengths, self.max_tokens, self.batch_overhead_tokens, self.prefix_sharing)

    def batch_for(self, length_bucket: int, batches: tuple[int, ...]) -> int:
        return self.limits.batch_for(length_bucket, batches)

    def full(self) -> list[tuple[int, ...]]:
        """Buckets of whole-sequence scoring."""
        return self.layout.full_buckets(self.limits)

    def contexts(self) -> list[int]:
        return [c for c in self.context_lengths if c <= self.max_length] if self.prefix_sharing else []

    def continuations(self) -> list[tuple[int, ...]]:
        """Buckets of scoring after a shared prefix: (context, *the layout's bucket)."""
        return [(c, *bucket) for c in self.contexts() for bucket in self.layout.continuation_buckets(self.limits)]

    def completions(self) -> list[tuple[int, int]]:
        """(batch, length) buckets of per-position log-probabilities of whole sequences."""
        return [(b, t) for t in self.lengths for b in self.completion_batches
                if b <= self.batch_for(t, self.completion_batches)]

    def kept_contexts(self) -> list[int]:
        """The context buckets that hold a prefix the prefix cache keeps from `kept_prompts` tokens on (a prompt read
        at every position, or a context extended past its cached part); none without the cache or shared prefixes."""
        contexts = self.contexts()
        if not (self.kept_prompts and contexts and self.kept_prompts <= contexts[-1]):
            return []
        return [c for c in contexts if c >= fit(tuple(contexts), self.kept_prompts)]

    def kept_prompt_contexts(self) -> list[int]:
        """The context buckets a prompt read at every position that the prefix cache keeps fills; none without
        completions."""
        return self.kept_contexts() if self.completion_batches else []

    def rest_lengths(self) -> tuple[int, ...]:
        """Length buckets of what is computed after a cached part, within one row (a prompt's rest read at every
        position, a context's extension): the shortest length bucket (an answer after its question) and the longest
        item after a shared prefix (a longer text after a prompt); two, so that the cache adds few programs."""
        fitting = [t for t in self.lengths if t <= self.max_suffix] or [self.lengths[0]]
        return tuple(sorted({fitting[0], fitting[-1]}))

    def extensions(self) -> list[tuple[int, int]]:
        """(context, length) buckets of a cached context extended by the tokens after it (extend_context)."""
        return [(c, t) for c in self.kept_contexts() for t in self.rest_lengths()]

    def completions_after_context(self) -> list[tuple[int, int, int]]:
        """(context, batch, length) buckets of per-position log-probabilities after a cached prompt."""
        return [(c, b, t) for c in self.kept_prompt_contexts() for t in self.rest_lengths()
                for b in self.completion_batches if b <= self.batch_for(t, self.completion_batches)]

    def split_completion_suffixes(self, lengths: list[int]) -> list[DeviceBatch]:
        """Prompts' rests after their cached parts (one context), as device batches of the grid."""
        return chunks(lengths, self.rest_lengths(), self.completion_batches, self.max_tokens,
                      self.batch_overhead_tokens)

    def heads(self) -> list[tuple[int, int]]:
        """(batch, labels) buckets of the vocabulary head: every batch a device batch's head reads."""
        shapes = self.layout.full_buckets(self.limits) + (
            self.layout.continuation_buckets(self.limits) if self.contexts() else [])
        return [(b, n) for b in sorted({self.layout.head_batch(s) for s in shapes}) for n in self.labels]

    def head_batches(self) -> list[int]:
        """The batch sizes a head reads (a classification head's buckets: one per batch, no label count)."""
        return sorted({b for b, _ in self.heads()})

    def split_full(self, lengths: list[int]) -> list[DeviceBatch]:
        """Whole sequences of these lengths (any order) as device batches."""
        return self.layout.split_full(self.limits, lengths)

    def split_suffixes(self, lengths: list[int]) -> list[DeviceBatch]:
        """Items of these lengths after a shared prefix (any order) as device batches."""
        return self.layout.split_continuations(self.limits, lengths)

    def split_completions(self, lengths: list[int]) -> list[DeviceBatch]:
        """Whole sequences of these lengths (any order), read at every position, as device batches of the grid."""
        return chunks(lengths, self.lengths, self.completion_batches, self.max_tokens, self.batch_overhead_tokens)

    def programs(self, task: str = "causal_lm") -> list[tuple[Program, tuple[int, ...]]]:
        """Every (program, bucket) a start compiles for a model of this task (causal_lm: label and per-position
        log-probabilities; sequence_classification: its class head)."""
        layout = self.layout
        programs = [(PROGRAMS["prefill_context"], (c,)) for c in self.contexts()]
        programs += [(layout.full_program, bucket) for bucket in self.full()]
        programs += [(layout.continuation_program, bucket) for bucket in self.continuations()]
        programs += [(PROGRAMS["extend_context"], bucket) for bucket in self.extensions()]
        if task == "causal_lm":
            programs += [(PROGRAMS["label_logprobs"], bucket) for bucket in self.heads()]
            programs += [(PROGRAMS["token_logprobs"], bucket) for bucket in self.completions()]
            if self.completions_after_context():
                programs += [(PROGRAMS["token_logprobs_context"], (c,)) for c in self.kept_prompt_contexts()]
                programs += [(PROGRAMS["token_logprobs_after_context"], b) for b in self.completions_after_context()]
            if self.lora:
                programs += [(PROGRAMS["lora_class_logits"], (b,)) for b in self.head_batches()]
        else:
            programs += [(PROGRAMS["class_logits"], (b,)) for b in self.head_batches()]
        return programs

    def count(self, task: str = "causal_lm") -> int:
        return len(self.programs(task))


def label_buckets(max_labels: int, steps: tuple[int, ...] | None = None) -> tuple[int, ...]:
    buckets = [n for n in (steps or (4, 16, 64, 256, 1024, 4096)) if n < max_labels]
    return tuple(buckets + [max_labels])
